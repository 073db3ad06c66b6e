"""Measures the optimizer step on one tree, and the whole training step, for run.py."""

from __future__ import annotations

import argparse
import gc
from typing import Any

import jax
import optax

from benchmarks import common, targets
from benchmarks import optimizer_step as opt_bench
from benchmarks import train_step as train_bench
from benchmarks.cli import describe_tree, log, rounds_for
from benchmarks.rows import StepRow, TrainRow


def _probe_rows(probes: list[Any], times: common.Timings, n: int) -> dict[str, dict[str, Any]]:
  """Returns the bandwidth and finite-check probes' times, bytes and HLO profiles."""
  rows = {}
  checks = any(p.group == "check" for p in probes)
  for p in probes:
    seconds = common.median(times.seconds[p.case.name])
    elements = min(n, opt_bench.ROOF_ELEMENTS) if p.group == "roofline" else n
    rows[p.case.name] = {
      "group": p.group,
      "ms": 1e3 * seconds,
      "gbps": p.bytes_per_param * elements / seconds / 1e9,
      "bytes_per_param": p.bytes_per_param,
      "x_copy": times.ratio(p.case.name, opt_bench.CHECK_COPY) if checks else None,
      "host_syncs": p.case.host_syncs,
      "profile": common.hlo_profile(p.case.compiled()),
    }
  return rows


def _step_row(
  variant: Any, case: Any, n: int, times: common.Timings, present: set[str], roof: dict[str, Any]
) -> tuple[StepRow, dict[str, Any]]:
  """Returns one variant's row and its HLO profile."""
  reference = variant.reference if variant.reference in present else None
  cond = variant.check_then_apply
  cond = cond if cond in present and cond != variant.name else None
  full = variant.pair_with if variant.pair_with in present else None
  compared = (opt_bench.BASELINE, reference, cond, full, roof["probe"])
  profile = common.hlo_profile(case.compiled())
  skipped = None
  if variant.kind == "mpx":
    value = optax.tree.get(case.state[1], "skipped_steps")
    skipped = None if value is None else int(value)
  row = StepRow(
    kind=variant.kind,
    n=n,
    ms=times.median_ms(case.name),
    min_bytes=variant.min_bytes,
    baseline=opt_bench.BASELINE,
    ratios={name: times.ratio(case.name, name) for name in compared if name},
    reference=reference,
    check_then_apply=cond,
    full=full,
    paired_with=times.references.get(case.name),
    paired_rounds=tuple(times.paired.get(case.name, [])),
    roof=roof["probe"],
    roof_bytes=roof["bytes"],
    state_bpp=opt_bench.state_bytes_per_param(variant, case, n),
    temp_bpp=profile["temp_bytes"] / n,
    accessed_bpp=None if profile["bytes_accessed"] < 0 else profile["bytes_accessed"] / n,
    fresh_bpp=common.median(times.page_faults.get(case.name, [])) * common.page_bytes() / n,
    host_syncs=case.host_syncs,
    compiles=case.compiles,
    traces=case.traces,
    first_call_s=case.first_call_s,
    times_ms=tuple(1e3 * t for t in times.seconds[case.name]),
    skipped_steps=skipped,
  )
  return row, profile


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

  probe_rows = _probe_rows(probes, times, n)
  probe = max((opt_bench.ROOF_COPY, opt_bench.ROOF_AXPY), key=lambda k: probe_rows[k]["gbps"])
  # Bytes the roofline probe moves per step; with paired ratios to it, the
  # distance to the floor is as steady as the other ratios.
  roof_bytes = probe_rows[probe]["bytes_per_param"] * min(n, opt_bench.ROOF_ELEMENTS)
  roof = {"probe": probe, "bytes": roof_bytes}
  rows, mpx_state, profile = {}, {}, {}
  for variant, case in built:
    rows[variant.name], profile[variant.name] = _step_row(variant, case, n, times, present, roof)
    if variant.kind == "mpx":
      mpx_state[variant.name] = opt_bench.mpx_state_overhead(case, n)
  if profile:
    log("  profiled")
  result = {
    "rounds": rounds,
    "steps_per_round": steps,
    "label": label,
    "n": n,
    "many_leaves": many_leaves,
    # The speed and scratch targets hold at 16M, 64M and on the many-leaf tree.
    "targets": many_leaves or n >= targets.TARGET_MIN_PARAMS,
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
      "best": probe_rows[probe]["gbps"],
      "probe": probe,
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
  """Times the demo transformer's whole training step in each mode."""
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
    rows[case.name] = TrainRow(
      param_dtype=jax.tree.leaves(case.state[0])[0].dtype.name,
      ms=times.median_ms(case.name),
      x_base=times.ratio(case.name, train_bench.BASELINE),
      state_bpp=train_bench.opt_state_bytes_per_param(case, n),
      peak_bytes=peak,
      compile_s=common.median(compile_times[case.name]),
      baseline_compile_s=base_compile,
      host_syncs=case.host_syncs,
      compiles=case.compiles,
      traces=case.traces,
      skipped=skipped,
      skipped_total=train_bench.skipped_steps(case),
    )
  return {
    "model": train_bench.describe(args.model, n),
    "rows": rows,
    "peak_source": source,
    "rounds": rounds,
    "steps_per_round": steps,
  }
