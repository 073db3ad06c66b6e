"""Runs and times the benchmarks' jitted steps: counts compiles, checks host syncs.

Every case is timed in shuffled rounds between two windows of a baseline, and
the median over rounds of each ratio is what is reported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

# Re-exported: the benchmarks and tests read them as common.<name>.
from benchmarks.hlo import bytes_accessed, hlo_profile, one_element_read_bytes, peak_bytes
from benchmarks.machine import machine_info

__all__ = [
  "Case", "Timings", "bytes_accessed", "check_host_syncs", "compile_seconds", "finish_run",
  "flat_state", "hlo_profile", "in_turns", "interleaved_times", "machine_info", "median",
  "one_element_read_bytes", "page_bytes", "peak_bytes", "steps_per_round", "tree_bytes",
  "warm_up",
]  # fmt: skip

try:
  import resource  # POSIX: page-fault counts
except ImportError:
  resource = None

PyTree = Any
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_RUNNING: list[Case] = []  # the case whose steps are running, if any


def _on_event(name: str, seconds: float, **kwargs: Any) -> None:
  """Counts XLA backend compilations against the case whose steps are running."""
  del seconds, kwargs
  if name == _BACKEND_COMPILE and _RUNNING:
    _RUNNING[-1].backend_compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


@dataclasses.dataclass
class Case:
  """One variant of a benchmark: a jitted step that donates its state.

  Attributes:
    name: row label.
    fn: the step, ``fn(state, *args) -> state`` (a pure, untransformed function).
    state: the current state; replaced by each step's output.
    args: the non-donated arguments (gradients, a batch).
    bad_args: arguments holding an inf, to drive one skipped step through the
      same compiled step (None for variants that do not skip).
    traces: how many times ``fn`` was traced (a Python counter in the traced
      function).
    step: ``jax.jit(fn, donate_argnums=0)`` wrapped in the counter.
    host_syncs: None until checked; then 0, or a description of the transfer
      that ``jax.transfer_guard("disallow")`` refused.
    backend_compiles: XLA compilations that happened while the case's steps
      ran (a ``jax.monitoring`` listener); one per run is expected.
    compiles: ``backend_compiles`` at the end of the run.
    first_call_s: seconds of the first call: trace, lower, compile, one step.
    step_estimate_s: seconds per step during the host-sync check.
  """

  name: str
  fn: Callable[..., PyTree]
  state: PyTree
  args: tuple[Any, ...]
  bad_args: tuple[Any, ...] | None = None
  traces: int = 0
  step: Callable[..., PyTree] = dataclasses.field(init=False, repr=False)
  host_syncs: int | str | None = None
  backend_compiles: int = 0
  compiles: int | None = None
  first_call_s: float | None = None
  step_estimate_s: float | None = None

  def __post_init__(self) -> None:
    fn = self.fn

    @functools.wraps(fn)
    def counted(*args):
      self.traces += 1  # runs only while jax traces the step
      return fn(*args)

    self.step = jax.jit(counted, donate_argnums=0)

  def run(self, steps: int, args: tuple[Any, ...] | None = None) -> None:
    """Runs ``steps`` steps (asynchronously; no wait)."""
    args = self.args if args is None else args
    _RUNNING.append(self)
    try:
      for _ in range(steps):
        self.state = self.step(self.state, *args)
    finally:
      _RUNNING.pop()

  def wait(self) -> None:
    """Blocks until the last step's state is computed."""
    jax.block_until_ready(self.state)

  def compiled(self) -> Any:
    """Returns the step's executable, from jax's caches when it can.

    Else (a state class that rejects lowering placeholders) compiles the same
    computation afresh.
    """
    try:
      return self.step.lower(self.state, *self.args).compile()
    except TypeError:  # a state class that rejects lowering placeholders (jmp)
      fn, args = flat_state(self.fn, self.state, self.args)
      return jax.jit(fn, donate_argnums=0).lower(*args).compile()


def flat_state(
  fn: Callable[..., PyTree], state: PyTree, args: tuple[Any, ...]
) -> tuple[Callable[..., PyTree], tuple[Any, ...]]:
  """Rewrites ``fn`` to take the state as a flat list of leaves; returns it and its arguments.

  ``jit(...).lower`` rebuilds argument trees from placeholders, which some
  peers' pytree classes reject (jmp's ``DynamicLossScale``).
  """
  leaves, treedef = jax.tree.flatten(state)

  def flat(leaves, *a):
    return fn(treedef.unflatten(leaves), *a)

  return flat, (leaves, *args)


