"""Bit operations between float32 masters and bfloat16 params: ties-away
rounding, remainders, saturation and stochastic rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import tree as tree_lib

U32 = jnp.uint32
# The largest float32 whose nearest bfloat16 (ties away) is finite, 0x7f7f7fff.
_LIMIT = np.array(0x7F7F7FFF, np.uint32).view(np.float32)
# The largest 24-bit master (a float32 with its low 8 bits zero) below _LIMIT.
_LIMIT_24 = np.array(0x7F7F7F00, np.uint32).view(np.float32)


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, U32)


def _float(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bf16(bits16: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits16.astype(jnp.uint16), jnp.bfloat16)


def _bf16_bits(param: jax.Array) -> jax.Array:
  """Returns a bfloat16 array's 16-bit patterns, widened to uint32."""
  return jax.lax.bitcast_convert_type(param, jnp.uint16).astype(U32)


def canonical(master: jax.Array) -> jax.Array:
  """Clips a float32 ``master`` (inf included) to the largest magnitude whose
  bfloat16 rounding is finite. It reads ``master`` once, so that XLA keeps the
  clip inside the update's fusion instead of materialising ``master``."""
  return jax.lax.clamp(-_LIMIT, master, _LIMIT)


def round_ties_away(master: jax.Array) -> jax.Array:
  """Rounds a canonical float32 ``master`` to the nearest bfloat16, ties away."""
  return _bf16(
    jax.lax.shift_right_logical(jax.lax.add(_bits(master), np.uint32(0x8000)), np.uint32(16))
  )


