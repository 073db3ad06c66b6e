"""Runs the mpx benchmarks and writes docs/benchmarks.md and docs/benchmarks.png.

The optimizer step, compile time against leaf count, and a whole training
step; docs/benchmarks.md says what each section measures and how. Run from the
repository root: ``python benchmarks/run.py`` (17 to 28 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import common, compile_time, report, rows  # noqa: E402
from benchmarks import optimizer_step as opt_bench  # noqa: E402
from benchmarks.allocators import ALLOCATOR_VARIANTS, NO_MMAP_MALLOC, allocator_runs  # noqa: E402
from benchmarks.cli import add_timing_options, log, resolve_timing_options  # noqa: E402
from benchmarks.markdown import size_label  # noqa: E402
from benchmarks.measure import optimizer_size, train_benchmark  # noqa: E402
from benchmarks.model import ModelSize  # noqa: E402

DEFAULT_SIZES = "1M,16M,64M"
SMOKE_SIZES = "64K"
MANY_LEAVES, MANY_LEAF_SIDE = 500, 128
SMOKE_MANY_LEAVES, SMOKE_MANY_LEAF_SIDE = 12, 16
DEFAULT_LEAF_COUNTS = "100,300,1000"
SMOKE_LEAF_COUNTS = "10,30"
COMPILE_TREE = 2**20  # the transformer-shaped tree of the compile-time section
SMOKE_MODEL = ModelSize(width=32, depth=0, heads=2, seq=16, batch=2, vocab=64)
EPILOG = """examples:
  python benchmarks/run.py                     # the default run (about twelve minutes)
  python benchmarks/run.py --smoke             # tiny, seconds; prints only
  python benchmarks/run.py --sizes 16M --rounds 9 --many-leaves 0 --no-compile-time

