"""Compressed optimizer moments (``mixed_precision(moments=...)``), measured in one run.

For AdamW on bfloat16 params, in each storage mode of the masters (``full``,
``remainder``, ``stochastic``) with each storage of the moments (``full``,
``bfloat16``, ``8bit``):

1. Memory: bytes of the whole optimizer state per parameter, summed over the
   leaves of a real state on one large leaf (``--memory-shape``), beside what
   the peers keep per parameter (by construction, from what each stores; not
   measured here) and what each keeps exact.
2. Speed: the jitted step (``mixed_precision(optax.adamw(...))`` update and
   ``optax.apply_updates``, state and params donated, as
   :mod:`benchmarks.optimizer_step` builds the mpx steps) on its
   transformer-shaped trees (``--sizes``). Each masters mode is timed as one
   group: in every round, in a shuffled order, each compressed-moment step runs
   between two windows of the full-moment step of the same mode, and its ratio
   for the round is its time over the mean of those two windows
   (:func:`benchmarks.common.interleaved_times`); printed is the median over
   rounds, beside the goals (CPU: 8bit <= 1.3x, bfloat16 <= 1.1x).
3. Bytes moved per step per parameter, XLA's own count
   (``compiled.cost_analysis()["bytes accessed"]``), the same less what XLA
   charges the one-element reads that order the compressed moments' in-place
   writes (each operand counted whole: :func:`benchmarks.common.one_element_read_bytes`),
   and the difference of the latter from the full-moment step of the same mode
   (goal: 8bit moves at least 8 B/param fewer: AdamW's float32 moments are 16
   B/param read and written, codes and scales about 4).

The process runs with glibc malloc told to keep large blocks and to use one
arena (``benchmarks/run.py``'s ``NO_MMAP_MALLOC``, read when a process starts:
the script starts itself again with them unless ``--malloc as-is``), the
setting the storage modes are timed under.

Run from the repository root::

  python benchmarks/moments.py                      # 16M and 64M params
  python benchmarks/moments.py --sizes 16M --out moments.md --json moments.json
  python benchmarks/moments.py --smoke              # tiny sizes; structure only

Prints a markdown section; ``--out`` also writes it to a file. On a 2-core CPU
shared with other jobs, ``--sizes 16M`` took 130 s (30 s of it the memory
table) and the default run is estimated at about seven minutes; at 64M the
three steps of one masters mode are alive at once, about 3 GiB. ``--smoke``
takes under a minute, most of it compiling the nine steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpx  # noqa: E402
from benchmarks import common, report  # noqa: E402
from benchmarks import optimizer_step as opt_bench  # noqa: E402
from benchmarks import run as run_bench  # noqa: E402

MASTERS = ("full", "remainder", "stochastic")
MOMENTS = ("full", "bfloat16", "8bit")
LR = 1e-3
DEFAULT_SIZES = "16M,64M"
SMOKE_SIZES = "64K"
DEFAULT_MEMORY_SHAPE = (4096, 4096)
SMOKE_MEMORY_SHAPE = (64, 1024)
# Optimizer-state bytes per parameter the issue expects for AdamW on bf16
# params with large leaves (masters 4 / 2 / 0 B, moments 8 / 4 / 2 B); 8bit may
# add its float32 block scales, at most 0.08 B/param.
EXPECTED_STATE_BPP = {
  (masters, moments): master + moment
  for masters, master in zip(MASTERS, (4, 2, 0), strict=True)
  for moments, moment in zip(MOMENTS, (8, 4, 2), strict=True)
}
SCALES_ALLOWANCE = 0.08
# Speed goals on a CPU: a compressed-moment step over the full-moment step of
# the same masters mode, paired in every round.
SPEED_GOALS = {"bfloat16": 1.1, "8bit": 1.3}
# 8bit's bytes moved per step per parameter, at least this far below the
# full-moment step's (XLA's count).
BYTES_SAVED_GOAL = 8.0

# AdamW elsewhere, by construction (what each stores per parameter, from its
# source or its authors' figures), not measured here: (optimizer, param B,
# state B, what keeps the master, how the moments are kept, what is counted).
PEER_MOMENTS = (
  (
    "PyTorch AMP / apex O2: float32 master, float32 m and v",
    2,
    12,
    "exact (float32)",
    "exact (float32)",
    "float32 master + m + v",
  ),
  (
    "bitsandbytes AdamW8bit, float32 params (AMP)",
    4,
    2.03,
    "exact (the float32 param)",
    "8-bit dynamic map, float32 absmax per 256",
    "uint8 m and v + a float32 absmax per 256 elements each (2 + 8/256); tensors "
    "under 4,096 elements keep float32 m and v",
  ),
  (
    "bitsandbytes AdamW8bit, bf16 params",
    2,
    2.03,
    "none: updates land in the bf16 param",
    "8-bit dynamic map, float32 absmax per 256",
    "as above, no master",
  ),
  (
    "torchao AdamW8bit, bf16_stochastic_round=True",
    2,
    2.03,
    "none: param rounded stochastically",
    "8-bit dynamic map, float32 scale per 256",
    "uint8 m and v + a float32 scale per 256 elements each",
  ),
  (
    "torchao AdamW4bit, bf16_stochastic_round=True",
    2,
    1.06,
    "none: param rounded stochastically",
    "4-bit, float32 scale per 128",
    "two 4-bit codes per byte for m and v + a float32 scale per 128 elements each",
  ),
  (
    "TransformerEngine FusedAdam, fp32 master, bf16 m and v (TE #1640)",
    2,
    8,
    "exact (float32)",
    "bf16, rounded to nearest",
    "float32 master + bf16 m + v",
  ),
  (
    "TransformerEngine FusedAdam, store_param_remainders, bf16 m and v",
    2,
    6,
    "exact (int16 remainder)",
    "bf16, rounded to nearest",
    "int16 remainder + bf16 m + v (the options combine in its source; not run here)",
  ),
  (
    "TransformerEngine FusedAdam, store_param_remainders, FP8 m and v",
    2,
    4,
    "exact (int16 remainder)",
    "FP8 E4M3, one float32 scale per tensor",
    "int16 remainder + 1-byte m + v; below about 2**-18 of the tensor's largest an "
    "element rounds to 0",
  ),
  (
    "FlashOptim AdamW (default)",
    2,
    3,
    "lossy: 24-bit split master",
    "8-bit",
    "5 B/param for params + state, as its authors count it: bf16 param + 1-byte "
    "correction + 8-bit m + v",
  ),
  (
    "optax.adamw(mu_dtype=bfloat16), float32 params",
    4,
    6,
    "exact (the float32 param)",
    "mu bf16 (cast to nearest), nu float32",
    "bf16 mu + float32 nu; optax has no nu_dtype (#1552)",
  ),
)


# --- The steps -----------------------------------------------------------------------


def transformation(masters: str, moments: str) -> optax.GradientTransformation:
  return mpx.mixed_precision(optax.adamw(LR), masters=masters, moments=moments)


def name_of(masters: str, moments: str) -> str:
  return f"masters {masters}, moments {moments}"


def build_case(p32: Any, grads: Any, bad_grads: Any, masters: str, moments: str) -> common.Case:
  tx = transformation(masters, moments)
  state = opt_bench.mpx_bf16_state(tx, masters, p32)
  return common.Case(
    name_of(masters, moments), opt_bench._mpx_step(tx), state, (grads,), (bad_grads,)
  )


# --- 1. Memory -----------------------------------------------------------------------


def state_bytes(opt_state: Any) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(opt_state)))


def memory(shape: tuple[int, int]) -> list[dict[str, Any]]:
  """The optimizer state's bytes per parameter on one bf16 leaf of ``shape``,
  for every (masters, moments), from a real state (one at a time)."""
  n = math.prod(shape)
  p32 = jnp.asarray(np.random.default_rng(0).standard_normal(shape, np.float32) * 0.02)
  rows = []
  for masters in MASTERS:
    for moments in MOMENTS:
      _, opt = opt_bench.mpx_bf16_state(transformation(masters, moments), masters, p32)
      jax.block_until_ready(opt)
      bpp = state_bytes(opt) / n
      expected = EXPECTED_STATE_BPP[masters, moments]
      allowance = SCALES_ALLOWANCE if moments == "8bit" else 0.0
      rows.append(
        {
          "masters": masters,
          "moments": moments,
          "state_bpp": bpp,
          "expected": expected,
          "allowance": allowance,
          # A few scalars (counts, a key) aside: 0.01 B/param covers them on
          # any leaf of 4096 elements and more.
          "within": expected <= bpp <= expected + allowance + 0.01,
        }
      )
      del opt
      gc.collect()
  return rows


# --- 2 and 3. Speed and bytes moved ---------------------------------------------------


def rounds_for(n: int, rounds: int | None) -> int:
  if rounds:
    return rounds
  return run_bench.DEFAULT_ROUNDS_LARGE if n >= run_bench.LARGE_PARAMS else run_bench.DEFAULT_ROUNDS


def speed_size(args: argparse.Namespace, target: int) -> dict[str, Any]:
  """Every (masters, moments) step on a transformer-shaped tree of about
  ``target`` params: times paired with the full-moment step of the same masters
  mode, XLA's bytes accessed, scratch and kernels."""
  shapes = opt_bench.param_shapes(target, args.layers)
  n = opt_bench.n_params(shapes)
  p32, g32 = opt_bench.make_arrays(shapes)
  grads = opt_bench._copy(g32, opt_bench.BF16)
  bad = opt_bench.with_inf(grads)
  del g32
  rounds = rounds_for(n, args.rounds)
  rows: dict[str, dict[str, Any]] = {}
  run_bench.log(f"{report.size_label(n)} params ({run_bench.describe_tree(shapes)})")
  for masters in MASTERS:
    cases = [build_case(p32, grads, bad, masters, moments) for moments in MOMENTS]
    full = cases[0]
    for case in cases:
      common.warm_up(case)
    for case in cases:
      common.check_host_syncs(case, steps=2)
    steps = common.steps_per_round(full, args.window, args.steps)
    # The full-moment step is the baseline: every other case's per-round ratio
    # is to the two full-moment windows just before and after it.
    times = common.interleaved_times(cases, full, rounds, steps)
    for case in cases:
      common.finish_run(case)
    base_profile = common.hlo_profile(full.compiled())
    for moments, case in zip(MOMENTS, cases, strict=True):
      profile = base_profile if case is full else common.hlo_profile(case.compiled())
      # XLA's count, less what it charges the one-element reads that order
      # compressed moments' in-place writes (common.one_element_read_bytes).
      accessed = profile["bytes_accessed"] - profile["one_element_read_bytes"]
      base_accessed = base_profile["bytes_accessed"] - base_profile["one_element_read_bytes"]
      rows[case.name] = {
        "masters": masters,
        "moments": moments,
        "ms": times.median_ms(case.name),
        "x_full": None if case is full else times.ratio(case.name, full.name),
        "x_full_rounds": [] if case is full else times.relative[case.name],
        "accessed_bpp": None if accessed < 0 else accessed / n,
        "xla_accessed_bpp": None
        if profile["bytes_accessed"] < 0
        else profile["bytes_accessed"] / n,
        "saved_bpp": None if min(accessed, base_accessed) < 0 else (base_accessed - accessed) / n,
        "temp_bpp": profile["temp_bytes"] / n,
        "fusions": profile["fusion"],
        "state_bpp": state_bytes(case.state[1]) / n,
        "host_syncs": case.host_syncs,
        "compiles": case.compiles,
        "traces": case.traces,
        "first_call_s": case.first_call_s,
      }
    run_bench.log(f"  masters {masters}: timed ({rounds} rounds of {steps} steps)")
    del cases, full, times
    gc.collect()
  return {
    "label": report.size_label(n),
    "n": n,
    "desc": run_bench.describe_tree(shapes),
    "rounds": rounds,
    "rows": rows,
  }


