"""Compile time stays linear in the number of leaves, and the step is traced once.

At 1,000 leaves the bf16 step once took 312 s to compile against 5 s for
plain optax Adam: XLA fused every per-leaf finite check into every update
kernel (docs/design.md, "Compile time"). XLA's compile time follows the size
of the program it optimizes (its passes walk every instruction, fused ones
included; see benchmarks/compile_profile.py), so the guard here is that size,
which is deterministic, not a timing: the optimized HLO of the mpx steps must
have as many kernels per leaf as the check-then-apply step of their dtype
written by hand (float32 masters, the step inside
``lax.cond(mpx.all_finite(grads))``), a
bounded multiple of its instructions per leaf, and the same per leaf at 50 and
200 leaves. The benchmarks report the seconds (``python benchmarks/run.py``).
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from lowering_forms import forced

import mpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import compile_profile  # noqa: E402
from benchmarks import optimizer_step as opt_bench  # noqa: E402

SIDE = 32
# Instructions inside fusions per leaf, over the hand step's: about 1.65 (bf16:
# ties-away rounding, the landing check and the skip select add ops to each
# leaf's kernels) and 1.35 (fp16) when written; the quadratic blow-up it
# guards against multiplied it by the number of leaves.
GENEROUS = 2.5
# Kernels beyond the hand step's that do not grow with the leaves (the
# loss-scale update, a few scalar fusions).
FIXED_KERNELS = 16

STEPS = {
  opt_bench.HAND_COND_BF16: opt_bench.build_hand_cond_bf16,
  opt_bench.HAND_COND: opt_bench.build_hand_cond,
  "mpx bf16": opt_bench.build_mpx_bf16,
  "mpx fp16": opt_bench.build_mpx_fp16,
}
# Each mpx step and the check-then-apply step of its dtype.
HAND_OF = {"mpx bf16": opt_bench.HAND_COND_BF16, "mpx fp16": opt_bench.HAND_COND}


def hlo_sizes(leaves):
  """Per step: (fusions, instructions inside fusions, conditionals, whiles) of
  the optimized HLO on ``leaves`` leaves of SIDE x SIDE."""
  shapes = opt_bench.many_leaf_shapes(leaves, SIDE)
  p32, g32 = opt_bench.make_arrays(shapes)
  grads = opt_bench.make_grads(g32)
  out = {}
  for name, build in STEPS.items():
    fn, state, g = build(p32, grads)
    text = jax.jit(fn, donate_argnums=0).lower(state, g).compile().as_text()
    counts = compile_profile.hlo_counts(text)
    out[name] = (
      counts["fusion"],
      counts["instructions_fused"],
      counts["conditional"],
      counts["while"],
    )
  return out


@pytest.mark.xla_cost
@pytest.mark.slow
def test_compiled_step_grows_linearly_and_like_the_hand_step():
  # On one CPU device the check takes the forms the benchmarks and most
  # users get (sums and folds), where the blow-up happened.
  with forced("one-cpu"):
    small, large = hlo_sizes(50), hlo_sizes(200)
  for name, hand_name in HAND_OF.items():
    (fusions, fused, conds, whiles), hand = large[name], large[hand_name]
    assert fusions <= hand[0] + FIXED_KERNELS, (name, large)
    assert fused <= GENEROUS * hand[1], (name, large)
    assert conds <= hand[2] + 1 and whiles == 0, (name, large)
    # Linear: 150 more leaves add 150 times what one leaf adds, no more.
    per_leaf_small = small[name][1] / 50
    per_leaf_added = (large[name][1] - small[name][1]) / 150
    assert per_leaf_added <= 1.05 * per_leaf_small, (name, small[name], large[name])
    assert large[name][0] - small[name][0] <= 150 * (small[name][0] / 50) * 1.05


def counting(inner, calls):
  """``inner`` with its init and update counted (each call is a trace under jit)."""

  def init(params):
    calls["init"] += 1
    return inner.init(params)

  def update(updates, state, params=None, **extra_args):
    calls["update"] += 1
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize(
  ("dtype", "wrap"),
  [
    (jnp.bfloat16, lambda inner: mpx.mixed_precision(inner)),
    (jnp.float16, lambda inner: mpx.loss_scale(mpx.mixed_precision(inner))),
    # The general path (no mixed_precision directly inside): float32 params.
    (jnp.float32, lambda inner: mpx.loss_scale(optax.chain(optax.identity(), inner))),
  ],
)
def test_one_trace_of_the_step_traces_the_inner_rule_once(dtype, wrap):
  # The skipped branch takes its zeros from the shapes the applied branch
  # recorded, and validation traces init at most once: nothing is traced twice.
  calls = {"init": 0, "update": 0}
  tx = wrap(counting(optax.adam(1e-3), calls))
  params = {"w": jnp.ones((4, 3), dtype), "b": jnp.zeros(3, jnp.float32)}
  state = tx.init(params)
  calls.update(init=0, update=0)
  jax.jit(tx.update).trace(params, state, params)
  assert calls["update"] == 1 and calls["init"] <= 1, calls