def round_ties_away_f32(master: jax.Array) -> jax.Array:
  """Returns ``round_ties_away(master)`` as the float32 that holds it exactly,
  saving the round trip through bfloat16 where the result is used in float32."""
  top = jax.lax.bitwise_and(jax.lax.add(_bits(master), np.uint32(0x8000)), np.uint32(0xFFFF0000))
  return _float(top)


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits a canonical float32 ``master`` into ``(param, remainder)``: its
  bfloat16 rounding (ties away) and the int16 that ``join`` adds back."""
  return round_ties_away(master), remainder(master)


def remainder(master: jax.Array) -> jax.Array:
  """Returns ``split(master)[1]`` without making the bfloat16 param."""
  low = jax.lax.sub(_bits(master), _bits(round_ties_away_f32(master)))
  # In int16's range already; the clamp keeps XLA:GPU (jax 0.11.2) from
  # computing a truncating convert of a computed float's bits as a
  # float-to-int conversion (zero for |x| < 1), which it did in some fusions.
  low = jax.lax.bitcast_convert_type(low, jnp.int32)
  return jax.lax.clamp(np.int32(-(2**15)), low, np.int32(2**15 - 1)).astype(jnp.int16)


def join(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """Joins a bfloat16 ``param`` and its int16 ``remainder`` into the float32
  master ``(param_bits << 16) + remainder``, exact for every pair ``split``
  made. A zero param with a negative remainder (see ``wraps``) joins as zero."""
  low = jax.lax.select(wraps(param, remainder), jnp.zeros_like(remainder), remainder)
  high = jax.lax.shift_left(_bf16_bits(param), np.uint32(16))
  return _float(jax.lax.add(high, low.astype(jnp.int32).astype(U32)))


def wraps(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """Marks where ``(param_bits << 16) + remainder`` would wrap into a NaN
  pattern: a zero param (a param zeroed outside the optimizer) with a
  negative remainder, which ``split`` never makes."""
  magnitude = jax.lax.bitwise_and(_bf16_bits(param), np.uint32(0x7FFF))
  is_zero = jax.lax.eq(magnitude, np.uint32(0))
  return jax.lax.bitwise_and(is_zero, jax.lax.lt(remainder, jnp.zeros_like(remainder)))


def round_to_24bit(master: jax.Array) -> jax.Array:
  """Rounds a float32 ``master`` to the nearest 24-bit master (ties away): a
  float32 whose low 8 bits are zero, saturating where its bfloat16 rounding
  would not be finite."""
  bits = _bits(jax.lax.clamp(-_LIMIT_24, master, _LIMIT_24))
  return _float(jax.lax.bitwise_and(jax.lax.add(bits, np.uint32(0x80)), np.uint32(0xFFFFFF00)))


def correction(master: jax.Array) -> jax.Array:
  """Returns the int8 that ``join_24bit`` adds back to the bfloat16 rounding (ties
  away) of a 24-bit ``master`` (from ``round_to_24bit``): its remainder over 256."""
  return jax.lax.shift_right_arithmetic(remainder(master), np.int16(8)).astype(jnp.int8)


def nearest_correction(master: jax.Array) -> jax.Array:
  """Returns the int8 correction of the 24-bit master nearest to a canonical
  float32 ``master`` among those whose bfloat16 rounding is ``master``'s own
  (``round_to_24bit`` first can cross a tie and change that rounding)."""
  remainder16 = remainder(master).astype(jnp.int32)
  nearest = jax.lax.shift_right_arithmetic(jax.lax.add(remainder16, np.int32(0x80)), np.int32(8))
  return jax.lax.clamp(np.int32(-128), nearest, np.int32(127)).astype(jnp.int8)


def join_24bit(param: jax.Array, correction: jax.Array) -> jax.Array:
  """Joins a bfloat16 ``param`` and its int8 ``correction`` into the float32
  master ``(param_bits << 16) + (correction << 8)``. A zero param with a
  negative correction (see ``wraps``) joins as zero."""
  low = jax.lax.select(wraps(param, correction), jnp.zeros_like(correction), correction)
  shifted = jax.lax.shift_left(low.astype(jnp.int32), np.int32(8))
  high = jax.lax.shift_left(_bf16_bits(param), np.uint32(16))
  return _float(jax.lax.add(high, shifted.astype(U32)))


def spacing_24bit(magnitude: jax.Array) -> jax.Array:
  """Returns the distance between neighbouring 24-bit masters at a float32
  ``magnitude`` (``2**(exponent - 15)``), zero where that is below float32's
  normal range."""
  exponent = jax.lax.shift_right_logical(_bits(magnitude), np.uint32(23))
  exponent = jax.lax.bitwise_and(exponent, np.uint32(0xFF)).astype(jnp.int32)
  spacing = jax.lax.max(jax.lax.sub(exponent, np.int32(15)), np.int32(0))
  return _float(jax.lax.shift_left(spacing, np.int32(23)).astype(U32))


def landing(param: jax.Array, target: jax.Array) -> jax.Array:
  """Returns where ``optax.apply_updates(param, target - param)`` puts a
  bfloat16 ``param``: ``target`` unless the float32 update rounds (the
  exponent-gap corner in docs/concepts_masters.md)."""
  return jax.lax.convert_element_type(landing_f32(param, target), jnp.bfloat16)


def landing_f32(param: jax.Array, target: jax.Array) -> jax.Array:
  """Returns ``landing(param, target)`` exactly in float32."""
  param32 = jax.lax.convert_element_type(param, jnp.float32)
  if target.dtype != jnp.float32:
    target = jax.lax.convert_element_type(target, jnp.float32)
  update = jax.lax.sub(target, param32)
  return tree_lib.round_as(jax.lax.add(param32, update), jnp.bfloat16)


def same_bits(a: jax.Array, b: jax.Array) -> jax.Array:
  """Compares two arrays of one floating dtype bit for bit, elementwise (NaN
  and -0 included)."""
  uint = jnp.dtype(f"uint{jnp.dtype(a.dtype).itemsize * 8}")
  return jax.lax.eq(jax.lax.bitcast_convert_type(a, uint), jax.lax.bitcast_convert_type(b, uint))


def stochastic_round(value: jax.Array, random_bits: jax.Array) -> jax.Array:
  """Rounds a float32 ``value`` to bfloat16 by adding the low 16 of
  ``random_bits`` (uint32, uniform) before keeping the top half: unbiased
  where the upward neighbour is finite, else saturating (as for inf)."""
  value = canonical(value)
  bits = _bits(value)
  noise = jax.lax.bitwise_and(random_bits, np.uint32(0xFFFF))
  rounded = jax.lax.shift_right_logical(jax.lax.add(bits, noise), np.uint32(16))
  # Rounding up from the bfloat16 maximum would give inf: stay at the maximum.
  magnitude = jax.lax.bitwise_and(rounded, np.uint32(0x7FFF))
  at_inf = jax.lax.eq(magnitude, np.uint32(0x7F80))
  overflows = jax.lax.bitwise_and(jax.lax.is_finite(value), at_inf)
  return _bf16(jax.lax.select(overflows, jax.lax.shift_right_logical(bits, np.uint32(16)), rounded))


def leaf_key(seed: int, leaf: int) -> np.uint32:
  """Hashes ``seed`` and a leaf's position in the param tree into the uint32
  key of that leaf's random bits."""
  h = (seed ^ (leaf * 0x9E3779B9)) % 2**32
  # _mix in Python integers: the key is a constant of the state, not traced.
  h ^= h >> 16
  h = (h * 0x85EBCA6B) % 2**32
  h ^= h >> 13
  h = (h * 0xC2B2AE35) % 2**32
  return np.uint32(h ^ (h >> 16))


def random_bits(key: jax.Array, count: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Returns uint32 random bits for each element of a leaf of ``shape``: a
  hash of ``(key, count, global element index)``, so no host sync and the
  same bits under any sharding."""
  index = jax.lax.full(shape, 0, U32)
  stride = 1
  for axis in reversed(range(len(shape))):
    term = jax.lax.mul(jax.lax.broadcasted_iota(U32, shape, axis), np.uint32(stride % 2**32))
    index = jax.lax.add(index, term)
    stride *= shape[axis]
  step = _mix(jax.lax.add(jax.lax.mul(count.astype(U32), U32(0x85EBCA77)), U32(1)))
  key = jax.lax.broadcast(_mix(jax.lax.bitwise_xor(key.astype(U32), step)), shape)
  return _mix(jax.lax.add(jax.lax.mul(index, np.uint32(0x9E3779B9)), key))


def _mix(h: jax.Array) -> jax.Array:
  """Applies MurmurHash3's 32-bit finaliser, a bijection that mixes every
  input bit into every output bit."""
  h = jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(16)))
  h = jax.lax.mul(h, np.uint32(0x85EBCA6B))
  h = jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(13)))
  h = jax.lax.mul(h, np.uint32(0xC2B2AE35))
  return jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(16)))