# --- The report ------------------------------------------------------------------------


def _goal(moments: str, ratio: float | None) -> str:
  if moments not in SPEED_GOALS:
    return "-"
  limit = SPEED_GOALS[moments]
  return f"<= {limit:.1f}x: " + report._verdict(ratio, limit, "{0:.0%}")


def _bytes_goal(moments: str, saved: float | None) -> str:
  if moments != "8bit":
    return "-"
  if saved is None:
    return "not measured"
  verdict = "met" if saved >= BYTES_SAVED_GOAL else f"**missed** by {BYTES_SAVED_GOAL - saved:.1f}"
  return f">= {BYTES_SAVED_GOAL:.0f} fewer: {verdict}"


def memory_section(rows: list[dict[str, Any]], shape: tuple[int, int]) -> list[str]:
  f = report._f
  table_rows = []
  for r in rows:
    exact_master = {"full": "exact (float32)", "remainder": "exact (int16 remainder)"}.get(
      r["masters"], "none: param rounded stochastically"
    )
    exact_moments = {
      "full": "exact (float32)",
      "bfloat16": "bf16, rounded stochastically",
      "8bit": "8-bit, float32 scale per block of <= 256, rounded stochastically",
    }[r["moments"]]
    expected = f"{r['expected']}" + (f" (+{r['allowance']})" if r["allowance"] else "")
    table_rows.append(
      [
        f"mpx {name_of(r['masters'], r['moments'])}",
        "2",
        f(r["state_bpp"], ".3f"),
        f(2 + r["state_bpp"], ".2f"),
        exact_master,
        exact_moments,
        f"measured; expected {expected}: " + ("yes" if r["within"] else "**no**"),
      ]
    )
  for name, param, state, master, moments, how in PEER_MOMENTS:
    table_rows.append(
      [
        name,
        str(param),
        f"{state:g}",
        f"{param + state:g}",
        master,
        moments,
        f"by construction, not measured: {how}",
      ]
    )
  return [
    "## Memory: bytes per parameter, AdamW on bf16 params",
    f"*state*: the whole optimizer state (masters or what stands for them, the moments, "
    f"counters), summed over its leaves, over the parameter count, on one bf16 leaf of "
    f"{shape[0]}x{shape[1]}; *param*: the trained parameter. Gradients are not counted. "
    "The peers' rows are what each stores per parameter, by construction, not measured.",
    report.table(
      ["optimizer", "param B", "state B", "param + state B", "master", "moments", "source"],
      table_rows,
      "lrrrlll",
    ),
  ]


