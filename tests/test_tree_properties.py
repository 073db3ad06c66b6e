"""Property tests over random tree *structures* with mixed dtypes.

tests/test_properties.py checks the exactness and skip invariants on flat
trees of one dtype. Here hypothesis draws nested dicts, lists and tuples whose
leaves mix bf16, fp16, float32 (updated in place, no master) and int32 (never
cast, never unscaled), with scalar and array shapes, magnitudes from 1e-3 to
1e4 and power-of-two loss scales from 1/4 to 64, so that fp16 gradients
sometimes overflow when scaled and fp16 masters sometimes leave the fp16 range.

The references are numpy's (IEEE float32, ml_dtypes rounding for fp16, and
the ties-away rounding of bf16 computed on the bits), not mpx's.

Every example has a new tree structure, which ``jit`` would compile afresh
(about a second each on the CI's two cores), so the steps run op by op under
``jax.disable_jit()``: the same arithmetic, with ``lax.cond`` taking its branch
in Python. The compiled skip is covered by tests/test_properties.py and
tests/test_fault_injection.py.
"""

from typing import NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from treecheck import round_like_params, skip_recorded, tree_equal

import mpx

LOW = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SIGNIFICAND = {"bfloat16": 8, "float16": 11}


class Leaf(NamedTuple):
  dtype: str
  shape: tuple
  exponent: int  # values are normal samples times 10**exponent


leaves = st.builds(
  Leaf,
  st.sampled_from(["bfloat16", "float16", "float32", "int32"]),
  st.sampled_from([(), (1,), (3,), (2, 2)]),
  st.integers(-3, 4),
)
specs = st.recursive(
  leaves,
  lambda children: st.one_of(
    st.lists(children, min_size=1, max_size=3),
    st.lists(children, min_size=1, max_size=3).map(tuple),
    st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
  ),
  max_leaves=6,
)


def is_spec_leaf(x):
  return isinstance(x, Leaf)


def draw_values(spec, rng, exponent_shift=0):
  """numpy arrays for the spec (ml_dtypes for bf16), with the spec's structure."""

  def make(leaf):
    if leaf.dtype == "int32":
      return rng.integers(-50, 50, leaf.shape).astype(np.int32)
    values = rng.normal(size=leaf.shape) * 10.0 ** (leaf.exponent + exponent_shift)
    return np.asarray(values.astype(np.float32).astype(LOW.get(leaf.dtype, np.float32)))

  return jax.tree.map(make, spec, is_leaf=is_spec_leaf)


def flush(x):
  """float32 subnormals to zero, as XLA computes on the CPU."""
  return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0) * x, x).astype(np.float32)


def expected_leaf(param, grad32):
  """Where ``apply_updates`` must put ``param`` after a finite identity step."""
  dtype = param.dtype.name
  if dtype == "int32":
    return param + grad32, None
  target = flush(param.astype(np.float32) + grad32)  # the new master (or the new f32 leaf)
  if dtype == "float32":
    return target, None
  limit = np.float32(ml_dtypes.finfo(LOW[dtype]).max)
  # bf16 params round ties away from zero (the rule a remainder can encode).
  expected = round_like_params(np.clip(target, -limit, limit), LOW[dtype])
  # The documented exponent-gap corner: a master far below its old param.
  gap = 2.0 ** -(24 - SIGNIFICAND[dtype])
  old = np.abs(param.astype(np.float64))
  corner = (expected != 0) & (np.abs(expected.astype(np.float64)) < old * gap)
  return expected, corner


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(spec=specs, seed=st.integers(0, 2**16), log_scale=st.integers(-2, 6))
@jax.disable_jit()
def test_every_leaf_lands_exactly_or_the_step_is_skipped(spec, seed, log_scale):
  """Low-precision leaves land on their rounded, saturated masters; float32
  leaves take the float32 step; int32 leaves are added to uncast and unscaled;
  a gradient that overflows when scaled skips the whole step."""
  rng = np.random.default_rng(seed)
  scale = 2.0**log_scale
  params = draw_values(spec, rng)
  grads = draw_values(spec, rng)  # true gradients, in the params' dtypes

  def scaled(g):
    if g.dtype == np.int32:
      return g
    with np.errstate(over="ignore"):  # fp16 overflow to inf is the point
      return (g.astype(np.float32) * np.float32(scale)).astype(g.dtype)

  scaled_grads = jax.tree.map(scaled, grads)
  unscaled = jax.tree.map(
    lambda g: g if g.dtype == np.int32 else g.astype(np.float32) * np.float32(1 / scale),
    scaled_grads,
  )
  finite = all(np.isfinite(g).all() for g in jax.tree.leaves(unscaled) if g.dtype != np.int32)

  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.identity()), init_scale=scale, min_scale=min(scale, 1.0)
  )
  state = tx.init(jax.tree.map(jnp.asarray, params))
  updates, new_state = tx.update(
    jax.tree.map(jnp.asarray, scaled_grads), state, jax.tree.map(jnp.asarray, params)
  )
  landed = jax.device_get(optax.apply_updates(jax.tree.map(jnp.asarray, params), updates))

  assert int(new_state.skipped_steps) == (not finite)
  if not finite:
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    assert skip_recorded(new_state.inner_state, state.inner_state)
    assert tree_equal(landed, params)
    return
  for param, grad, out in zip(
    jax.tree.leaves(params), jax.tree.leaves(unscaled), jax.tree.leaves(landed), strict=True
  ):
    assert out.dtype == param.dtype and out.shape == param.shape
    expected, corner = expected_leaf(param, grad)
    if corner is None:
      np.testing.assert_array_equal(out, expected)
    else:
      np.testing.assert_array_equal(out[~corner], expected[~corner])
      bound = np.abs(param.astype(np.float64)) * 2.0**-22
      assert np.all(
        np.abs(out.astype(np.float64) - expected.astype(np.float64))[corner] <= bound[corner]
      )
      assert np.isfinite(out.astype(np.float32)).all()


