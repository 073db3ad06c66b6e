"""Compile time of one optimizer step against the number of leaves.

Trace, lower and compile seconds of plain Adam, the hand-written steps and mpx,
each a first compile of a freshly built step, in shuffled rounds on many-leaf
trees and the transformer-shaped tree. ``--rounds 1`` for a quick run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import pathlib
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks import optimizer_step as opt_bench  # noqa: E402

PyTree = Any
BASELINE = opt_bench.BASELINE
HAND_COND = opt_bench.HAND_COND
HAND_COND_BF16 = opt_bench.HAND_COND_BF16
LEAF_SIDE = 64  # leaves of LEAF_SIDE x LEAF_SIDE float32-initialised params


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileVariant:
  """One row of the compile-time table.

  Attributes:
    name: row label.
    build: ``build(params32, Grads) -> (fn, state, grads)``, as the optimizer
      step's variants build their steps.
    what: one line for the report.
  """

  name: str
  build: Callable[[PyTree, opt_bench.Grads], Any]
  what: str


VARIANTS = (
  CompileVariant(
    name=BASELINE, build=opt_bench.build_fp32, what="optax.adam on FP32 params (the baseline)"
  ),
  CompileVariant(
    name=opt_bench.HAND_BF16,
    build=opt_bench.build_hand_bf16,
    what="the hand-written bf16 step, no check, no skip",
  ),
  CompileVariant(
    name=HAND_COND_BF16,
    build=opt_bench.build_hand_cond_bf16,
    what="the check-then-apply step, bf16: the hand-written bf16 step (float32 masters) inside "
    "lax.cond(mpx.all_finite(grads), step, keep)",
  ),
  CompileVariant(
    name=HAND_COND,
    build=opt_bench.build_hand_cond,
    what="the check-then-apply step, fp16: the same on fp16 params and fp16 grads",
  ),
  CompileVariant(
    name="mpx bf16", build=opt_bench.build_mpx_bf16, what="mpx.mixed_precision(optax.adam)"
  ),
  CompileVariant(
    name="mpx fp16",
    build=opt_bench.build_mpx_fp16,
    what="mpx.loss_scale(mpx.mixed_precision(optax.adam))",
  ),
)
# Each mpx step and the check-then-apply step of its dtype, the baseline of its
# x_cond ratio (held to TARGET_COMPILE_VS_COND by the report).
TARGETED = {"mpx bf16": HAND_COND_BF16, "mpx fp16": HAND_COND}


def leaf_tree(leaves: int, side: int = LEAF_SIDE) -> dict[str, Any]:
  """Builds a tree of ``leaves`` square matrices of ``side x side`` parameters."""
  return opt_bench.many_leaf_shapes(leaves, side)


def split_seconds(
  fn: Callable[..., PyTree], state: PyTree, args: tuple[Any, ...]
) -> dict[str, float]:
  """Measures the trace, lower and compile seconds of ``jit(fn, donate_argnums=0)``.

  ``fn`` is wrapped in a new function first: jax caches traces by function
  identity, so a wrapper made for this measurement alone is traced afresh.
  """

  def fresh(*a):
    return fn(*a)

  jitted = jax.jit(fresh, donate_argnums=0)
  start = time.perf_counter()
  if hasattr(jitted, "trace"):
    traced = jitted.trace(state, *args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
  else:  # older jax: lower() traces too
    traced_at = start
    lowered = jitted.lower(state, *args)
  lowered_at = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  return {
    "trace_s": traced_at - start,
    "lower_s": lowered_at - traced_at,
    "compile_s": done - lowered_at,
    "total_s": done - start,
  }


def measure_tree(
  label: str,
  shapes: PyTree,
  rounds: int,
  variants: Sequence[CompileVariant] = VARIANTS,
  seed: int = 0,
) -> dict[str, Any]:
  """Measures every variant on one tree in ``rounds`` shuffled rounds.

  Returns:
    ``{"label", "leaves", "n", "rows"}``; each row holds the median trace,
    lower, compile and total seconds, ``x_adam`` (the median over rounds of
    the total over plain Adam's total in the same round), for a targeted
    variant ``x_cond`` (the same over its check-then-apply step's; None for
    the others) and the raw samples.
  """
  p32, g32 = opt_bench.make_arrays(shapes)
  grads = opt_bench.make_grads(g32)
  n = opt_bench.n_params(shapes)
  del g32
  by_name = {variant.name: variant for variant in variants}
  samples: dict[str, list[dict[str, float]]] = {name: [] for name in by_name}
  rng = random.Random(seed)
  order = list(by_name)
  for _ in range(rounds):
    rng.shuffle(order)
    for name in order:
      fn, state, g = by_name[name].build(p32, grads)
      samples[name].append(split_seconds(fn, state, (g,)))
      del fn, state, g
    gc.collect()  # drop this round's states and executables before the next
  del p32
  leaves = len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))

  def ratios(name: str, base: str) -> float | None:
    """Returns the median over rounds of ``name``'s total over ``base``'s in that round."""
    if base not in samples:
      return None
    pairs = zip(samples[name], samples[base], strict=True)
    return common.median([a["total_s"] / b["total_s"] for a, b in pairs])

  rows = {}
  for name, values in samples.items():
    row = {key: common.median([v[key] for v in values]) for key in values[0]}
    row["x_adam"] = ratios(name, BASELINE)
    row["x_cond"] = ratios(name, TARGETED[name]) if name in TARGETED else None
    row["ms_per_leaf"] = 1e3 * row["total_s"] / leaves
    row["totals_s"] = [v["total_s"] for v in values]
    rows[name] = row
  gc.collect()
  return {"label": label, "leaves": leaves, "n": n, "rows": rows}


def run(
  leaf_counts: Sequence[int],
  rounds: int,
  transformer: tuple[str, PyTree] | None = None,
  log: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
  """Measures compile times on the transformer-shaped tree and the many-leaf trees.

  Args:
    leaf_counts: leaf counts of the many-small-leaves trees.
    rounds: rounds per tree (each compiles every variant once).
    transformer: ``(label, shapes)`` of a transformer-shaped tree, or None.
    log: called with a line of progress after each tree.

  Returns:
    ``{"rounds", "leaf_side", "variants", "trees"}``.
  """
  trees = []
  if transformer is not None:
    label, shapes = transformer
    trees.append(measure_tree(label, shapes, rounds))
    log(f"  compile time: {label} tree measured")
  for count in leaf_counts:
    trees.append(measure_tree(f"{count} leaves", leaf_tree(count), rounds))
    log(f"  compile time: {count} leaves measured")
  return {
    "rounds": rounds,
    "leaf_side": LEAF_SIDE,
    "variants": [{"name": v.name, "what": v.what} for v in VARIANTS],
    "targeted": dict(TARGETED),
    "trees": trees,
  }


def main(argv: list[str] | None = None) -> int:
  """Measures the trees the flags name and prints the compile-time section."""
  from benchmarks import report

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--leaf-counts", default="100,300,1000", help="comma-separated")
  parser.add_argument("--rounds", type=int, default=3, help="fresh compilations per variant")
  parser.add_argument(
    "--no-transformer", action="store_true", help="skip the 1M transformer-shaped tree"
  )
  args = parser.parse_args(argv)
  counts = [int(c) for c in args.leaf_counts.split(",") if c.strip()]
  transformer = None if args.no_transformer else ("1M", opt_bench.param_shapes(2**20))
  results = run(counts, args.rounds, transformer)
  print("\n\n".join(report.compile_time_section(results)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
