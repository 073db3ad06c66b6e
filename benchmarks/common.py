"""Timing, compile counting, host-sync checks and HLO profiles shared by the benchmarks.

The machine the benchmarks run on is small and shared, so no single timing is
trusted: every variant of one benchmark is kept alive at once, the variants run
in a shuffled order in each of several rounds, each timed between two windows
of the baseline (and, where it names one, between two windows of its own
reference case), and what is reported is the median over rounds of the
per-step time and of the ratios to the adjacent windows.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import platform
import random
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

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
    jax.block_until_ready(self.state)

  def compiled(self) -> Any:
    """The step's executable, from jax's caches when it can (no new trace or
    compile); else a fresh compile of the same computation."""
    try:
      return self.step.lower(self.state, *self.args).compile()
    except TypeError:  # a state class that rejects lowering placeholders (jmp)
      fn, args = flat_state(self.fn, self.state, self.args)
      return jax.jit(fn, donate_argnums=0).lower(*args).compile()


def flat_state(
  fn: Callable[..., PyTree], state: PyTree, args: tuple[Any, ...]
) -> tuple[Callable[..., PyTree], tuple[Any, ...]]:
  """``fn`` taking the state as a flat list of leaves, and its arguments.

  ``jit(...).lower`` rebuilds argument trees from placeholder objects, which
  some peers' pytree classes reject in their constructors (jmp's
  ``DynamicLossScale``); a flat list of arrays lowers the same computation.
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
  """Enough steps for the baseline's timing window to last ``window_s``: short
  windows of small steps are dominated by noise on a shared machine."""
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
    return 1e3 * median(self.seconds.get(name, []))

  def ratio(self, name: str, base: str) -> float:
    """Median over rounds of ``name``'s time over ``base``'s; each measured
    against the baseline next to it in time, so slow phases of the machine
    cancel out."""
    pairs = zip(self.relative.get(name, []), self.relative.get(base, []), strict=False)
    return median([a / b for a, b in pairs])

  def paired_ratio(self, name: str) -> float | None:
    """Median over rounds of ``name``'s time over its reference's adjacent
    windows in the same round; None for a case without a reference."""
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

  A round runs ``steps_per_round`` steps of the baseline, then of one case,
  then of the baseline again, and so on through all cases in a freshly
  shuffled order: every case's time is compared with baseline windows timed
  just before and after it. A case that names a reference in ``references``
  runs between two windows of that reference instead (baseline, reference,
  case, reference, baseline), so its ratio to the reference is taken against
  windows adjacent in time too; those extra windows count in no case's
  ``seconds``. Steps run under ``jax.transfer_guard("disallow")`` for the
  cases that passed the host-sync check.

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
  """This process's minor page faults so far (0 where the OS does not say)."""
  if resource is None:
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def page_bytes() -> int:
  """The size of a memory page (what one minor page fault maps)."""
  try:
    return os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return 4096


def median(values: Sequence[float]) -> float:
  return statistics.median(values) if values else float("nan")