def floating_mask(params):
  return jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), params)


# Quick: the "one CPU device" form (the lax.cond, run in Python here); the
# select's skip is run on random trees by -m slow, and on whole training runs
# by test_fault_injection's quick "GPU form" cases.
@pytest.mark.parametrize(
  "finite_check_form",
  ["one CPU device"]
  + [pytest.param(f, marks=pytest.mark.slow) for f in ("several devices", "GPU form")],
  indirect=True,
)
@settings(
  suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=25, deadline=None
)
@given(
  spec=specs,
  seed=st.integers(0, 2**16),
  poison=st.sampled_from([np.inf, -np.inf, np.nan]),
  where=st.integers(0, 2**20),
  wrap=st.booleans(),
)
@pytest.mark.slow
@jax.disable_jit()
def test_any_nonfinite_float_leaf_skips_the_whole_step(
  spec, seed, poison, where, wrap, finite_check_form
):
  """Poisoning one element of any floating leaf (bf16, fp16 or a float32 leaf
  that has no master) skips the step: zero updates for every leaf, integer
  leaves included, the state bitwise unchanged but for the counters, and the
  next clean step exactly as if the poisoned one had never been fed."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(jnp.asarray, draw_values(spec, rng))
  floating = [i for i, x in enumerate(jax.tree.leaves(params)) if x.dtype != jnp.int32]
  if not floating:
    return
  inner = optax.masked(
    optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-2)), floating_mask
  )
  tx = (
    mpx.loss_scale(mpx.mixed_precision(inner), init_scale=8.0)
    if wrap
    else mpx.mixed_precision(inner)
  )
  step = tx.update

  def zero_ints(tree):
    return jax.tree.map(lambda g: g * 0 if g.dtype == jnp.int32 else g, tree)

  state = tx.init(params)
  updates, state = step(zero_ints(jax.tree.map(jnp.asarray, draw_values(spec, rng))), state, params)
  params = optax.apply_updates(params, updates)

  flat, treedef = jax.tree.flatten(draw_values(spec, rng))
  leaf = flat[floating[where % len(floating)]]
  leaf.reshape(-1)[where % max(leaf.size, 1)] = poison
  poisoned = zero_ints(jax.tree.map(jnp.asarray, treedef.unflatten(flat)))
  updates, skipped = step(poisoned, state, params)

  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert tree_equal(optax.apply_updates(params, updates), params)
  clean = zero_ints(jax.tree.map(jnp.asarray, draw_values(spec, rng)))
  if not wrap:
    assert skip_recorded(skipped, state)
    (after_skip, state_after_skip), (after, state_after) = (
      step(clean, skipped, params),
      step(clean, state, params),
    )
    assert tree_equal(after_skip, after) and skip_recorded(state_after_skip, state_after)
    return
  assert skip_recorded(skipped.inner_state, state.inner_state)
  assert int(skipped.skipped_steps) == int(state.skipped_steps) + 1
  assert float(skipped.loss_scale) == float(state.loss_scale) / 2
  # Continuing at the backed-off scale, as if the poisoned step was never fed.
  never_fed = state._replace(loss_scale=skipped.loss_scale)
  after_skip, after_clean = step(clean, skipped, params), step(clean, never_fed, params)
  assert tree_equal(after_skip[0], after_clean[0])
  assert skip_recorded(after_skip[1].inner_state, after_clean[1].inner_state)
