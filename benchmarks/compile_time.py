"""Compile time of one optimizer step against the number of leaves.

Trace, lower and compile seconds of the optimizer step (update and
``optax.apply_updates`` in one jitted function, state donated, as
:mod:`benchmarks.optimizer_step` builds it) for plain optax Adam, the
hand-written bf16 step with and without a ``lax.cond`` on ``mpx.all_finite``,
and mpx bf16 and fp16, on trees of many small leaves and on the
transformer-shaped tree. Compile time that grows faster than the leaf count
makes large models slow to start, so the issue's target is a ratio to plain
Adam's at each leaf count.

Every measurement jits a freshly wrapped function, so that neither jax's
tracing cache nor its executable cache answers; in each round the variants run
in a freshly shuffled order, and each one's total is divided by plain Adam's of
the same round. Reported: median seconds, and the median over rounds of that
ratio.

Run alone from the repository root (``benchmarks/run.py`` runs it too)::

  python benchmarks/compile_time.py --leaf-counts 100,300 --rounds 1
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
HAND_COND_BF16 = "hand bf16 + cond"
LEAF_SIDE = 64  # leaves of LEAF_SIDE x LEAF_SIDE float32-initialised params


@dataclasses.dataclass(frozen=True)
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
  CompileVariant(BASELINE, opt_bench.build_fp32, "optax.adam on FP32 params (the baseline)"),
  CompileVariant(
    opt_bench.HAND_BF16,
    opt_bench.build_hand_bf16,
    "the hand-written bf16 step, no check, no skip",
  ),
  CompileVariant(
    HAND_COND_BF16,
    opt_bench.build_hand_cond_bf16,
    "the hand-written bf16 step inside lax.cond(mpx.all_finite(grads), step, keep)",
  ),
  CompileVariant("mpx bf16", opt_bench.build_mpx_bf16, "mpx.mixed_precision(optax.adam)"),
  CompileVariant(
    "mpx fp16", opt_bench.build_mpx_fp16, "mpx.loss_scale(mpx.mixed_precision(optax.adam))"
  ),
)
TARGETED = ("mpx bf16", "mpx fp16")  # held to TARGET_VS_ADAM by the report


def leaf_tree(leaves: int, side: int = LEAF_SIDE) -> dict[str, Any]:
  """``leaves`` square matrices of ``side x side`` parameters."""
  return opt_bench.many_leaf_shapes(leaves, side)


def split_seconds(
  fn: Callable[..., PyTree], state: PyTree, args: tuple[Any, ...]
) -> dict[str, float]:
  """Trace, lower and compile seconds of ``jit(fn, donate_argnums=0)``.

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
    the total over plain Adam's total in the same round) and the raw samples.
  """
  p32, g32 = opt_bench.make_arrays(shapes)
  grads = opt_bench.make_grads(g32)
  n = opt_bench.n_params(shapes)
  del g32
  built = {}
  for variant in variants:
    fn, state, g = variant.build(p32, grads)
    built[variant.name] = (fn, state, (g,))
  del p32
  samples: dict[str, list[dict[str, float]]] = {name: [] for name in built}
  ratios: dict[str, list[float]] = {name: [] for name in built}
  rng = random.Random(seed)
  order = list(built)
  for _ in range(rounds):
    rng.shuffle(order)
    this_round = {name: split_seconds(*built[name]) for name in order}
    base = this_round[BASELINE]["total_s"]
    for name, split in this_round.items():
      samples[name].append(split)
      ratios[name].append(split["total_s"] / base)
    gc.collect()  # drop this round's executables before the next
  leaves = len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
  rows = {}
  for name, values in samples.items():
    row = {key: common.median([v[key] for v in values]) for key in values[0]}
    row["x_adam"] = common.median(ratios[name])
    row["ms_per_leaf"] = 1e3 * row["total_s"] / leaves
    row["totals_s"] = [v["total_s"] for v in values]
    rows[name] = row
  del built
  gc.collect()
  return {"label": label, "leaves": leaves, "n": n, "rows": rows}


def run(
  leaf_counts: Sequence[int],
  rounds: int,
  transformer: tuple[str, PyTree] | None = None,
  log: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
  """Compile times on the transformer-shaped tree (if given) and on a tree of
  ``count`` small leaves for each of ``leaf_counts``.

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
    "targeted": list(TARGETED),
    "trees": trees,
  }


def main(argv: list[str] | None = None) -> int:
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
