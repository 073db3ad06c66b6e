"""Bit operations between float32 masters and bfloat16 params: ties-away
rounding, remainders, saturation and stochastic rounding."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import tree as tree_lib

U32 = jnp.uint32
# The largest float32 whose nearest bfloat16 (ties away) is finite, 0x7f7f7fff.
LIMIT = np.array(0x7F7F7FFF, np.uint32).view(np.float32)
# The largest 24-bit master (a float32 with its low 8 bits zero) below LIMIT.
_LIMIT_24 = np.array(0x7F7F7F00, np.uint32).view(np.float32)
# A float32's 32 bits as a uint32, and back: one bitcast each.
to_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=U32)
from_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)


def canonical(master: jax.Array) -> jax.Array:
  """Clips a float32 ``master`` (inf included) to the largest magnitude whose
  bfloat16 rounding is finite. It reads ``master`` once, so that XLA keeps the
  clip inside the update's fusion instead of materialising ``master``."""
  return jax.lax.clamp(-LIMIT, master, LIMIT)


def round_ties_away(master: jax.Array) -> jax.Array:
  """Rounds a canonical float32 ``master`` to the nearest bfloat16, ties away."""
  top = jax.lax.shift_right_logical(jax.lax.add(to_bits(master), np.uint32(0x8000)), np.uint32(16))
  return jax.lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


def round_ties_away_f32(master: jax.Array) -> jax.Array:
  """Returns ``round_ties_away(master)`` as the float32 that holds it exactly
  (half an ulp added, the low 16 bits cleared), saving the round trip through
  bfloat16 where the result is used in float32."""
  top = jax.lax.bitwise_and(jax.lax.add(to_bits(master), np.uint32(0x8000)), np.uint32(0xFFFF0000))
  return from_bits(top)


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits a canonical float32 ``master`` into ``(param, remainder)``: its
  bfloat16 rounding (ties away) and the int16 that ``storage.Remainder.view``
  adds back."""
  return round_ties_away(master), remainder(master)


def remainder(master: jax.Array) -> jax.Array:
  """Returns ``split(master)[1]`` without making the bfloat16 param: the bits
  of ``master`` less those of its rounding (ties away), held in float32."""
  # The rounding is made as the float32 that holds it (as the param update
  # makes it) and read back as bits.
  low = jax.lax.sub(to_bits(master), to_bits(round_ties_away_f32(master)))
  # In int16's range already; the clamp keeps XLA:GPU (jax 0.11.2) from
  # computing a truncating convert of a computed float's bits as a
  # float-to-int conversion (zero for |x| < 1), which it did in some fusions.
  low = jax.lax.bitcast_convert_type(low, jnp.int32)
  return jax.lax.clamp(np.int32(-(2**15)), low, np.int32(2**15 - 1)).astype(jnp.int16)


def wraps(param: jax.Array, low: jax.Array) -> jax.Array:
  """Marks where ``(param_bits << 16) + low`` would wrap into a NaN pattern:
  a zero param (a param zeroed outside the optimizer) under a negative
  remainder or correction ``low``, which ``split`` never makes."""
  param_bits = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(U32)
  is_zero = jax.lax.eq(jax.lax.bitwise_and(param_bits, np.uint32(0x7FFF)), np.uint32(0))
  return jax.lax.bitwise_and(is_zero, jax.lax.lt(low, jnp.zeros_like(low)))


def round_to_24bit(master: jax.Array) -> jax.Array:
  """Rounds a float32 ``master`` to the nearest 24-bit master (ties away): a
  float32 whose low 8 bits are zero, saturating where its bfloat16 rounding
  would not be finite."""
  bits = to_bits(jax.lax.clamp(-_LIMIT_24, master, _LIMIT_24))
  return from_bits(jax.lax.bitwise_and(jax.lax.add(bits, np.uint32(0x80)), np.uint32(0xFFFFFF00)))


def nearest_correction(master: jax.Array) -> jax.Array:
  """Returns the int8 correction (the remainder's top 8 bits) of the 24-bit
  master nearest to a canonical float32 ``master`` among those whose bfloat16
  rounding is ``master``'s own (``round_to_24bit`` first can cross a tie and
  change that rounding)."""
  remainder16 = remainder(master).astype(jnp.int32)
  nearest = jax.lax.shift_right_arithmetic(jax.lax.add(remainder16, np.int32(0x80)), np.int32(8))
  return jax.lax.clamp(np.int32(-128), nearest, np.int32(127)).astype(jnp.int8)


def spacing_24bit(magnitude: jax.Array) -> jax.Array:
  """Returns the distance between neighbouring 24-bit masters at a float32
  ``magnitude`` (``2**(exponent - 15)``), zero where that is below float32's
  normal range."""
  exponent = jax.lax.shift_right_logical(to_bits(magnitude), np.uint32(23))
  exponent = jax.lax.bitwise_and(exponent, np.uint32(0xFF)).astype(jnp.int32)
  spacing = jax.lax.max(jax.lax.sub(exponent, np.int32(15)), np.int32(0))
  return from_bits(jax.lax.shift_left(spacing, np.int32(23)).astype(U32))


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
  bits = to_bits(value)
  noise = jax.lax.bitwise_and(random_bits, np.uint32(0xFFFF))
  rounded = jax.lax.shift_right_logical(jax.lax.add(bits, noise), np.uint32(16))
  # Rounding up from the bfloat16 maximum would give inf: stay at the maximum.
  magnitude = jax.lax.bitwise_and(rounded, np.uint32(0x7FFF))
  at_inf = jax.lax.eq(magnitude, np.uint32(0x7F80))
  overflows = jax.lax.bitwise_and(jax.lax.is_finite(value), at_inf)
  top = jax.lax.select(overflows, jax.lax.shift_right_logical(bits, np.uint32(16)), rounded)
  return jax.lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


def leaf_key(seed: int, leaf: int) -> np.uint32:
  """Hashes ``seed`` and a leaf's position in the param tree into the uint32
  key of that leaf's random bits."""
  h = (seed ^ (leaf * 0x9E3779B9)) % 2**32
  # MurmurHash3's finaliser (as in random_bits) in Python integers: the key is
  # a constant of the state, not traced.
  h ^= h >> 16
  h = (h * 0x85EBCA6B) % 2**32
  h ^= h >> 13
  h = (h * 0xC2B2AE35) % 2**32
  return np.uint32(h ^ (h >> 16))