def speed_section(size: dict[str, Any]) -> list[str]:
  f = report._f
  rows = []
  for r in size["rows"].values():
    rows.append(
      [
        r["masters"],
        r["moments"],
        f(r["ms"], ".1f"),
        "1 (baseline)" if r["x_full"] is None else f(r["x_full"], ".2f") + "x",
        _goal(r["moments"], r["x_full"]),
        f(r["xla_accessed_bpp"], ".1f"),
        f(r["accessed_bpp"], ".1f"),
        "-" if r["moments"] == "full" else f(r["saved_bpp"], ".1f"),
        _bytes_goal(r["moments"], r["saved_bpp"]),
        f(r["temp_bpp"], ".2f"),
        str(r["fusions"]),
        f(r["state_bpp"], ".2f"),
        report._syncs(r),
        report._compiles(r),
      ]
    )
  return [
    f"## Step time and bytes moved: {size['label']} params",
    f"Tree: {size['desc']}; {size['rounds']} rounds. *x full*: the median over rounds "
    "of the step's time over the mean of the two full-moment windows (same masters mode) "
    "just before and after it. *XLA B/param*: `cost_analysis()['bytes accessed']` over "
    "the parameter count. *less 1-element reads*: the same, less what XLA charges the "
    "kernels that read one element of each large output to order the compressed "
    "moments' in-place writes (it charges each operand whole, though one element is "
    "read: `benchmarks/common.py`'s `one_element_read_bytes`); *saved*: the "
    "full-moment step's figure minus this one's, both so counted. "
    "*scratch*: `temp_size_in_bytes` per parameter; *kernels*: top-level fusions.",
    report.table(
      [
        "masters",
        "moments",
        "ms",
        "x full",
        "goal (CPU)",
        "XLA B/param",
        "less 1-element reads",
        "saved B/param",
        "goal",
        "scratch B/param",
        "kernels",
        "state B/param",
        "host syncs",
        "compiles",
      ],
      rows,
      "llrrlrrrlrrrrr",
    ),
  ]


