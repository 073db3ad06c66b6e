"""Where an optimizer step's compile time goes: tracing, lowering, XLA.

For the check-then-apply step and mpx bf16 and fp16 on a many-leaf tree: each
stage's seconds, the program's size at each stage, mpx's HLO per leaf beyond
the hand step's, tracing's hot spots (``--cprofile``). ``PYTHONPATH`` picks mpx.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import importlib.util
import io
import json
import os
import pathlib
import pstats
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
from jax.extend import core as jax_core  # noqa: E402

from benchmarks import optimizer_step as opt_bench  # noqa: E402

HAND = "hand bf16 + cond"
HAND_FP16 = "hand fp16 + cond"
STEPS: dict[str, Callable[..., Any]] = {
  HAND: opt_bench.build_hand_cond_bf16,
  HAND_FP16: opt_bench.build_hand_cond,
  "mpx bf16": opt_bench.build_mpx_bf16,
  "mpx fp16": opt_bench.build_mpx_fp16,
}

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
# Lazy up to the first " opcode(": tuple shapes hold "/*index=5*/" comments.
_OPCODE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(")
_MLIR_OP = re.compile(r"=\s*\"?([a-z_]+\.[a-z_0-9]+)")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def stage_seconds(fn: Callable[..., Any], args: tuple[Any, ...]) -> dict[str, Any]:
  """Measures the trace, lower and compile seconds of a fresh ``jit(fn, donate_argnums=0)``.

  Wall-clock and this process's CPU time (all threads), and each stage's
  artefact; CPU time moves less than wall time on a loaded machine.
  """

  def fresh(*a):
    return fn(*a)

  jitted = jax.jit(fresh, donate_argnums=0)
  clock = [(time.perf_counter(), time.process_time())]
  traced = jitted.trace(*args)
  clock.append((time.perf_counter(), time.process_time()))
  lowered = traced.lower()
  clock.append((time.perf_counter(), time.process_time()))
  compiled = lowered.compile()
  clock.append((time.perf_counter(), time.process_time()))
  out: dict[str, Any] = {"traced": traced, "lowered": lowered, "compiled": compiled}
  for i, stage in enumerate(("trace", "lower", "compile")):
    out[f"{stage}_s"] = clock[i + 1][0] - clock[i][0]
    out[f"{stage}_cpu_s"] = clock[i + 1][1] - clock[i][1]
  out["total_s"] = clock[-1][0] - clock[0][0]
  out["total_cpu_s"] = clock[-1][1] - clock[0][1]
  return out


def jaxpr_eqns(jaxpr: Any) -> int:
  """Counts the equations of a jaxpr, those of sub-jaxprs (branches, nested jits) too."""
  total = 0
  for eqn in jaxpr.eqns:
    total += 1
    for sub in jax_core.jaxprs_in_params(eqn.params):
      total += jaxpr_eqns(sub)
  return total


def hlo_counts(text: str) -> dict[str, Any]:
  """Counts computations by kind, and instructions by opcode inside fusions and outside.

  Parameters, constants, tuples and bitcasts are left out.
  """
  outside: collections.Counter[str] = collections.Counter()
  fused: collections.Counter[str] = collections.Counter()
  computations = 0
  fused_computations = 0
  name = ""
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = header.group(2)
      computations += 1
      fused_computations += "fused" in name or "fusion" in name
      continue
    match = _OPCODE.match(line)
    if not match or match.group(1) in _FREE:
      continue
    (fused if ("fused" in name or "fusion" in name) else outside)[match.group(1)] += 1
  return {
    "computations": computations,
    "fused_computations": fused_computations,
    "fusion": outside["fusion"],
    "conditional": outside["conditional"],
    "while": outside["while"],
    "instructions_outside": sum(outside.values()),
    "instructions_fused": sum(fused.values()),
    "outside": dict(outside),
    "fused": dict(fused),
  }


def stablehlo_ops(text: str) -> collections.Counter[str]:
  """Counts the ops of StableHLO text by name."""
  return collections.Counter(m.group(1) for m in _MLIR_OP.finditer(text))


def cprofile_trace(fn: Callable[..., Any], args: tuple[Any, ...], top: int) -> str:
  """Profiles tracing a fresh jit of ``fn``: mpx's functions by cumulative time, then all by own.

  cProfile slows tracing: compare rows, not totals.
  """

  def fresh(*a):
    return fn(*a)

  profiler = cProfile.Profile()
  profiler.enable()
  jax.jit(fresh, donate_argnums=0).trace(*args)
  profiler.disable()
  out = io.StringIO()
  stats = pstats.Stats(profiler, stream=out)
  # mpx's own functions by cumulative time, then everything by own time.
  stats.sort_stats("cumulative").print_stats(r"mpx/_src|optax/_src/(base|transform)", top)
  stats.sort_stats("tottime").print_stats(top // 2)
  return out.getvalue()


def main(argv: list[str] | None = None) -> int:
  """Compiles the steps the flags name and prints their profiles."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--leaves", type=int, default=300)
  parser.add_argument("--side", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3, help="fresh compilations per step")
  parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated")
  parser.add_argument("--cprofile", action="store_true", help="profile tracing of the mpx steps")
  parser.add_argument("--top", type=int, default=40, help="cProfile rows")
  parser.add_argument("--json", help="write the numbers here")
  parser.add_argument("--dump-hlo", help="directory for each step's optimized HLO text")
  parser.add_argument(
    "--extra",
    help="a Python file defining STEPS = {name: build(p32, grads)}: prototype steps to "
    "measure beside these (name them in --steps)",
  )
  args = parser.parse_args(argv)
  if args.extra:
    spec = importlib.util.spec_from_file_location("compile_profile_extra", args.extra)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    STEPS.update(module.STEPS)

  import mpx

  print(f"mpx from {pathlib.Path(mpx.__file__).parent}; jax {jax.__version__}")
  shapes = opt_bench.many_leaf_shapes(args.leaves, args.side)
  p32, g32 = opt_bench.make_arrays(shapes)
  grads = opt_bench.make_grads(g32)
  names = [s.strip() for s in args.steps.split(",") if s.strip()]
  stage_samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
  last: dict[str, dict[str, Any]] = {}
  rng = random.Random(0)
  order = list(names)
  for _ in range(args.repeats):
    rng.shuffle(order)
    for name in order:
      # Built afresh each time: a new transformation, so no cache keyed on it
      # (jax.eval_shape of its init, say) answers, as in a user's first trace.
      fn, state, g = STEPS[name](p32, grads)
      result = stage_seconds(fn, (state, g))
      stage_samples[name].append({k: v for k, v in result.items() if k.endswith("_s")})
      last[name] = result
      del fn, state, g
    gc.collect()

  summary: dict[str, Any] = {"leaves": args.leaves, "side": args.side, "steps": {}}
  base = HAND if HAND in names else names[0]
  print(
    f"\n{args.leaves} leaves of {args.side}x{args.side}; median of {args.repeats} fresh "
    f"compilations (load average {os.getloadavg()[0]:.1f}); x = median over rounds of the "
    f"ratio to {base} in the same round"
  )
  print(
    f"{'step':18} {'trace s':>8} {'lower s':>8} {'XLA s':>7} {'total s':>8} {'x':>5} "
    f"{'cpu s':>7} {'x cpu':>5}"
  )
  for name in names:
    samples = stage_samples[name]
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    ratio = {
      key: statistics.median(
        s[key] / b[key] for s, b in zip(samples, stage_samples[base], strict=True)
      )
      for key in ("total_s", "total_cpu_s", "trace_s", "lower_s", "compile_s")
    }
    result = last[name]
    text = result["compiled"].as_text()
    counts = hlo_counts(text)
    shlo = stablehlo_ops(result["lowered"].as_text())
    summary["steps"][name] = {
      **med,
      "x_base": ratio,
      "samples": samples,
      "jaxpr_eqns": jaxpr_eqns(result["traced"].jaxpr.jaxpr),
      "stablehlo_ops": sum(shlo.values()),
      "stablehlo": dict(shlo),
      **counts,
    }
    if args.dump_hlo:
      out = pathlib.Path(args.dump_hlo)
      out.mkdir(parents=True, exist_ok=True)
      (out / (name.replace(" ", "_").replace("+", "") + ".hlo.txt")).write_text(text)
    print(
      f"{name:18} {med['trace_s']:8.2f} {med['lower_s']:8.2f} {med['compile_s']:7.2f} "
      f"{med['total_s']:8.2f} {ratio['total_s']:5.2f} {med['total_cpu_s']:7.2f} "
      f"{ratio['total_cpu_s']:5.2f}"
    )
  print(
    f"\n{'step':18} {'jaxpr eqns':>10} {'stablehlo':>9} {'fusions':>7} {'cond':>4} "
    f"{'while':>5} {'instr out':>9} {'instr fused':>11} {'fused/leaf':>10}"
  )
  for name, step in summary["steps"].items():
    print(
      f"{name:18} {step['jaxpr_eqns']:10d} {step['stablehlo_ops']:9d} {step['fusion']:7d} "
      f"{step['conditional']:4d} {step['while']:5d} {step['instructions_outside']:9d} "
      f"{step['instructions_fused']:11d} {step['instructions_fused'] / args.leaves:10.1f}"
    )

  steps = summary["steps"]
  pairs = [(m, h) for m in steps if m.startswith("mpx") for h in (HAND, HAND_FP16) if h in steps]
  for name, base in pairs:
    step, hand = steps[name], steps[base]
    print(f"\n{name} minus {base}, per leaf:")
    for where in ("outside", "fused", "stablehlo"):
      keys = set(step[where]) | set(hand[where])
      diff = {k: (step[where].get(k, 0) - hand[where].get(k, 0)) / args.leaves for k in keys}
      shown = sorted(((v, k) for k, v in diff.items() if abs(v) >= 0.05), reverse=True)
      print(f"  {where:9}: " + ", ".join(f"{k} {v:+.2f}" for v, k in shown))
    print(f"  jaxpr eqns: {(step['jaxpr_eqns'] - hand['jaxpr_eqns']) / args.leaves:+.1f}")

  if args.cprofile:
    for name in (n for n in names if n.startswith("mpx")):
      fn, state, g = STEPS[name](p32, grads)
      print(f"\n=== cProfile of tracing {name} ===")
      print(cprofile_trace(fn, (state, g), args.top))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