# The extra argument ``mpx.scan_layers`` passes its rule: which layer of the
# stack the params are (an int32 scalar).
STACKED_LAYER = "stacked_layer"


class StackedCount(NamedTuple):
  """The count of applied steps of a leaf that is layer ``layer`` of a leaf
  stacked along a leading axis (``mpx.scan_layers``): :func:`random_bits`
  draws it the bits the stacked leaf draws for that layer's elements."""

  steps: jax.Array
  layer: jax.Array


def random_bits(
  key: jax.Array, count: jax.Array | StackedCount, shape: tuple[int, ...]
) -> jax.Array:
  """Returns uint32 random bits for each element of a leaf of ``shape``: a
  hash of ``(key, count, global element index)``, so no host sync and the
  same bits under any sharding."""
  # The flat index, reshaped: summed from an iota per axis, its row-index
  # vectors were shared by XLA:GPU between same-shaped leaves, fusing their
  # rounding into kernels that wait for every such leaf's inputs.
  size = int(np.prod(shape, dtype=np.int64))
  index = jax.lax.broadcasted_iota(U32, (size,), 0)
  if isinstance(count, StackedCount):  # the stacked leaf's index (uint32: it wraps alike)
    offset = jax.lax.mul(count.layer.astype(U32), U32(size % 2**32))
    index = jax.lax.add(index, jax.lax.broadcast(offset, (size,)))
    count = count.steps
  index = index.reshape(shape)
  # Three rounds of MurmurHash3's 32-bit finaliser, a bijection that mixes
  # every input bit into every output bit: of the count, of the key xor that
  # hash, and of each element's index plus the key's hash.
  h = jax.lax.add(jax.lax.mul(count.astype(U32), U32(0x85EBCA77)), U32(1))
  for hashed in ("count", "key", "element"):
    h = jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(16)))
    h = jax.lax.mul(h, np.uint32(0x85EBCA6B))
    h = jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(13)))
    h = jax.lax.mul(h, np.uint32(0xC2B2AE35))
    h = jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(16)))
    if hashed == "count":  # the next round hashes the key with the count's hash
      h = jax.lax.bitwise_xor(key.astype(U32), h)
    elif hashed == "key":  # the last, each element's index with the key's hash
      h = jax.lax.broadcast(h, shape)
      h = jax.lax.add(jax.lax.mul(index, np.uint32(0x9E3779B9)), h)
  return h