def render(results: dict[str, Any]) -> str:
  machine = results["machine"]
  parts = [
    "# Benchmarks: compressed optimizer moments",
    "Why the numbers are what they are, and when to pick which format: "
    "[the moments](concepts_masters.md#the-moments-moments-bfloat16-and-8bit).",
    f"Generated by `benchmarks/moments.py`. Regenerate with:\n\n```bash\n{results['command']}\n```",
    report.table(
      ["machine", ""],
      [
        ["mpx", machine["mpx"]],
        ["CPU", f"{machine['cpu']} ({machine['cores']} cores)"],
        ["device", machine["device"]],
        ["jax / optax", f"{machine['jax']} / {machine['optax']}"],
        ["date", machine["date"]],
        ["load average at start", machine["load"]],
        ["malloc", machine["malloc"]],
        ["run time", f"{results['runtime_s']:.0f} s"],
      ],
      "ll",
    ),
  ]
  parts += memory_section(results["memory"], tuple(results["memory_shape"]))
  for size in results["sizes"]:
    parts += speed_section(size)
  parts.append(
    "Timings on a shared machine move by 10-20% between runs; the ratios, each taken "
    "against windows adjacent in time, are steadier than the milliseconds."
  )
  return "\n\n".join(parts) + "\n"


# --- Command line -----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  run_bench.add_timing_options(
    parser,
    DEFAULT_SIZES,
    smoke_help="tiny sizes, seconds; structure only",
    steps_help="least steps per window",
    window_help="seconds a full-moment window should last (default 0.1)",
  )
  parser.add_argument(
    "--memory-shape",
    help="ROWSxCOLS of the leaf the memory table is measured on (default "
    f"{DEFAULT_MEMORY_SHAPE[0]}x{DEFAULT_MEMORY_SHAPE[1]})",
  )
  parser.add_argument(
    "--malloc",
    choices=("kept", "as-is"),
    default="kept",
    help="kept (default): run with "
    + " ".join(f"{k}={v}" for k, v in run_bench.NO_MMAP_MALLOC.items())
    + ", starting the script again if they are not set; as-is: this process's settings",
  )
  parser.add_argument("--out", help="also write the markdown section to this file")
  parser.add_argument("--json", help="also write the raw results to this JSON file")
  args = parser.parse_args(argv)
  run_bench.resolve_timing_options(args, DEFAULT_SIZES, SMOKE_SIZES)
  if args.memory_shape:
    try:
      rows, cols = (int(v) for v in args.memory_shape.lower().split("x"))
    except ValueError:
      parser.error(f"--memory-shape takes ROWSxCOLS, e.g. 4096x4096, not {args.memory_shape!r}")
    args.memory_shape = (rows, cols)
  else:
    args.memory_shape = SMOKE_MEMORY_SHAPE if args.smoke else DEFAULT_MEMORY_SHAPE
  return args


