"""Runs the mpx benchmarks and writes docs/benchmarks.md and docs/benchmarks.png.

1. The Adam optimizer step at several sizes and on a tree of many small
   leaves: plain optax FP32 Adam (the baseline), hand-written fp16 and bf16
   mixed-precision steps without safety (the references for the cost of
   safety) and with the two ways to skip a step (``lax.cond``, ``jnp.where``;
   the ``lax.cond`` ones, fp16 and bf16, are the check-then-apply steps mpx
   bf16 and fp16 are timed next to in every round), mpx bf16 and fp16, mpx
   bf16 with remainder masters and with stochastic rounding (each also timed
   next to mpx bf16's full-master step in every round, and again in two more
   processes, with glibc malloc's defaults and told to keep large blocks:
   ``NO_MMAP_MALLOC``), and the peers' fp16 paths (jmp, flax
   ``DynamicScale``, mixed-precision-for-JAX, ``optax.apply_if_finite``);
   optimizer-state bytes per parameter (beside the peers' by construction),
   bytes moved and bandwidth against a copy/axpy roofline measured in the same
   run; XLA's bytes accessed and scratch per parameter; an HLO profile; compile
   time.
2. Compile time against the number of leaves (``benchmarks/compile_time.py``),
   each mpx step against the check-then-apply step of its dtype.
3. A whole training step of a small flax transformer: FP32 vs mpx bf16 vs mpx
   fp16, with optimizer-state bytes and peak memory.
4. Host syncs per step (under ``jax.transfer_guard("disallow")``) and
   compilations per run, for every variant.

Run from the repository root::

  python benchmarks/run.py                     # the default run (about twelve minutes)
  python benchmarks/run.py --smoke             # tiny, seconds; prints only
  python benchmarks/run.py --sizes 16M --rounds 9 --many-leaves 0 --no-compile-time

At 64M parameters all optimizer-step variants and probes are alive at once:
about 18 GiB of memory. ``--sizes 1M,16M`` needs a quarter of that.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import optax  # noqa: E402

from benchmarks import common, compile_time, report  # noqa: E402
from benchmarks import optimizer_step as opt_bench  # noqa: E402
from benchmarks import train_step as train_bench  # noqa: E402
from benchmarks.model import ModelSize  # noqa: E402

DEFAULT_SIZES = "1M,16M,64M"
SMOKE_SIZES = "64K"
DEFAULT_ROUNDS = 11
# Above this many params a round of every variant takes ~10 s on a 2-core CPU:
# fewer rounds keep the default run near twelve minutes.
LARGE_PARAMS = 48 * 2**20
DEFAULT_ROUNDS_LARGE = 7
MANY_LEAVES, MANY_LEAF_SIDE = 500, 128
SMOKE_MANY_LEAVES, SMOKE_MANY_LEAF_SIDE = 12, 16
DEFAULT_LEAF_COUNTS = "100,300,1000"
SMOKE_LEAF_COUNTS = "10,30"
COMPILE_TREE = 2**20  # the transformer-shaped tree of the compile-time section
SMOKE_MODEL = ModelSize(width=32, depth=0, heads=2, seq=16, batch=2, vocab=64)
# glibc malloc told not to map and unmap large blocks (issue 17): XLA:CPU
# allocates some steps' scratch afresh on every call, and with glibc's
# defaults a block that large is mmap-ed and unmapped each time, so every step
# pays page faults on it. The first three variables keep such blocks in the
# heap; they are not enough alone: XLA runs steps on threads of its own, whose
# malloc arenas are heaps of at most 64 MiB that map any larger block whatever
# the threshold (measured: remainder masters at 16M params, a 64 MiB scratch,
# still faulted in 4 bytes per parameter per step), so MALLOC_ARENA_MAX=1 puts
# every thread on the main heap. Read once, when the process starts.
NO_MMAP_MALLOC = {
  "MALLOC_MMAP_THRESHOLD_": "4294967296",
  "MALLOC_TRIM_THRESHOLD_": "68719476736",
  "MALLOC_TOP_PAD_": "1073741824",
  "MALLOC_ARENA_MAX": "1",
}
# The two settings the storage modes are timed under, each in a process of its
# own: (name, the environment variables set; those of NO_MMAP_MALLOC not named
# are removed).
ALLOCATORS = (("glibc defaults", {}), ("glibc, large blocks kept, one arena", NO_MMAP_MALLOC))
# What those processes time: the storage modes, next to the full-master step.
ALLOCATOR_VARIANTS = (
  opt_bench.BASELINE,
  opt_bench.MPX_BF16,
  opt_bench.MPX_REMAINDER,
  opt_bench.MPX_STOCHASTIC,
)


def parse_size(text: str) -> int:
  """``"64M"`` -> 64 * 2**20, ``"64K"`` -> 64 * 2**10, ``"1000"`` -> 1000."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
  if not match:
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16M, 64K, 5000)")
  value = float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[match.group(2).lower()]
  return int(value)