def warm_up(case: Case, steps: int = 2) -> None:
  """Compiles (timing the first call) and runs a few steps outside any guard."""
  start = time.perf_counter()
  case.run(1)
  case.wait()
  case.first_call_s = time.perf_counter() - start
  case.run(steps - 1)
  case.wait()


def check_host_syncs(case: Case, steps: int) -> None:
  """Runs ``steps`` steps under ``jax.transfer_guard("disallow")``.

  Any host-device transfer inside a step (an argument that is not already on
  the device, a value read back to decide something) raises; the result lands
  in ``case.host_syncs``: 0, or the error's first line.
  """
  start = time.perf_counter()
  try:
    with jax.transfer_guard("disallow"):
      case.run(steps)
      case.wait()
    case.host_syncs = 0
    case.step_estimate_s = (time.perf_counter() - start) / steps
  except Exception as error:  # any refusal is the finding
    case.host_syncs = str(error).splitlines()[0][:120]
    case.wait()


def finish_run(case: Case) -> None:
  """Drives one non-finite step (if the case skips) under the guard, then
  records how many executables the run compiled."""
  if case.bad_args is not None and case.host_syncs == 0:
    try:
      with jax.transfer_guard("disallow"):
        case.run(1, case.bad_args)
        case.wait()
    except Exception as error:  # any refusal is the finding
      case.host_syncs = "skipped step: " + str(error).splitlines()[0][:100]
  case.compiles = case.backend_compiles


def steps_per_round(baseline: Case, window_s: float, minimum: int, maximum: int = 200) -> int:
  """Picks enough steps for the baseline's timing window to last ``window_s``.

  Short windows of small steps are dominated by noise on a shared machine.
  """
  estimate = baseline.step_estimate_s or window_s
  return max(minimum, min(maximum, math.ceil(window_s / estimate)))


@dataclasses.dataclass
class Timings:
  """What :func:`interleaved_times` measured.

  Attributes:
    seconds: per case, seconds per step of each timing window.
    relative: per case, one entry per round: its time over the mean of the
      baseline windows timed just before and just after it.
    page_faults: per case, minor page faults per step of each window: memory
      the process touched for the first time (XLA:CPU maps a step's scratch
      buffers afresh on every call, so this counts scratch that is not reused).
    paired: per case that names a reference, one entry per round: its time
      over the mean of the reference's windows timed just before and just
      after it.
    references: the reference each paired case named.
  """

  seconds: dict[str, list[float]]
  relative: dict[str, list[float]]
  page_faults: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  paired: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  references: dict[str, str] = dataclasses.field(default_factory=dict)

  def median_ms(self, name: str) -> float:
    """Returns the median milliseconds per step of ``name``'s windows."""
    return 1e3 * median(self.seconds.get(name, []))

  def ratio(self, name: str, base: str) -> float:
    """Returns the median over rounds of ``name``'s time over ``base``'s.

    Each is measured against the baseline next to it in time, so slow phases of
    the machine cancel out.
    """
    pairs = zip(self.relative.get(name, []), self.relative.get(base, []), strict=False)
    return median([a / b for a, b in pairs])

  def paired_ratio(self, name: str) -> float | None:
    """Returns the median over rounds of ``name``'s time over its reference's.

    The reference's windows are those adjacent in the same round; None for a
    case without a reference.
    """
    values = self.paired.get(name)
    return median(values) if values else None