def malloc_kept() -> bool:
  """Whether this process started with every variable of ``NO_MMAP_MALLOC`` set so."""
  return all(os.environ.get(k) == v for k, v in run_bench.NO_MMAP_MALLOC.items())


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
  start = time.perf_counter()
  results: dict[str, Any] = {
    "machine": common.machine_info(),
    "command": " ".join(["python", "benchmarks/moments.py", *argv]),
    "settings": {
      "sizes": args.sizes,
      "layers": args.layers,
      "rounds": args.rounds,
      "steps": args.steps,
      "window_s": args.window,
    },
    "memory_shape": list(args.memory_shape),
    "goals": {
      "speed": SPEED_GOALS,
      "bytes_saved_8bit": BYTES_SAVED_GOAL,
      "state_bpp": {f"{a} {b}": v for (a, b), v in EXPECTED_STATE_BPP.items()},
    },
  }
  run_bench.log(f"memory on one {args.memory_shape[0]}x{args.memory_shape[1]} leaf")
  results["memory"] = memory(args.memory_shape)
  results["sizes"] = [speed_size(args, target) for target in args.sizes]
  results["runtime_s"] = time.perf_counter() - start
  return results


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.malloc == "kept" and not malloc_kept():
    # glibc reads these when a process starts: run again in one that has them.
    env = run_bench.allocator_env(run_bench.NO_MMAP_MALLOC)
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv]
    return subprocess.run(command, env=env, check=False).returncode
  results = run(args, argv)
  markdown = render(results)
  print(markdown)
  if args.out:
    pathlib.Path(args.out).write_text(markdown)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