def add_timing_options(
  parser: argparse.ArgumentParser,
  default_sizes: str,
  *,
  smoke_help: str,
  steps_help: str,
  window_help: str,
) -> None:
  """The options every step-timing benchmark takes: ``--smoke``, ``--sizes``,
  ``--layers``, ``--rounds``, ``--steps`` and ``--window``; defaults filled in
  by :func:`resolve_timing_options`."""
  parser.add_argument("--smoke", action="store_true", help=smoke_help)
  parser.add_argument("--sizes", help=f"comma-separated param counts (default {default_sizes})")
  parser.add_argument("--layers", type=int, help="blocks in the benchmark tree (default 4)")
  parser.add_argument(
    "--rounds",
    type=int,
    help=f"timing rounds (default {DEFAULT_ROUNDS}; {DEFAULT_ROUNDS_LARGE} from "
    f"{LARGE_PARAMS // 2**20}M params; 2 with --smoke)",
  )
  parser.add_argument("--steps", type=int, help=f"{steps_help} (default 2; 1 with --smoke)")
  parser.add_argument("--window", type=float, help=window_help)


def resolve_timing_options(args: argparse.Namespace, default_sizes: str, smoke_sizes: str) -> None:
  """Fills in the defaults of :func:`add_timing_options`' options, smaller
  under ``--smoke``; ``--sizes`` becomes a list of param counts."""
  smoke = args.smoke
  args.sizes = [
    parse_size(s) for s in (args.sizes or (smoke_sizes if smoke else default_sizes)).split(",")
  ]
  args.layers = args.layers or (1 if smoke else 4)
  if smoke and args.rounds is None:
    args.rounds = 2
  args.steps = args.steps or (1 if smoke else 2)
  args.window = args.window if args.window is not None else (0.0 if smoke else 0.1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


def rounds_for(args: argparse.Namespace, n: int) -> int:
  """Timing rounds on a tree of ``n`` params."""
  if args.rounds:
    return args.rounds
  return DEFAULT_ROUNDS_LARGE if n >= LARGE_PARAMS else DEFAULT_ROUNDS


def describe_tree(shapes: Any) -> str:
  if "ln_f" not in shapes:  # opt_bench.many_leaf_shapes
    leaves = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    rows, cols = leaves[0]
    return f"{len(leaves)} leaves of {rows}x{cols} in {len(shapes)} blocks"
  d = shapes["ln_f"]["scale"][0]
  vocab = shapes["embed"]["embedding"][0]
  blocks = sum(k.startswith("block_") for k in shapes)
  leaves = len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
  return f"width {d}, {blocks} blocks, embedding {vocab}x{d}, {leaves} leaves"


_START = time.perf_counter()


def log(message: str) -> None:
  """Progress on stderr, with the seconds since the run started."""
  print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


def optimizer_size(
  args: argparse.Namespace, shapes: Any, label: str, measure_compile: bool, many_leaves: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Builds, checks and times every variant on one tree.

  Args:
    args: the parsed flags.
    shapes: the tree's leaf shapes.
    label: the size's name in the tables.
    measure_compile: also time fresh compilations of every variant.
    many_leaves: the tree of many small leaves (peers and the finite-check
      probes left out: at 500 leaves they would add minutes of compiling and
      about 40% to every round).

  Returns:
    ``(result, compile_rows)``.
  """
  names = args.variants
  if many_leaves:
    names = tuple(
      v.name for v in opt_bench.VARIANTS if v.kind != "peer" and (names is None or v.name in names)
    )
  built, unavailable, n, grads = opt_bench.build_cases(shapes, names)
  # The finite checks alone are reported at the largest transformer-shaped size
  # only; on hundreds of leaves they would cost seconds of compiling each.
  probes = opt_bench.probes(n, grads, checks=not (many_leaves or args.allocator_child))
  del grads
  # The probes first: they absorb one-time costs before any variant compiles.
  cases = [p.case for p in probes] + [c for _, c in built]
  log(f"  built {len(built)} variants on {n:,} params; compiling")
  for case in cases:
    common.warm_up(case)
  for case in cases:
    common.check_host_syncs(case, steps=2)
  log("  compiled and checked")
  compile_times = {}
  if measure_compile and not args.allocator_child:
    compile_times = common.compile_seconds([c for _, c in built], args.compile_repeats)
    log("  compile times measured")
  present = {c.name for _, c in built}
  references = {v.name: v.timed_next_to for v, _ in built if v.timed_next_to in present}
  baseline = next(c for _, c in built if c.name == opt_bench.BASELINE)
  rounds = rounds_for(args, n)
  steps = common.steps_per_round(baseline, args.window, args.steps)
  times = common.interleaved_times(cases, baseline, rounds, steps, references=references)
  log(f"  timed ({rounds} rounds of {steps} steps)")
  for case in cases:
    common.finish_run(case)

  probe_rows = {}
  checks = any(p.group == "check" for p in probes)
  for p in probes:
    seconds = common.median(times.seconds[p.case.name])
    elements = min(n, opt_bench.ROOF_ELEMENTS) if p.group == "roofline" else n
    probe_rows[p.case.name] = {
      "group": p.group,
      "ms": 1e3 * seconds,
      "gbps": p.bytes_per_param * elements / seconds / 1e9,
      "bytes_per_param": p.bytes_per_param,
      "x_copy": times.ratio(p.case.name, opt_bench.CHECK_COPY) if checks else None,
      "host_syncs": p.case.host_syncs,
      "profile": common.hlo_profile(p.case.compiled()),
    }
  roof = max((opt_bench.ROOF_COPY, opt_bench.ROOF_AXPY), key=lambda k: probe_rows[k]["gbps"])
  best = probe_rows[roof]["gbps"]
  # Bytes the roofline probe moves per step; with paired ratios to it, the
  # distance to the floor is as steady as the other ratios.
  roof_bytes = probe_rows[roof]["bytes_per_param"] * min(n, opt_bench.ROOF_ELEMENTS)
  rows, mpx_state, profile = {}, {}, {}
  for variant, case in built:
    ms = times.median_ms(case.name)
    seconds = ms / 1e3
    reference = variant.reference if variant.reference in present else None
    cond = variant.check_then_apply
    cond = cond if cond in present and cond != variant.name else None
    next_to = references.get(case.name)
    full = variant.pair_with if variant.pair_with in present else None
    row = {
      "kind": variant.kind,
      "ms": ms,
      "x_base": times.ratio(case.name, opt_bench.BASELINE),
      "reference": reference,
      "x_hand": None if reference is None else times.ratio(case.name, reference),
      "check_then_apply": cond,
      "x_cond": None if cond is None else times.ratio(case.name, cond),
      # The paired ratio to the variant it was timed next to in every round:
      # the check-then-apply step of its dtype, or (pair_with) the full-master
      # mpx step.
      "paired_with": next_to,
      "x_hand_paired": times.paired_ratio(case.name) if next_to == reference else None,
      "x_cond_paired": times.paired_ratio(case.name) if cond and next_to == cond else None,
      "x_full": None if full is None else times.ratio(case.name, full),
      "x_full_paired": times.paired_ratio(case.name) if full and next_to == full else None,
      "paired_rounds": times.paired.get(case.name, []),
      "min_bytes": variant.min_bytes,
      "state_bpp": opt_bench.state_bytes_per_param(variant, case, n),
      "gbps": variant.min_bytes * n / seconds / 1e9,
      "floor_x": times.ratio(case.name, roof) * roof_bytes / (variant.min_bytes * n),
      "host_syncs": case.host_syncs,
      "compiles": case.compiles,
      "traces": case.traces,
      "first_call_s": case.first_call_s,
      "times_ms": [1e3 * t for t in times.seconds[case.name]],
      "fresh_bpp": common.median(times.page_faults.get(case.name, [])) * common.page_bytes() / n,
    }
    row["roof_pct"] = 100 / row["floor_x"]
    if variant.kind == "mpx":
      mpx_state[variant.name] = opt_bench.mpx_state_overhead(case, n)
      value = optax.tree.get(case.state[1], "skipped_steps")
      row["skipped_steps"] = None if value is None else int(value)
    profile[variant.name] = p = common.hlo_profile(case.compiled())
    row["temp_bpp"] = p["temp_bytes"] / n
    row["accessed_bpp"] = None if p["bytes_accessed"] < 0 else p["bytes_accessed"] / n
    rows[variant.name] = row
  if profile:
    log("  profiled")
  result = {
    "rounds": rounds,
    "steps_per_round": steps,
    "label": label,
    "n": n,
    "many_leaves": many_leaves,
    # The speed targets hold at 16M, 64M and on the many-leaf tree.
    "targets": many_leaves or n >= report.TARGET_MIN_PARAMS,
    "desc": describe_tree(shapes),
    "leaves": len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))),
    "adam_state_bytes": opt_bench.adam_state_bytes(shapes),
    "rows": rows,
    "unavailable": unavailable,
    "skipped_peers": sorted(
      v.name
      for v in opt_bench.VARIANTS
      if many_leaves and v.kind == "peer" and (args.variants is None or v.name in args.variants)
    ),
    "references": references,
    "roofline": {
      "copy": probe_rows[opt_bench.ROOF_COPY]["gbps"],
      "axpy": probe_rows[opt_bench.ROOF_AXPY]["gbps"],
      "best": best,
      "probe": roof,
    },
    "probes": probe_rows,
    "mpx_state": mpx_state,
    "profile": profile,
  }
  compile_rows = {}
  if compile_times:
    base = common.median(compile_times[opt_bench.BASELINE])
    for name, values in compile_times.items():
      compile_rows[name] = {"s": common.median(values), "x_base": common.median(values) / base}
  del built, cases, probes
  gc.collect()
  return result, compile_rows


def train_benchmark(args: argparse.Namespace) -> dict[str, Any]:
  cases, n = train_bench.build_cases(args.model)
  for case in cases:
    common.warm_up(case)
  for case in cases:
    common.check_host_syncs(case, steps=2)
  compile_times = common.compile_seconds(cases, args.compile_repeats)
  before = {c.name: train_bench.skipped_steps(c) for c in cases}
  rounds = rounds_for(args, n)
  steps = common.steps_per_round(cases[0], args.window, args.steps)
  times = common.interleaved_times(cases, cases[0], rounds, steps)
  log(f"  timed ({rounds} rounds of {steps} steps)")
  after = {c.name: train_bench.skipped_steps(c) for c in cases}
  for case in cases:
    common.finish_run(case)
  base_compile = common.median(compile_times[train_bench.BASELINE])
  rows, source = {}, ""
  for case in cases:
    peak, source = common.peak_bytes(case.compiled())
    skipped = None if after[case.name] is None else after[case.name] - before[case.name]
    rows[case.name] = {
      "param_dtype": jax.tree.leaves(case.state[0])[0].dtype.name,
      "ms": times.median_ms(case.name),
      "x_base": times.ratio(case.name, train_bench.BASELINE),
      "state_bpp": train_bench.opt_state_bytes_per_param(case, n),
      "peak_bytes": peak,
      "compile_s": common.median(compile_times[case.name]),
      "compile_x": common.median(compile_times[case.name]) / base_compile,
      "host_syncs": case.host_syncs,
      "compiles": case.compiles,
      "traces": case.traces,
      "skipped": skipped,
      "skipped_total": train_bench.skipped_steps(case),
    }
  return {
    "model": train_bench.describe(args.model, n),
    "rows": rows,
    "peak_source": source,
    "rounds": rounds,
    "steps_per_round": steps,
  }


def allocator_sizes(args: argparse.Namespace) -> list[int]:
  """The sizes the allocator runs time: the target sizes (the first with --smoke)."""
  if args.smoke:
    return args.sizes[:1]
  return [n for n in args.sizes if n >= report.TARGET_MIN_PARAMS]


def allocator_env(settings: dict[str, str]) -> dict[str, str]:
  """This process's environment with ``settings`` for glibc malloc: each of
  :data:`NO_MMAP_MALLOC`'s variables set as ``settings`` says, or removed."""
  env = {k: v for k, v in os.environ.items() if k not in NO_MMAP_MALLOC}
  env.update(settings)
  return env


def allocator_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
  """The storage modes timed under each of :data:`ALLOCATORS`, in a process of
  its own (glibc reads its settings when the process starts).

  Returns:
    One entry per setting: its name, the variables it sets, LD_PRELOAD if
    set (a preloaded allocator replaces glibc's), and the child's optimizer
    sizes, or ``error`` with the end of its output if it failed.
  """
  sizes = allocator_sizes(args)
  if not sizes:
    return []
  out = []
  for name, settings in ALLOCATORS:
    log(f"storage modes in a new process, malloc: {name}")
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "results.json"
      command = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--allocator-child",
        "--sizes",
        ",".join(str(n) for n in sizes),
        "--json",
        str(path),
        "--layers",
        str(args.layers),
        "--steps",
        str(args.steps),
        "--window",
        str(args.window),
      ]
      if args.rounds:
        command += ["--rounds", str(args.rounds)]
      if args.smoke:
        command.append("--smoke")
      proc = subprocess.run(
        command, env=allocator_env(settings), capture_output=True, text=True, check=False
      )
      entry: dict[str, Any] = {
        "name": name,
        "env": dict(settings),
        "ld_preload": os.environ.get("LD_PRELOAD"),
      }
      if proc.returncode == 0 and path.exists():
        child = json.loads(path.read_text())
        entry["sizes"] = child["optimizer"]["sizes"]
        entry["runtime_s"] = child["runtime_s"]
        entry["malloc"] = child["machine"].get("malloc")
      else:
        entry["error"] = f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        log(f"  failed: {entry['error'][-300:]}")
    out.append(entry)
  return out


def command_line(argv: list[str] | None) -> str:
  argv = sys.argv[1:] if argv is None else argv
  return shlex.join(["python", "benchmarks/run.py", *argv])


def run(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs everything; returns the results (also written where the flags say)."""
  args = parse_args(argv)
  start = time.perf_counter()
  log("loading peers")
  machine = common.machine_info()
  if args.variants is None or any("mixed-precision-for-JAX" in v for v in args.variants):
    opt_bench.load_peers(args.install_peers)
  sizes, compile_rows = [], {}
  trees = [
    (report.size_label(target), opt_bench.param_shapes(target, args.layers), False)
    for target in args.sizes
  ]
  if args.many_leaves:
    shapes = opt_bench.many_leaf_shapes(args.many_leaves, args.many_leaf_side)
    label = f"{args.many_leaves} leaves ({report.size_label(opt_bench.n_params(shapes))})"
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
    label = report.size_label(args.compile_tree)
    shapes = opt_bench.param_shapes(args.compile_tree, args.layers)
    results["compile_time"] = compile_time.run(
      args.leaf_counts, args.compile_rounds, (label, shapes), log
    )
  if not args.no_train:
    log("training step")
    results["train"] = train_benchmark(args)
  results["runtime_s"] = time.perf_counter() - start

  png = None
  if args.out_dir:
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = "benchmarks.png" if report.render_png(results, out / "benchmarks.png") else None
  markdown = report.render_markdown(results, png)
  if args.out_dir:
    (pathlib.Path(args.out_dir) / "benchmarks.md").write_text(report.FRONT_MATTER + markdown)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
  print(markdown)
  return results


def main(argv: list[str] | None = None) -> int:
  run(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
