"""The bit operations under the storage modes (``mpx/_src/rounding.py``),
against numpy computations on the bits and in float64.

Each test runs over every bfloat16 pattern with the low halves that matter
(0, just below and above the tie, the tie itself, the extremes) plus a million
random float32 patterns.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from treecheck import round_to_bfloat16

from mpx._src import rounding, storage
from mpx._src import tree as tree_lib

LIMIT = np.array(0x7F7F7FFF, np.uint32).view(np.float32)


def float32_patterns() -> np.ndarray:
  """Finite float32 values: every bf16 pattern with interesting low halves,
  and random bit patterns."""
  high = np.arange(2**16, dtype=np.uint32) << 16
  lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
  edges = (high[:, None] | lows[None, :]).ravel()
  random = np.random.default_rng(0).integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
  values = np.concatenate([edges, random]).view(np.float32)
  return values[np.isfinite(values)]


VALUES = float32_patterns()


def test_split_then_join_is_the_master_bit_for_bit():
  canonical = np.clip(VALUES, -LIMIT, LIMIT)
  canonical = np.where(np.abs(canonical) < np.finfo(np.float32).tiny, 0, canonical)  # subnormals
  param, remainder = jax.jit(rounding.split)(jnp.asarray(canonical))
  # The param is the nearest bfloat16, ties away from zero, as numpy rounds it.
  np.testing.assert_array_equal(
    np.asarray(param).view(np.uint16), round_to_bfloat16(canonical).view(np.uint16)
  )
  # ... which is never farther than half an ulp (checked in float64).
  p64 = np.asarray(param).astype(np.float64)
  ulp = np.spacing(np.abs(np.asarray(param)).astype(ml_dtypes.bfloat16)).astype(np.float64)
  assert np.all(np.abs(p64 - canonical.astype(np.float64)) <= ulp / 2)
  # The remainder kind's view joins them back into every bit; no param is infinite.
  joined = jax.jit(storage.Remainder().view)(remainder, param)
  np.testing.assert_array_equal(np.asarray(joined).view(np.uint32), canonical.view(np.uint32))
  assert np.isfinite(p64).all()
  assert np.asarray(remainder).dtype == np.int16


def test_float32_forms_equal_the_bfloat16_ones_bit_for_bit():
  """round_ties_away_f32, remainder and landing_f32 are split's and
  landing's results computed without the bfloat16 round trip (fewer ops to
  compile), on every pattern, NaN and inf included."""
  patterns = np.concatenate(
    [VALUES, np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)]
  ).astype(np.float32)
  x = jnp.asarray(patterns)
  param, remainder = jax.jit(rounding.split)(x)
  as_f32 = np.asarray(jax.jit(rounding.round_ties_away_f32)(x)).view(np.uint32)
  np.testing.assert_array_equal(as_f32, np.asarray(param).view(np.uint16).astype(np.uint32) << 16)
  np.testing.assert_array_equal(np.asarray(jax.jit(rounding.remainder)(x)), np.asarray(remainder))
  # A param far larger than its target: the float32 update rounds on landing.
  params = jnp.asarray(np.resize(np.array([1.0, -3e5, 2.0**-100, 0.0], np.float32), x.shape))
  params = params.astype(jnp.bfloat16)
  landed = jax.jit(rounding.landing)(params, param)
  landed_f32 = np.asarray(
    jax.jit(rounding.landing_f32)(params, jax.jit(rounding.round_ties_away_f32)(x))
  )
  widened = np.asarray(landed).view(np.uint16).astype(np.uint32) << 16
  assert_same_bits_nan_as_nan(landed_f32, widened.view(np.float32))


def assert_same_bits_nan_as_nan(got: np.ndarray, want: np.ndarray) -> None:
  """Asserts two float32 arrays equal bit for bit, a NaN only as a NaN: XLA:GPU's
  reduce_precision sets every payload bit of a NaN."""
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_round_as_is_the_round_trip_through_the_narrow_dtype(dtype):
  """round_as(x, dtype) is x.astype(dtype).astype(float32) bit for bit: every
  float16 value, its float32 neighbours and the midpoints between float16
  values (ties), random patterns, subnormals of both, signed zeros, inf, NaN."""
  halves = np.arange(2**16, dtype=np.uint16).view(np.float16)
  halves = np.sort(halves[np.isfinite(halves)].astype(np.float64))
  midpoints = (halves[:-1] + halves[1:]) / 2
  halves32 = halves.astype(np.float32)
  x = np.concatenate(
    [
      VALUES,
      halves32,
      np.nextafter(halves32, np.float32(np.inf)),
      np.nextafter(halves32, np.float32(-np.inf)),
      midpoints.astype(np.float32),
      np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32),
    ]
  )
  x = x[~(np.abs(x) > float(ml_dtypes.finfo(dtype).max))]  # within range (NaN kept)
  got = np.asarray(jax.jit(tree_lib.round_as, static_argnums=1)(jnp.asarray(x), dtype))
  with np.errstate(invalid="ignore"):
    want = x.astype(dtype).astype(np.float32)
  assert_same_bits_nan_as_nan(got, want)


def test_canonical_saturates_and_keeps_nan():
  x = jnp.asarray([np.inf, -np.inf, 3.4e38, -3.4e38, LIMIT, 1.0, np.nan], jnp.float32)
  out = np.asarray(jax.jit(rounding.canonical)(x))
  np.testing.assert_array_equal(out[:6], [LIMIT, -LIMIT, LIMIT, -LIMIT, LIMIT, 1.0])
  assert np.isnan(out[6])
  param = np.asarray(jax.jit(rounding.round_ties_away)(jnp.asarray(out[:5])), np.float32)
  np.testing.assert_array_equal(np.abs(param), float(jnp.finfo(jnp.bfloat16).max))


@pytest.mark.parametrize("noise", [0, 0x7FFF, 0x8000, 0xFFFF])
def test_stochastic_round_picks_a_neighbour_by_its_low_bits(noise):
  values = np.clip(VALUES, -LIMIT, LIMIT)
  values = values[np.abs(values) >= np.finfo(np.float32).tiny]
  bits = jnp.full(values.shape, noise, jnp.uint32)
  out = np.asarray(jax.jit(rounding.stochastic_round)(jnp.asarray(values), bits))
  low = values.view(np.uint32) & 0xFFFF
  truncated = (values.view(np.uint32) >> 16).astype(np.uint16)
  # Up in magnitude exactly when low + noise carries into the top half...
  up = (low + noise) >= 0x10000
  expected = np.where(up, truncated + 1, truncated).astype(np.uint16)
  # ... except from the bfloat16 maximum, which stays (no overflow to inf).
  at_max = (truncated & 0x7FFF) == 0x7F7F
  expected = np.where(at_max, truncated, expected)
  np.testing.assert_array_equal(out.view(np.uint16), expected)


def test_landing_is_where_optax_apply_updates_puts_the_param():
  rng = np.random.default_rng(1)
  params = (rng.normal(size=4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(ml_dtypes.bfloat16)
  targets = (rng.normal(size=4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(ml_dtypes.bfloat16)
  p, t = jnp.asarray(params), jnp.asarray(targets)
  landed = jax.jit(rounding.landing)(p, t)
  updates = t.astype(jnp.float32) - p.astype(jnp.float32)
  np.testing.assert_array_equal(
    np.asarray(landed).view(np.uint16),
    np.asarray(optax.apply_updates(p, updates)).view(np.uint16),
  )
  # Somewhere the update rounds in float32 (the corner), and applied again, it lands.
  assert np.any(np.asarray(landed).view(np.uint16) != np.asarray(t).view(np.uint16))
  again = optax.apply_updates(p, landed.astype(jnp.float32) - p.astype(jnp.float32))
  np.testing.assert_array_equal(
    np.asarray(again).view(np.uint16), np.asarray(landed).view(np.uint16)
  )


def test_random_bits_are_a_function_of_key_count_and_global_index():
  bits = jax.jit(rounding.random_bits, static_argnums=2)
  key = jnp.asarray(rounding.leaf_key(0, 3))
  a = np.asarray(bits(key, jnp.int32(5), (64, 32)))
  # The bits of element (i, j) are those of element i * 32 + j of a flat leaf.
  np.testing.assert_array_equal(a.ravel(), np.asarray(bits(key, jnp.int32(5), (2048,))))
  # Roughly uniform: each of the 32 bits is set about half the time.
  ones = np.unpackbits(a.view(np.uint8)).reshape(-1, 32).mean(axis=0)
  assert np.all(np.abs(ones - 0.5) < 0.05)
  assert not np.array_equal(a, np.asarray(bits(key, jnp.int32(6), (64, 32))))
  assert rounding.leaf_key(0, 3) != rounding.leaf_key(0, 4) != rounding.leaf_key(1, 4)