def interleaved_times(
  cases: Sequence[Case],
  baseline: Case,
  rounds: int,
  steps_per_round: int,
  seed: int = 0,
  references: Mapping[str, str] | None = None,
) -> Timings:
  """Times every case in ``rounds`` rounds, each next to the baseline.

  A round runs a window of the baseline, of one case, of the baseline again,
  and so on through all cases in a freshly shuffled order. A case that names a
  reference in ``references`` runs between two windows of that reference too
  (baseline, reference, case, reference, baseline); those extra windows count
  in no case's ``seconds``. Cases that passed the host-sync check run under
  ``jax.transfer_guard("disallow")``.

  Args:
    cases: the cases to time (the baseline among them or not).
    baseline: the case every other one is timed next to.
    rounds: how many rounds.
    steps_per_round: steps in each timing window.
    seed: seeds the shuffles.
    references: case name -> name of another case in ``cases``.

  Returns:
    The per-window times and the per-round ratios.
  """
  rng = random.Random(seed)
  by_name = {c.name: c for c in (baseline, *cases)}
  references = dict(references or {})
  missing = sorted(r for r in references.values() if r not in by_name)
  if missing:
    raise ValueError(f"reference cases {missing} are not among the cases timed")
  seconds: dict[str, list[float]] = {c.name: [] for c in (baseline, *cases)}
  relative: dict[str, list[float]] = {c.name: [] for c in (baseline, *cases)}
  faults: dict[str, list[float]] = {c.name: [] for c in (baseline, *cases)}
  paired: dict[str, list[float]] = {name: [] for name in references}

  def timed(case: Case, record: bool = True) -> float:
    case.wait()
    guard = "disallow" if case.host_syncs == 0 else "allow"
    with jax.transfer_guard(guard):
      faults_before = _minor_page_faults()
      start = time.perf_counter()
      case.run(steps_per_round)
      case.wait()
      elapsed = (time.perf_counter() - start) / steps_per_round
      fresh = (_minor_page_faults() - faults_before) / steps_per_round
    if record:
      seconds[case.name].append(elapsed)
      faults[case.name].append(fresh)
    return elapsed

  order = [c for c in cases if c is not baseline]
  for _ in range(rounds):
    rng.shuffle(order)
    before = timed(baseline)
    relative[baseline.name].append(1.0)
    for case in order:
      reference = by_name.get(references.get(case.name, ""))
      if reference is not None:
        ref_before = timed(reference, record=False)
      elapsed = timed(case)
      if reference is not None:
        ref_after = timed(reference, record=False)
        paired[case.name].append(elapsed / (0.5 * (ref_before + ref_after)))
      after = timed(baseline)
      relative[case.name].append(elapsed / (0.5 * (before + after)))
      before = after
  return Timings(seconds, relative, faults, paired, references)


def _minor_page_faults() -> int:
  """Counts this process's minor page faults so far (0 where the OS does not say)."""
  if resource is None:
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def page_bytes() -> int:
  """Returns the size of a memory page (what one minor page fault maps)."""
  try:
    return os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return 4096


def median(values: Sequence[float]) -> float:
  """Returns the median, or NaN for no values."""
  return statistics.median(values) if values else float("nan")


def compile_seconds(cases: Sequence[Case], repeats: int, seed: int = 0) -> dict[str, list[float]]:
  """Measures the trace + lower + compile seconds of each case's step.

  The first sample is the case's first call (:func:`warm_up`; it includes one
  step, negligible at the sizes this is used on); each further repeat compiles
  a freshly wrapped function, so neither jax's tracing cache nor its in-memory
  executable cache answers, interleaved across cases in a shuffled order.
  """
  rng = random.Random(seed)
  out: dict[str, list[float]] = {c.name: [c.first_call_s] for c in cases}
  order = list(cases)
  for _ in range(repeats - 1):
    rng.shuffle(order)
    for case in order:
      name = case.name
      fn, args = flat_state(case.fn, case.state, case.args)

      def fresh(*a, _fn=fn):
        return _fn(*a)

      start = time.perf_counter()
      jax.jit(fresh, donate_argnums=0).lower(*args).compile()
      out[name].append(time.perf_counter() - start)
  return out


def tree_bytes(tree: PyTree) -> int:
  """Counts the bytes of a tree's arrays."""
  return int(sum(np.dtype(x.dtype).itemsize * np.prod(x.shape) for x in jax.tree.leaves(tree)))


def in_turns(runs: dict[str, list[Any]], rounds: int, *inputs: Any) -> dict[str, float]:
  """Returns each run's median seconds over ``rounds`` rounds that call every
  run once, after two warm-up rounds (the first compiles). A run is ``[step,
  a, b]``, called as ``a, b = step(a, b, *inputs)`` (its params and state,
  donated)."""
  times: dict[str, list[float]] = {name: [] for name in runs}
  for round_ in range(rounds + 2):
    for name, run in runs.items():
      start = time.perf_counter()
      run[1], run[2] = run[0](run[1], run[2], *inputs)
      jax.block_until_ready(run[1])
      if round_ >= 2:
        times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}
