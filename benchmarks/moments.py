"""Compressed optimizer moments (``mixed_precision(moments=...)``), measured in one run.

AdamW on bf16 params, each storage of the masters with each storage of the
moments: state bytes per parameter, step time paired with the full-moment step
of the same masters mode, and XLA's bytes moved. ``--smoke``: tiny sizes.
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
from benchmarks import cli, common  # noqa: E402
from benchmarks import optimizer_step as opt_bench  # noqa: E402
from benchmarks.allocators import NO_MMAP_MALLOC, allocator_env  # noqa: E402
from benchmarks.markdown import size_label  # noqa: E402
from benchmarks.moments_report import BYTES_SAVED_GOAL, SPEED_GOALS, name_of, render  # noqa: E402
from benchmarks.trees import BF16, copy_tree  # noqa: E402

MASTERS = ("full", "remainder", "stochastic")
MOMENTS = ("full", "bfloat16", "8bit", "4bit")
LR = 1e-3
DEFAULT_SIZES = "16M,64M"
SMOKE_SIZES = "64K"
DEFAULT_MEMORY_SHAPE = (4096, 4096)
SMOKE_MEMORY_SHAPE = (64, 1024)
# Optimizer-state bytes per parameter expected for AdamW on bf16 params with
# large leaves (masters 4 / 2 / 0 B, moments 8 / 4 / 2 / 1 B); 8bit and 4bit
# add their float32 block scales, at most 0.08 B/param.
EXPECTED_STATE_BPP = {
  (masters, moments): master + moment
  for masters, master in zip(MASTERS, (4, 2, 0), strict=True)
  for moments, moment in zip(MOMENTS, (8, 4, 2, 1), strict=True)
}
SCALES_ALLOWANCE = 0.08


# --- The steps -----------------------------------------------------------------------


def transformation(masters: str, moments: str) -> optax.GradientTransformation:
  """Builds ``mixed_precision(adamw)`` with the given masters and moments."""
  return mpx.mixed_precision(optax.adamw(LR), masters=masters, moments=moments)


def build_case(p32: Any, grads: Any, bad_grads: Any, masters: str, moments: str) -> common.Case:
  """Builds the donated-state step of one masters mode and one moments format."""
  tx = transformation(masters, moments)
  state = opt_bench.mpx_bf16_state(tx, masters, p32)
  return common.Case(
    name_of(masters, moments), opt_bench.mpx_step(tx), state, (grads,), (bad_grads,)
  )


# --- Memory -----------------------------------------------------------------------


def state_bytes(opt_state: Any) -> int:
  """Counts the bytes of an optimizer state."""
  return int(sum(x.nbytes for x in jax.tree.leaves(opt_state)))


def memory(shape: tuple[int, int]) -> list[dict[str, Any]]:
  """Measures the state's bytes per parameter on one bf16 leaf of ``shape``.

  One real state for every (masters, moments), one at a time.
  """
  n = math.prod(shape)
  p32 = jnp.asarray(np.random.default_rng(0).standard_normal(shape, np.float32) * 0.02)
  rows = []
  for masters in MASTERS:
    for moments in MOMENTS:
      _, opt = opt_bench.mpx_bf16_state(transformation(masters, moments), masters, p32)
      jax.block_until_ready(opt)
      bpp = state_bytes(opt) / n
      expected = EXPECTED_STATE_BPP[masters, moments]
      allowance = SCALES_ALLOWANCE if moments in ("8bit", "4bit") else 0.0
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


# --- Speed and bytes moved ---------------------------------------------------


def rounds_for(n: int, rounds: int | None) -> int:
  """Picks the rounds for ``n`` params: ``rounds`` if given, else the default."""
  if rounds:
    return rounds
  return cli.DEFAULT_ROUNDS_LARGE if n >= cli.LARGE_PARAMS else cli.DEFAULT_ROUNDS


def speed_size(args: argparse.Namespace, target: int) -> dict[str, Any]:
  """Times every (masters, moments) step on a transformer-shaped tree of ``target`` params.

  Each is paired with the full-moment step of the same masters mode; XLA's
  bytes accessed, scratch and kernels come from the compiled step.
  """
  shapes = opt_bench.param_shapes(target, args.layers)
  n = opt_bench.n_params(shapes)
  p32, g32 = opt_bench.make_arrays(shapes)
  grads = copy_tree(g32, BF16)
  bad = opt_bench.with_inf(grads)
  del g32
  rounds = rounds_for(n, args.rounds)
  rows: dict[str, dict[str, Any]] = {}
  cli.log(f"{size_label(n)} params ({cli.describe_tree(shapes)})")
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
    cli.log(f"  masters {masters}: timed ({rounds} rounds of {steps} steps)")
    del cases, full, times
    gc.collect()
  return {
    "label": size_label(n),
    "n": n,
    "desc": cli.describe_tree(shapes),
    "rounds": rounds,
    "rows": rows,
  }


# --- Command line -----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  """Parses the command line; resolves the sizes and the memory table's leaf."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  cli.add_timing_options(
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
    + " ".join(f"{k}={v}" for k, v in NO_MMAP_MALLOC.items())
    + ", starting the script again if they are not set; as-is: this process's settings",
  )
  parser.add_argument("--out", help="also write the markdown section to this file")
  parser.add_argument("--json", help="also write the raw results to this JSON file")
  args = parser.parse_args(argv)
  cli.resolve_timing_options(args, DEFAULT_SIZES, SMOKE_SIZES)
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
  """Tells whether this process started with every variable of ``NO_MMAP_MALLOC`` set so."""
  return all(os.environ.get(k) == v for k, v in NO_MMAP_MALLOC.items())


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
  """Measures the memory table and every size; returns the results for the report."""
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
  cli.log(f"memory on one {args.memory_shape[0]}x{args.memory_shape[1]} leaf")
  results["memory"] = memory(args.memory_shape)
  results["sizes"] = [speed_size(args, target) for target in args.sizes]
  results["runtime_s"] = time.perf_counter() - start
  return results


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark (in a process with the kept malloc settings) and writes it out."""
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.malloc == "kept" and not malloc_kept():
    # glibc reads these when a process starts: run again in one that has them.
    env = allocator_env(NO_MMAP_MALLOC)
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
