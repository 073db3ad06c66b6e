"""``masters="24bit"``: a bfloat16 param and an int8 correction, checked against
float32 arithmetic done here in numpy, and the check that refuses a step too
small for the masters."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lowering_forms import ACCELERATOR, forced

import mpx
from mpx._src import rounding, storage


def np_round_to_24bit(x: np.ndarray) -> np.ndarray:
  """Nearest float32 with its low 8 bits zero, ties away from zero (numpy, by hand)."""
  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  return ((bits + 0x80) & 0xFFFFFF00).astype(np.uint32).view(np.float32)


def np_round_ties_away_bf16(x: np.ndarray) -> np.ndarray:
  """The bfloat16 rounding (ties away) of float32 ``x``, as float32."""
  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  return ((bits + 0x8000) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.uint32)


def test_24bit_rounding_split_and_join_by_hand():
  rng = np.random.default_rng(0)
  x = (rng.normal(size=4096) * np.exp2(rng.integers(-60, 60, 4096))).astype(np.float32)
  master = rounding.round_to_24bit(jnp.asarray(x))
  assert np.array_equal(bits(master), bits(np_round_to_24bit(x)))
  param = rounding.round_ties_away(master)
  correction = (rounding.remainder(master) >> 8).astype(jnp.int8)  # as Master24bit.commit stores it
  joined = storage.Master24bit().view(correction, param)
  assert np.array_equal(bits(joined), bits(master))  # exact: nothing lost but the low 8 bits
  assert np.array_equal(bits(param.astype(jnp.float32)), bits(np_round_ties_away_bf16(master)))
  # A tie at 24 bits rounds away from zero: 1 + 2**-16 + 2**-24 sits halfway.
  tie = np.float32(1 + 2.0**-16 + 2.0**-24)
  assert float(rounding.round_to_24bit(jnp.float32(tie))) == 1 + 2.0**-15
  assert float(rounding.round_to_24bit(jnp.float32(-tie))) == -(1 + 2.0**-15)


def test_24bit_rounding_saturates_where_the_param_would_overflow():
  huge = jnp.asarray([3e38, -np.inf, np.inf, np.float32(np.finfo(np.float32).max)], jnp.float32)
  master = rounding.round_to_24bit(rounding.canonical(huge))
  param = rounding.round_ties_away(master)
  assert np.isfinite(np.asarray(param, np.float32)).all()
  assert (bits(master) & 0xFF == 0).all()


def test_nearest_correction_keeps_the_param_when_24_bits_cross_a_tie():
  # Low 16 bits 0x7FF0: the bfloat16 rounding goes down, but rounding to 24 bits
  # first would carry into the tie and round up; the correction clamps at 127.
  x = np.array([0x3F807FF0], np.uint32).view(np.float32)
  param = rounding.round_ties_away(jnp.asarray(x))
  correction = rounding.nearest_correction(jnp.asarray(x))
  assert int(correction[0]) == 127
  joined = storage.Master24bit().view(correction, param)
  assert bits(joined)[0] == 0x3F807F00
  assert bits(rounding.round_ties_away(joined))[0] == bits(param)[0]


def test_spacing_of_24bit_masters():
  values = jnp.asarray([1.0, 1.5, 256.0, 2.0**-100, 2.0**-120, 0.0], jnp.float32)
  expected = [2.0**-15, 2.0**-15, 2.0**-7, 2.0**-115, 0.0, 0.0]
  assert np.asarray(rounding.spacing_24bit(values)).tolist() == expected


def test_sgd_steps_round_the_float32_master_to_24_bits():
  """Each step: the float32 SGD update of the joined master, rounded to 24 bits by
  hand, and the param its bfloat16 rounding."""
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16)}
  lr = 2.0**-10  # a power of two: the update is exact, fused into an FMA or not
  tx = mpx.mixed_precision(optax.sgd(lr), masters="24bit")
  state = tx.init(params)
  assert state.master_corrections["w"].dtype == jnp.int8
  step = jax.jit(tx.update)
  master = np.asarray(params["w"], np.float32)
  for t in range(20):
    g = jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16)
    updates, state = step({"w": g}, state, params)
    params = optax.apply_updates(params, updates)
    update = (np.float32(-lr) * np.asarray(g, np.float32)).astype(np.float32)
    master = np_round_to_24bit((master + update).astype(np.float32))
    got = mpx.master_params(state, params)["w"]
    assert np.array_equal(bits(got), bits(master)), t
    assert np.array_equal(bits(params["w"].astype(jnp.float32)), bits(np_round_ties_away_bf16(got)))
  assert int(state.stalled_steps) == 0


def test_adamw_24bit_stays_within_a_24bit_step_of_float32_adamw():
  """Against plain float32 optax from the same master each step: at most one 24-bit
  spacing apart (half is the rounding, the rest float32's own), and with 4-bit
  moments the state is 2.06 B/param."""
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(0.1 * rng.normal(size=(128, 256)), jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.adamw(1e-3), masters="24bit")
  state, step = tx.init(params), jax.jit(tx.update)
  reference = optax.adamw(1e-3)
  for _ in range(10):
    g = {"w": jnp.asarray(rng.normal(size=(128, 256)), jnp.bfloat16)}
    master = mpx.master_params(state, params)
    want, _ = reference.update(
      jax.tree.map(lambda x: x.astype(jnp.float32), g), state.inner_state, master
    )
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
    expected = np.asarray(master["w"]) + np.asarray(want["w"])
    got = np.asarray(mpx.master_params(state, params)["w"])
    # Rounding error, and float32's in the update: a 24-bit spacing at the master or
    # at the result, whichever is larger (where the update cancels the master).
    larger = np.maximum(np.abs(expected), np.abs(np.asarray(master["w"])))
    assert (np.abs(got - expected) <= np.asarray(rounding.spacing_24bit(jnp.asarray(larger)))).all()
  tx = mpx.mixed_precision(optax.adamw(1e-3), masters="24bit", moments="4bit")
  big = {"w": jnp.zeros((1024, 1024), jnp.bfloat16)}
  stored = jax.eval_shape(tx.init, big)
  per_param = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(stored)) / big["w"].size
  assert 2.06 <= per_param < 2.07


def test_a_learning_rate_too_small_for_the_largest_weights_is_counted_and_refused():
  params = {"small": jnp.full(8, 0.01, jnp.bfloat16), "large": jnp.full(8, 300.0, jnp.bfloat16)}
  grads = {"small": jnp.ones(8, jnp.bfloat16), "large": jnp.ones(8, jnp.bfloat16)}
  # SGD(1e-3) moves 0.01 (spacing 2**-22) but not 300 (spacing 2**-7 = 0.0078).
  tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(1e-3), masters="24bit"), init_scale=1.0)
  state, step = tx.init(params), jax.jit(tx.update)
  for g in (grads, {**grads, "large": grads["large"].at[0].set(jnp.inf)}, grads):
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  inner = state.inner_state
  assert (int(inner.applied_steps), int(inner.stalled_steps)) == (2, 2)  # the skip not counted
  assert float(params["large"][0]) == 300.0  # the updates were lost
  with pytest.raises(mpx.MasterPrecisionError, match=r"2 of 2 applied steps .* Raise the learning"):
    mpx.check_master_precision(state)
  # A rate that moves the largest weights: nothing counted, the check passes.
  tx = mpx.mixed_precision(optax.sgd(0.05), masters="24bit")
  state = tx.init(params)
  _, state = tx.update(grads, state, params)
  assert int(state.stalled_steps) == 0
  mpx.check_master_precision(state)
  mpx.check_master_precision(mpx.mixed_precision(optax.sgd(1e-9)).init(params))  # not 24-bit


def test_switch_full_to_24bit_keeps_the_nearest_master_and_sync_restarts_a_zeroed_param():
  tx_full = mpx.mixed_precision(optax.sgd(1.0))
  full = {"w": jnp.asarray([1 + 2.0**-10 + 2.0**-20, -2.5 - 2.0**-12, 0.3], jnp.float32)}
  params, state = mpx.init_from_full_precision(tx_full, full, jnp.bfloat16)
  tx = mpx.mixed_precision(optax.sgd(1.0), masters="24bit")
  state = mpx.switch_masters(tx, state, params)
  assert type(state).__name__ == "MixedPrecision24bitState"
  got = mpx.master_params(state, params)["w"]
  assert np.array_equal(bits(got), bits(np_round_to_24bit(np.asarray(full["w"]))))
  # A param zeroed outside the optimizer under a negative correction restarts at 0.
  negative = {"w": jnp.asarray([1 - 2.0**-10], jnp.float32)}
  params, state = mpx.init_from_full_precision(tx, negative, jnp.bfloat16, allow_rounding=True)
  assert int(state.master_corrections["w"][0]) < 0
  zeroed = {"w": jnp.zeros(1, jnp.bfloat16)}
  synced = mpx.sync_masters(state, zeroed)
  assert float(mpx.master_params(synced, zeroed)["w"][0]) == 0.0


@pytest.mark.parametrize("form", [None, ACCELERATOR], ids=["cpu", "accelerator"])
def test_the_stall_count_is_the_same_in_both_programs(form):
  """With 8-bit moments the accelerator's program reads the stall check in its
  first pass; it must count what the CPU's step counts (and skip no count)."""
  rng = np.random.default_rng(3)
  params = {
    "large": jnp.asarray(300 + rng.normal(size=(8, 512)), jnp.bfloat16),
    "small": jnp.asarray(0.01 * rng.normal(size=(8, 512)), jnp.bfloat16),
  }
  grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
  tx = mpx.mixed_precision(optax.sgd(1e-3, momentum=0.9), masters="24bit", moments="8bit")
  with forced(form):
    state, step = tx.init(params), jax.jit(tx.update)
    assert isinstance(state.inner_state[0].trace["large"], mpx.Signed8bitMoment)
    _, state = step(grads, state, params)
    _, state = step({**grads, "small": grads["small"].at[0, 0].set(jnp.nan)}, state, params)
    bigger = jax.tree.map(lambda p: p * 0.001, params)  # 300 -> 0.3: moved again
    _, state = step(grads, state, bigger)
  assert (int(state.applied_steps), int(state.nonfinite_steps)) == (2, 1)
  assert int(state.stalled_steps) == 1


@pytest.mark.parametrize(
  "shape",
  [(4096, 11008), (50257, 768), (3, 1024, 768), (1024, 512), (32, 1024), (768,), (65536,)],
  ids=str,
)
def test_the_stall_sample_spans_the_leaf_and_splits_evenly_over_8_devices(shape):
  """The sample holds about a 256th of the leaf (at most ``STALL_SAMPLE``),
  reaches into the second half of each dimension it strides, and along each
  dimension 8 devices can split (ZeRO-1) puts an equal share on each."""
  size = math.prod(shape)
  strides = storage.stall_strides(shape)
  counts = [-(-n // s) for n, s in zip(shape, strides, strict=True)]
  aim = min(size, storage.STALL_SAMPLE, max(256, size // 256))
  assert aim // 4 <= math.prod(counts) <= aim
  for n, stride, count in zip(shape, strides, counts, strict=True):
    if count > 1:
      assert (count - 1) * stride >= n // 2, (n, stride)
    if n % 8 == 0:
      assert (n // 8) % stride == 0, (n, stride)  # each device's rows start on a sample


def test_the_stall_check_sees_a_leaf_whose_large_weights_are_in_its_last_rows():
  """A leaf whose first quarter is small and whose other rows are large: the
  largest master is read where it is, not in the first elements alone."""
  small = np.full((64, 512), 0.01, np.float32)
  small[16:] = 300.0
  params = {"w": jnp.asarray(small, jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.sgd(1e-3), masters="24bit")
  state = tx.init(params)
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  assert int(state.stalled_steps) == 1  # 1e-3 is below the 24-bit spacing at 300


def test_the_stall_count_misses_a_lone_large_weight_between_sampled_elements():
  """What docs/concepts_masters.md says the sample can miss: one weight of 300.0
  (24-bit spacing 2**-7) among 0.01s loses SGD's 1e-3 updates, and is counted
  where the sample reads it (index 0) but not between sampled elements (index 1)."""
  (stride,) = storage.stall_strides((65536,))
  assert stride > 1
  tx = mpx.mixed_precision(optax.sgd(1e-3), masters="24bit")
  counted = {}
  for index in (0, 1, stride):
    weights = np.full(65536, 0.01, np.float32)
    weights[index] = 300.0
    params = {"w": jnp.asarray(weights, jnp.bfloat16)}
    _, state = jax.jit(tx.update)({"w": jnp.ones(65536, jnp.bfloat16)}, tx.init(params), params)
    assert float(mpx.master_params(state, params)["w"][index]) == 300.0  # the update is lost
    counted[index] = int(state.stalled_steps)
  assert counted == {0: 1, 1: 0, stride: 1}
