"""A 4-bit second-moment code mpx does not store, to measure: levels over each block's range.

mpx's nonnegative 4-bit code places its 15 levels at fixed fractions of each
block's largest value (``{1, 3/4} * 2**-e`` down to ``2**-5``, then powers of
two down to ``2**-9``). This code spreads them between the block's smallest
positive value and its largest, evenly in their float32 bits: ``bits(level_k)
= bits(low) + (k - 1) / 14 * (bits(high) - bits(low))`` for codes ``k = 1 ..
15``, 0 only for a value that is not positive. A positive float's bits are a
piecewise-linear logarithm (an octave is ``2**23``), so the levels are nearly
even in the logarithm, and coding and decoding are integer arithmetic with no
``log2`` or ``exp2``, which in one kernel would tip XLA:GPU into writing the
moment out. A block whose values lie within a few percent of each other (a
second moment of near-Gaussian gradients) gets levels a fraction of a percent
apart, where the fixed levels are a quarter apart; a block spanning many
octaves gets them wider apart. ``low`` is held at least ``high * 2**-9`` (the
floor of mpx's code), so that one tiny value does not spread the levels over
the whole float range; a positive value below it is raised to it. Between
two levels a value rounds up with probability ``(bits(value) - bits(below)) /
(bits(above) - bits(below))``: unbiased in the bits, so nearly in the
logarithm, as mpx's nonnegative 4-bit code rounds (docs/moment_codes.md,
"Second moments keep their logarithm's mean").

Stored in mpx's 4-bit bytes: a code per element (4 bits packed, kept here in
a uint8 each) and one float32 word per block (``block_layout(shape, 4)``)
holding both ends: ``high`` rounded up to 11 mantissa bits, the range
``bits(high) - bits(low)`` rounded up to 1/256 of an octave (``2**15``) in the
low 12 bits, and the sign bit set, which tells the word from the block maximum
that mpx's code stores there (so that a state saved before could still be
decoded). Coarser ranges cost fidelity: at 1/8 of an octave the levels jump
as the range crosses a step, and every value in the block rounds afresh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import moment_codes as mc
from mpx._src import rounding

LEVELS = 15
RANGE_STEP = 1 << 15  # a word's range in 1/256 octave of float32 bits, in its low 12 bits
MAX_RANGE = 9 * 256  # 2**-9, the floor
_RANGE_BITS = np.int32(0xFFF)
_HIGH_BITS = np.int32(0x7FFFF000)
_MARK = np.uint32(0x80000000)
_SALT = np.uint32(0x6C72)  # keeps these random bits apart from the first moment's


def _blocks(x: jax.Array) -> jax.Array:
  size, count = mc.block_layout(x.shape, 4)
  if size * count != x.shape[-1]:
    raise ValueError(f"blocks of {size} do not tile a last axis of {x.shape[-1]}")
  return x.reshape((*x.shape[:-1], count, size))


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def unpack(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each block's lowest level's bits and the bits between levels (float32),
  from its stored word."""
  bits = _bits(words)  # the mark, the sign bit, is outside both fields
  span = (bits & _RANGE_BITS) * RANGE_STEP
  return (bits & _HIGH_BITS) - span, span.astype(jnp.float32) / (LEVELS - 1)


def encode(x: jax.Array, key: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Codes a non-negative float32 ``x`` (last axis tiled by the 4-bit blocks):
  returns ``(codes, words)``, codes in ``[0, 15]`` in ``x``'s shape, a
  float32 word per block."""
  blocks = _blocks(jnp.asarray(x, jnp.float32))
  positive = blocks > 0
  high = jnp.max(blocks, axis=-1)
  low = jnp.min(jnp.where(positive, blocks, jnp.inf), axis=-1)
  low = jnp.where(jnp.isfinite(low), low, high)
  # high rounded up to 11 mantissa bits (at most the largest finite such float)
  top = jnp.minimum((_bits(high) + _RANGE_BITS) & _HIGH_BITS, np.int32(0x7F7FF000))
  span = jnp.clip(-(-(top - _bits(low)) // RANGE_STEP), 0, MAX_RANGE)
  words = (top | span).astype(jnp.uint32) | _MARK
  words = jax.lax.bitcast_convert_type(words, jnp.float32)
  base, level_step = unpack(words)
  spread = level_step > 0
  position = (_bits(blocks) - base[..., None]).astype(jnp.float32)
  position = jnp.clip(position / jnp.where(spread, level_step, 1)[..., None], 0, LEVELS - 1)
  bits = rounding.random_bits(jnp.bitwise_xor(jnp.asarray(key, jnp.uint32), _SALT), step, x.shape)
  uniform = _blocks((bits >> 8).astype(jnp.float32) * np.float32(2.0**-24))
  index = jnp.minimum(jnp.floor(position + uniform), LEVELS - 1)
  index = jnp.where(spread[..., None], index, LEVELS - 1)  # one value: the top level
  codes = jnp.where(positive, index + 1, 0).astype(jnp.uint8)
  return codes.reshape(x.shape), words


def decode(stored: tuple[jax.Array, jax.Array]) -> jax.Array:
  """The float32 values that ``encode``'s ``(codes, words)`` stand for."""
  codes, words = stored
  base, level_step = unpack(words)
  k = _blocks(codes.astype(jnp.float32))
  bits = base[..., None] + jnp.round((k - 1) * level_step[..., None]).astype(jnp.int32)
  values = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return jnp.where(k > 0, values, 0).reshape(codes.shape)


def bytes_per_element(shape: tuple[int, ...]) -> float:
  """What the code would take stored: 4 bits an element, a float32 a block."""
  return 0.5 + 4 / mc.block_layout(shape, 4)[0]


def coder() -> tuple[Any, Any]:
  """``(encode, decode)`` in the form ``moment_codes_4bit_error.code`` returns."""
  return (lambda x, key, step, previous: encode(x, key, step)), decode