def compile_seconds(cases: Sequence[Case], repeats: int, seed: int = 0) -> dict[str, list[float]]:
  """Trace + lower + compile seconds of each case's step.

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


# The first line of a computation in HLO text: its name, then its signature.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\(")


def hlo_profile(compiled: Any) -> dict[str, int]:
  """Counts the instructions XLA runs, by opcode, outside fused computations.

  Returns a dict with the counts of ``fusion`` kernels (``custom_fusions``:
  those XLA:CPU hands to a library such as YNNPACK, ``kind=kCustom``),
  standalone ``copy`` instructions, ``conditional``s, the instructions inside
  conditional branches, the temporary buffer bytes, and the bytes XLA's cost
  model says the step accesses (-1 where it does not say).
  """
  counts = {"fusion": 0, "copy": 0, "conditional": 0, "in_branches": 0, "custom_fusions": 0}
  text = compiled.as_text()
  branch_names = set()
  for match in re.finditer(r"conditional\(.*?branch_computations=\{([^}]*)\}", text):
    branch_names.update(n.strip().lstrip("%") for n in match.group(1).split(","))
  for match in re.finditer(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", text):
    branch_names.update(match.groups())
  computation = None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    if computation is None or "fused" in computation or "fusion" in computation:
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op = m.group(1)
    if op in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
      continue
    if computation in branch_names:
      counts["in_branches"] += 1
    if op in counts:
      counts[op] += 1
    if op == "fusion" and "kind=kCustom" in line:
      counts["custom_fusions"] += 1
  memory = compiled.memory_analysis()
  counts["temp_bytes"] = int(getattr(memory, "temp_size_in_bytes", 0) or 0)
  accessed = bytes_accessed(compiled)
  counts["bytes_accessed"] = -1 if accessed is None else int(accessed)
  counts["one_element_read_bytes"] = one_element_read_bytes(text)
  return counts


_ELEMENT_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ")
_FUSION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\S+) fusion\((.*?)\), .*calls=%([\w.\-]+)")


def _type_bytes(hlo_type: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(hlo_type):
    if dtype in _ELEMENT_BYTES:
      total += _ELEMENT_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def one_element_read_bytes(hlo_text: str) -> int:
  """Bytes XLA's cost model counts for kernels that read one element.

  A kernel whose result is one element taken by a ``slice`` of its operands
  (mpx's ordering of in-place writes reads one element of each large output;
  see ``mixed_precision._after``) reads that element, but
  ``cost_analysis()["bytes accessed"]`` counts each operand whole wherever
  elementwise ops stand between the operand and the slice (checked: ``(y,
  ravel(y)[:1])`` for ``y = x * 2`` counts 12 bytes an element, ``y``
  alone 8). Returns the bytes those kernels are charged beyond the element
  each reads, so a benchmark can report the count without them.
  """
  types: dict[str, str] = {}
  computations: dict[str, str] = {}
  name = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = header.group(1)
      computations[name] = ""
      continue
    if name is not None:
      computations[name] += line + "\n"
    m = _DEFINITION.match(line)
    if m:
      types[m.group(1)] = m.group(2)
  total = 0
  for line in hlo_text.splitlines():
    m = _FUSION.match(line)
    if not m or _type_bytes(m.group(1)) == 0:
      continue
    result_elements = sum(
      math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(m.group(1))
    )
    if result_elements != 1 or " slice(" not in computations.get(m.group(3), ""):
      continue
    operands = [o.strip().lstrip("%") for o in m.group(2).split(",") if o.strip()]
    # Charged: every operand whole; read: the one element it returns.
    total += sum(_type_bytes(types.get(o, "")) for o in operands) - _type_bytes(m.group(1))
  return total


def bytes_accessed(compiled: Any) -> float | None:
  """``compiled.cost_analysis()["bytes accessed"]``: XLA's count of the bytes
  its kernels read and write (operands and outputs of each, as the compiled
  HLO stands), a device-independent view of how well the step fuses.

  Returns:
    The figure, or None where the backend gives no cost analysis.
  """
  try:
    cost = compiled.cost_analysis()
  except (NotImplementedError, RuntimeError):
    return None
  # Older jax returns one dict per program of the executable (one here: a
  # single device), newer jax the dict itself.
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not isinstance(cost, Mapping):
    return None
  value = cost.get("bytes accessed")
  return None if value is None else float(value)


def peak_bytes(compiled: Any) -> tuple[int, str]:
  """Peak memory of one step and where the figure comes from.

  XLA:CPU reports no allocator statistics (``memory_stats()`` is None), so the
  compiled step's own analysis is used: arguments + outputs not aliased to a
  donated argument + temporaries.
  """
  stats = jax.local_devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device allocator"
  m = compiled.memory_analysis()
  total = (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )
  return int(total), "compiled.memory_analysis()"


def tree_bytes(tree: PyTree) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * np.prod(x.shape) for x in jax.tree.leaves(tree)))


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def mpx_provenance() -> str:
  """mpx's version, and the commit of the checkout it was imported from."""
  import mpx

  text = mpx.__version__
  root = os.path.dirname(os.path.dirname(os.path.abspath(mpx.__file__)))
  try:
    commit = subprocess.run(
      ["git", "-C", root, "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      timeout=10,
      check=True,
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "-C", root, "status", "--porcelain", "--", "mpx"],
      capture_output=True,
      text=True,
      timeout=10,
      check=True,
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return text
  return f"{text} at commit {commit}" + (" with uncommitted changes in mpx/" if dirty else "")


def machine_info() -> dict[str, str]:
  """What the report says about where it ran."""
  import flax
  import optax

  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count() or 0
  try:
    with open("/proc/meminfo") as f:
      kib = int(f.readline().split()[1])
    memory = f"{kib / 2**20:.0f} GiB"
  except (OSError, ValueError, IndexError):
    memory = "?"
  device = jax.devices()[0]
  return {
    "mpx": mpx_provenance(),
    "cpu": cpu_model(),
    "cores": str(cores),
    "memory": memory,
    "device": f"{device.platform} ({device.device_kind})",
    "python": platform.python_version(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "flax": flax.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    "malloc": malloc_settings(),
  }


def malloc_settings() -> str:
  """This process's allocator settings, as the environment set them when it
  started: glibc malloc's tunables and any preloaded library."""
  names = sorted(k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
  if os.environ.get("LD_PRELOAD"):
    names.append("LD_PRELOAD")
  if not names:
    return "glibc defaults"
  return " ".join(f"{k}={os.environ[k]}" for k in names)