At 64M parameters all optimizer-step variants and probes are alive at once:
about 18 GiB of memory. --sizes 1M,16M needs a quarter of that."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  """Parses run.py's flags and fills in their defaults (smaller under ``--smoke``)."""
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    epilog=EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_timing_options(
    parser,
    DEFAULT_SIZES,
    smoke_help="tiny sizes and repeats; prints only",
    steps_help="least steps per variant per round",
    window_help="seconds the baseline's steps should last in each round (default 0.1); "
    "small sizes then run more steps per round",
  )
  parser.add_argument(
    "--compile-repeats",
    type=int,
    help="fresh compilations of every optimizer-step variant on the first size (default 3)",
  )
  parser.add_argument(
    "--many-leaves",
    type=int,
    help=f"also time the optimizer step on a tree of this many {MANY_LEAF_SIDE}x"
    f"{MANY_LEAF_SIDE} leaves, peers left out (default {MANY_LEAVES}; 0: skip)",
  )
  parser.add_argument(
    "--leaf-counts",
    help=f"leaf counts of the compile-time trees (default {DEFAULT_LEAF_COUNTS})",
  )
  parser.add_argument(
    "--compile-rounds",
    type=int,
    help="rounds of the compile-time section, each compiling every variant once (default 3)",
  )
  parser.add_argument(
    "--no-compile-time", action="store_true", help="skip the compile-time-vs-leaves section"
  )
  parser.add_argument("--variants", help="comma-separated optimizer-step variants to run")
  parser.add_argument(
    "--allocator-runs",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="also time the storage modes at the target sizes (16M and up; the first size with "
    "--smoke) in two more processes, with glibc malloc's defaults and with "
    + " ".join(f"{k}={v}" for k, v in NO_MMAP_MALLOC.items())
    + " (default: yes, unless --variants is given)",
  )
  # Internal: the process an allocator run starts (storage modes only, no
  # other section, results to --json).
  parser.add_argument("--allocator-child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--no-train", action="store_true", help="skip the training-step benchmark")
  for field in dataclasses.fields(ModelSize):
    parser.add_argument(f"--model-{field.name}", type=int, help=f"demo model {field.name}")
  parser.add_argument("--out-dir", help="where to write benchmarks.md/.png (default docs/)")
  parser.add_argument("--json", help="also write the raw results to this JSON file")
  parser.add_argument(
    "--install-peers",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="pip-install mixed-precision-for-jax into benchmarks/.vendor if missing "
    "(default: yes, except with --smoke)",
  )
  args = parser.parse_args(argv)
  smoke = args.smoke
  if args.allocator_child:
    args.variants = None  # set below: the storage modes and what they are timed against
    args.many_leaves, args.no_compile_time, args.no_train = 0, True, True
    args.allocator_runs, args.out_dir, args.install_peers = False, "", False
  if args.allocator_runs is None:
    args.allocator_runs = args.variants is None
  resolve_timing_options(args, DEFAULT_SIZES, SMOKE_SIZES)
  args.compile_repeats = args.compile_repeats or (1 if smoke else 3)
  if args.many_leaves is None:
    args.many_leaves = SMOKE_MANY_LEAVES if smoke else MANY_LEAVES
  args.many_leaf_side = SMOKE_MANY_LEAF_SIDE if smoke else MANY_LEAF_SIDE
  counts = args.leaf_counts or (SMOKE_LEAF_COUNTS if smoke else DEFAULT_LEAF_COUNTS)
  try:
    args.leaf_counts = [int(c) for c in counts.split(",") if c.strip()]
  except ValueError:
    parser.error(f"--leaf-counts takes comma-separated integers, not {counts!r}")
  args.compile_rounds = args.compile_rounds or (1 if smoke else 3)
  # The compile-time section's transformer-shaped tree: 1M params, or the
  # smoke size (quick to compile at any optimisation level).
  args.compile_tree = args.sizes[0] if smoke else COMPILE_TREE
  if args.install_peers is None:
    args.install_peers = not smoke
  if args.out_dir is None and not smoke:
    args.out_dir = str(ROOT / "docs")
  base = SMOKE_MODEL if smoke else ModelSize()
  args.model = dataclasses.replace(
    base,
    **{
      f.name: getattr(args, f"model_{f.name}")
      for f in dataclasses.fields(ModelSize)
      if getattr(args, f"model_{f.name}") is not None
    },
  )
  if args.variants:
    names = tuple(s.strip() for s in args.variants.split(","))
    known = {v.name: v for v in opt_bench.VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
      parser.error(f"unknown variants {unknown}; known: {sorted(known)}")
    # A variant's ratios to the hand steps of its dtype need those steps too,
    # and one timed next to another variant needs that one (and, in turn, its own).
    references = []
    for name in names:
      variant = known[name]
      while variant is not None:
        references += [r for r in (variant.reference, variant.timed_next_to) if r]
        if variant.kind == "mpx":
          references.append(variant.check_then_apply)
        variant = known.get(variant.pair_with)
    args.variants = tuple(dict.fromkeys((opt_bench.BASELINE, *names, *references)))
  if args.allocator_child:
    args.variants = ALLOCATOR_VARIANTS
  return args


def command_line(argv: list[str] | None) -> str:
  """Returns the command that reruns this run, for the report."""
  argv = sys.argv[1:] if argv is None else argv
  return shlex.join(["python", "benchmarks/run.py", *argv])


def run(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs every section; returns the results (also written where the flags say)."""
  args = parse_args(argv)
  start = time.perf_counter()
  log("loading peers")
  machine = common.machine_info()
  if args.variants is None or any("mixed-precision-for-JAX" in v for v in args.variants):
    opt_bench.load_peers(args.install_peers)
  sizes, compile_rows = [], {}
  trees = [
    (size_label(target), opt_bench.param_shapes(target, args.layers), False)
    for target in args.sizes
  ]
  if args.many_leaves:
    shapes = opt_bench.many_leaf_shapes(args.many_leaves, args.many_leaf_side)
    label = f"{args.many_leaves} leaves ({size_label(opt_bench.n_params(shapes))})"
    trees.append((label, shapes, True))
  for i, (label, shapes, many) in enumerate(trees):
    log(f"optimizer step: {label}" + ("" if many else " params"))
    result, comp = optimizer_size(args, shapes, label, measure_compile=i == 0, many_leaves=many)
    sizes.append(result)
    compile_rows = compile_rows or comp
  names = {name for s in sizes for name in s["rows"]}
  variants = [
    {
      "name": v.name,
      "kind": v.kind,
      "param_dtype": v.param_dtype,
      "min_bytes": v.min_bytes,
      "what": v.what,
      "pair_with": v.pair_with,
    }
    for v in opt_bench.VARIANTS
    if v.name in names
  ]
  results: dict[str, Any] = {
    "machine": machine,
    "command": command_line(argv),
    "settings": {
      "sizes": args.sizes,
      "layers": args.layers,
      "rounds": args.rounds,
      "many_leaves": args.many_leaves,
      "many_leaf_side": args.many_leaf_side,
      "leaf_counts": args.leaf_counts,
      "compile_rounds": args.compile_rounds,
      "steps": args.steps,
      "window_s": args.window,
      "compile_repeats": args.compile_repeats,
      "model": dataclasses.asdict(args.model),
    },
    "optimizer": {
      "sizes": sizes,
      "variants": variants,
      "compile": compile_rows,
      "compile_repeats": args.compile_repeats,
      "leaves": sizes[0]["leaves"],
    },
  }
  if args.allocator_runs:
    results["allocators"] = allocator_runs(args)
  if not args.no_compile_time:
    log("compile time against leaf count")
    label = size_label(args.compile_tree)
    shapes = opt_bench.param_shapes(args.compile_tree, args.layers)
    results["compile_time"] = compile_time.run(
      args.leaf_counts, args.compile_rounds, (label, shapes), log
    )
  if not args.no_train:
    log("training step")
    results["train"] = train_benchmark(args)
  results["runtime_s"] = time.perf_counter() - start

  markdown = report.write(results, args.out_dir)
  if args.json:
    rows.dump(results, args.json)
  print(markdown)
  return results


def main(argv: list[str] | None = None) -> int:
  run(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
