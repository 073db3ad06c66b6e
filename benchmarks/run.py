"""Runs the mpx benchmarks and writes docs/benchmarks.md and docs/benchmarks.png.

1. The Adam optimizer step at several sizes: plain optax FP32 Adam (the
   baseline), a hand-written mixed-precision step without safety (the
   reference for the cost of safety) and with the two ways to skip a step
   (``lax.cond``, ``jnp.where``), mpx bf16 and fp16, and the peers' fp16 paths
   (jmp, flax ``DynamicScale``, mixed-precision-for-JAX,
   ``optax.apply_if_finite``); bytes per parameter and bandwidth against a
   copy/axpy roofline measured in the same run; an HLO profile; compile time.
2. A whole training step of a small flax transformer: FP32 vs mpx bf16 vs mpx
   fp16, with optimizer-state bytes and peak memory.
3. Host syncs per step (under ``jax.transfer_guard("disallow")``) and
   compilations per run, for every variant.

Run from the repository root::

  python benchmarks/run.py                     # default sizes 1M, 16M, 64M (a few minutes)
  python benchmarks/run.py --smoke             # tiny, seconds; prints only
  python benchmarks/run.py --sizes 16M --rounds 9

At 64M parameters all fourteen optimizer-step variants and probes are alive at
once: about 15 GiB of memory. ``--sizes 1M,16M`` needs a quarter of that.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import pathlib
import re
import shlex
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import optax  # noqa: E402

from benchmarks import common, report  # noqa: E402
from benchmarks import optimizer_step as opt_bench  # noqa: E402
from benchmarks import train_step as train_bench  # noqa: E402
from benchmarks.model import ModelSize  # noqa: E402

DEFAULT_SIZES = "1M,16M,64M"
SMOKE_SIZES = "64K"
SMOKE_MODEL = ModelSize(width=32, depth=0, heads=2, seq=16, batch=2, vocab=64)


def parse_size(text: str) -> int:
  """``"64M"`` -> 64 * 2**20, ``"64K"`` -> 64 * 2**10, ``"1000"`` -> 1000."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
  if not match:
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16M, 64K, 5000)")
  value = float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[match.group(2).lower()]
  return int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes and repeats; prints only")
  parser.add_argument("--sizes", help=f"comma-separated param counts (default {DEFAULT_SIZES})")
  parser.add_argument("--layers", type=int, help="blocks in the benchmark tree (default 4)")
  parser.add_argument("--rounds", type=int, help="timing rounds (default 7)")
  parser.add_argument(
    "--steps", type=int, help="least steps per variant per round (default 2; 1 with --smoke)"
  )
  parser.add_argument(
    "--window",
    type=float,
    help="seconds the baseline's steps should last in each round (default 0.1); "
    "small sizes then run more steps per round",
  )
  parser.add_argument("--compile-repeats", type=int, help="fresh compilations each (default 3)")
  parser.add_argument("--variants", help="comma-separated optimizer-step variants to run")
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
  args.sizes = [
    parse_size(s) for s in (args.sizes or (SMOKE_SIZES if smoke else DEFAULT_SIZES)).split(",")
  ]
  args.layers = args.layers or (1 if smoke else 4)
  args.rounds = args.rounds or (2 if smoke else 7)
  args.steps = args.steps or (1 if smoke else 2)
  args.window = args.window if args.window is not None else (0.0 if smoke else 0.1)
  args.compile_repeats = args.compile_repeats or (1 if smoke else 3)
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
    known = {v.name for v in opt_bench.VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
      parser.error(f"unknown variants {unknown}; known: {sorted(known)}")
    args.variants = tuple(dict.fromkeys((opt_bench.BASELINE, *names)))
  return args


def describe_tree(shapes: Any) -> str:
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
  args: argparse.Namespace, target: int, measure_compile: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Builds, checks and times every variant on one tree size."""
  shapes = opt_bench.param_shapes(target, args.layers)
  built, unavailable, n, grads = opt_bench.build_cases(shapes, args.variants)
  probes = opt_bench.probes(n, grads)
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
  if measure_compile:
    compile_times = common.compile_seconds([c for _, c in built], args.compile_repeats)
    log("  compile times measured")
  baseline = next(c for _, c in built if c.name == opt_bench.BASELINE)
  steps = common.steps_per_round(baseline, args.window, args.steps)
  times = common.interleaved_times(cases, baseline, args.rounds, steps)
  log(f"  timed ({args.rounds} rounds of {steps} steps)")
  for case in cases:
    common.finish_run(case)

  probe_rows = {}
  for p in probes:
    seconds = common.median(times.seconds[p.case.name])
    elements = min(n, opt_bench.ROOF_ELEMENTS) if p.group == "roofline" else n
    probe_rows[p.case.name] = {
      "group": p.group,
      "ms": 1e3 * seconds,
      "gbps": p.bytes_per_param * elements / seconds / 1e9,
      "bytes_per_param": p.bytes_per_param,
      "x_copy": times.ratio(p.case.name, opt_bench.CHECK_COPY),
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
    rows[variant.name] = {
      "kind": variant.kind,
      "ms": ms,
      "x_base": times.ratio(case.name, opt_bench.BASELINE),
      "x_hand": times.ratio(case.name, opt_bench.HAND) if opt_bench.HAND in times.seconds else None,
      "min_bytes": variant.min_bytes,
      "state_bpp": opt_bench.state_bytes_per_param(variant, case, n),
      "gbps": variant.min_bytes * n / seconds / 1e9,
      "floor_x": times.ratio(case.name, roof) * roof_bytes / (variant.min_bytes * n),
      "host_syncs": case.host_syncs,
      "compiles": case.compiles,
      "traces": case.traces,
      "times_ms": [1e3 * t for t in times.seconds[case.name]],
      "fresh_bpp": common.median(times.page_faults.get(case.name, [])) * common.page_bytes() / n,
    }
    rows[variant.name]["roof_pct"] = 100 / rows[variant.name]["floor_x"]
    if variant.kind == "mpx":
      mpx_state[variant.name] = opt_bench.mpx_state_overhead(case, n)
      value = optax.tree.get(case.state[1], "skipped_steps")
      rows[variant.name]["skipped_steps"] = None if value is None else int(value)
    profile[variant.name] = common.hlo_profile(case.compiled())
  if profile:
    log("  profiled")
  result = {
    "rounds": args.rounds,
    "steps_per_round": steps,
    "label": report.size_label(n),
    "n": n,
    "target": target,
    "desc": describe_tree(shapes),
    "leaves": len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))),
    "adam_state_bytes": opt_bench.adam_state_bytes(shapes),
    "rows": rows,
    "unavailable": unavailable,
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
  steps = common.steps_per_round(cases[0], args.window, args.steps)
  times = common.interleaved_times(cases, cases[0], args.rounds, steps)
  log(f"  timed ({args.rounds} rounds of {steps} steps)")
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
    "rounds": args.rounds,
    "steps_per_round": steps,
  }


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
  for i, target in enumerate(args.sizes):
    log(f"optimizer step: {report.size_label(target)} params")
    result, comp = optimizer_size(args, target, measure_compile=i == 0)
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
