"""Property tests (hypothesis): the exactness invariant and the skip invariant.

Exactness: after ``optax.apply_updates(params, updates)`` every low-precision
leaf equals its new master rounded (saturating) to the leaf's dtype, except in
the documented exponent-gap corner, where the error is bounded. The reference
is computed in numpy (IEEE float32 and ml_dtypes rounding), not by mpx.
"""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from treecheck import round_like_params, skip_recorded

import mpx

N = 64
# Significand bits (with the implicit one) of float32 and of each param dtype.
SIGNIFICAND = {jnp.bfloat16: 8, jnp.float16: 11}
NUMPY_TYPE = {jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16}

# XLA flushes float32 subnormals to zero on CPU and GPU, so masters are normal
# floats or zero; the reference flushes too (see `flush`).
BOUND = float(np.float32(1e30))
finite_f32 = st.floats(-BOUND, BOUND, width=32, allow_subnormal=False)
masters = hnp.arrays(np.float32, N, elements=finite_f32)
# How each new master relates to the old one: anything, a sign flip or zero
# crossing (-r * old), a small relative move (old * (1 + r)), or an exact tie
# between two params (half a param ulp above a param value).
modes = hnp.arrays(np.int8, N, elements=st.integers(0, 3))
ratios = hnp.arrays(np.float32, N, elements=st.floats(-2.0, 2.0, width=32))


@functools.cache
def jitted_step(param_dtype):
  tx = mpx.mixed_precision(optax.identity())  # update == gradient: any move

  @jax.jit
  def step(full, grads):
    params, state = mpx.init_from_full_precision(tx, {"w": full}, param_dtype)
    updates, state = tx.update({"w": grads}, state, params)
    return params["w"], optax.apply_updates(params, updates)["w"], state.master_params["w"]

  return step


def flush(x: np.ndarray) -> np.ndarray:
  """float32 subnormals to (signed) zero, as XLA computes."""
  tiny = np.finfo(np.float32).tiny
  return np.where(np.abs(x) < tiny, np.float32(0) * x, x).astype(np.float32)


def saturate(x: np.ndarray, param_dtype) -> np.ndarray:
  """The param a master rounds to: bf16 ties away from zero, fp16 to even."""
  numpy_type = NUMPY_TYPE[param_dtype]
  limit = np.float32(ml_dtypes.finfo(numpy_type).max)
  return round_like_params(np.clip(x, -limit, limit), numpy_type)


def tie_near(x: np.ndarray, param_dtype) -> np.ndarray:
  """A float32 value exactly halfway between ``x``'s rounding and the next
  param value up in magnitude."""
  numpy_type = NUMPY_TYPE[param_dtype]
  with np.errstate(over="ignore"):  # beyond the fp16 range: no tie, kept as is
    low = np.asarray(x, np.float32).astype(numpy_type)
  bits = low.view(np.uint16)
  up = np.where(np.isfinite(low.astype(np.float32)), bits + 1, bits).astype(np.uint16)
  high = up.view(numpy_type)
  mid = (low.astype(np.float64) + high.astype(np.float64)) / 2
  return np.where(np.isfinite(mid), mid, x).astype(np.float32)


def check_exactness(param_dtype, old, mode, ratio, free):
  nudged = old * (1 + ratio * 1e-3)
  target = np.where(
    mode == 0,
    free,
    np.where(mode == 1, -ratio * old, np.where(mode == 2, nudged, tie_near(nudged, param_dtype))),
  )
  old = flush(old)
  grads = flush((target.astype(np.float32) - old).astype(np.float32))
  new_master = flush((old + grads).astype(np.float32))  # IEEE float32, as on device
  finite = np.isfinite(grads) & np.isfinite(new_master)
  grads = np.where(finite, grads, 0).astype(np.float32)
  new_master = np.where(finite, new_master, old).astype(np.float32)

  param, landed, master = (np.asarray(x) for x in jitted_step(param_dtype)(old, grads))
  expected = saturate(new_master, param_dtype).astype(np.float64)
  landed64 = landed.astype(np.float64)
  param = param.astype(np.float64)
  gap = 2.0 ** -(24 - SIGNIFICAND[param_dtype])
  corner = (expected != 0) & (np.abs(expected) < np.abs(param) * gap)
  np.testing.assert_array_equal(landed64[~corner], expected[~corner])
  # In the corner: within two float32 ulps of the old param's magnitude.
  assert np.all(np.abs(landed64 - expected)[corner] <= np.abs(param[corner]) * 2.0**-22)
  assert np.all(np.isfinite(landed64))
  # The master: exact, except for a bf16 param in the corner, where it moves
  # to where the param landed (so a 16-bit remainder could hold it), by no
  # more than the landing error and half a bf16 ulp of the target.
  moved = corner if param_dtype == jnp.bfloat16 else np.zeros_like(corner)
  np.testing.assert_array_equal(master[~moved], new_master[~moved])
  np.testing.assert_array_equal(master[moved], landed[moved].astype(np.float32))
  bound = np.abs(param) * 2.0**-22 + np.abs(expected) * 2.0**-8
  assert np.all(np.abs(master.astype(np.float64) - new_master)[moved] <= bound[moved])


@settings(max_examples=150, deadline=None)
@given(old=masters, mode=modes, ratio=ratios, free=masters)
def test_bf16_params_land_on_their_rounded_masters(old, mode, ratio, free):
  check_exactness(jnp.bfloat16, old, mode, ratio, free)


@settings(max_examples=150, deadline=None)
@given(
  old=hnp.arrays(np.float32, N, elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False)),
  mode=modes,
  ratio=ratios,
  free=hnp.arrays(np.float32, N, elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False)),
)
def test_fp16_params_land_on_their_rounded_masters(old, mode, ratio, free):
  """Includes masters beyond the fp16 range: those params saturate at 65504."""
  check_exactness(jnp.float16, old, mode, ratio, free)


@functools.cache
def jitted_guarded_step(finite_check_form):
  del finite_check_form  # a separate trace (and cache entry) per form
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.chain(optax.clip_by_global_norm(5.0), optax.adam(1e-2))),
    init_scale=2.0**8,
  )
  return tx, jax.jit(tx.update)


@pytest.mark.slow  # a compilation per random tree: about half a minute a form
@settings(
  max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
  shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=4),
  dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
  poison=st.sampled_from([np.inf, -np.inf, np.nan]),
  where=st.integers(0, 10**6),
  seed=st.integers(0, 2**16),
)
def test_any_nonfinite_gradient_skips_with_everything_bitwise_unchanged(
  shapes, dtype, poison, where, seed, finite_check_form
):
  rng = np.random.default_rng(seed)
  params = {f"p{i}": jnp.asarray(rng.normal(size=s), dtype) for i, s in enumerate(shapes)}
  tx, step = jitted_guarded_step(finite_check_form)
  state = tx.init(params)
  warm = jax.tree.map(lambda p: jnp.ones_like(p), params)
  updates, state = step(warm, state, params)
  params = optax.apply_updates(params, updates)

  grads = {k: np.asarray(rng.normal(size=v.shape), np.float32) for k, v in params.items()}
  leaf = sorted(grads)[where % len(grads)]
  flat = grads[leaf].reshape(-1)
  flat[where % flat.size] = poison
  grads = {k: jnp.asarray(v, dtype) for k, v in grads.items()}
  updates, skipped = step(grads, state, params)

  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  # Bitwise unchanged but for the mixed_precision's count of the skip.
  assert skip_recorded(skipped.inner_state, state.inner_state)
  assert int(skipped.skipped_steps) == 1
  assert float(skipped.loss_scale) == float(state.loss_scale) / 2
