"""A 4-bit second-moment code mpx does not store, to measure: levels over each block's range.

mpx's nonnegative 4-bit code places its 15 levels at fixed fractions of each
block's largest value (``{1, 3/4} * 2**-e`` down to ``2**-5``, then powers of
two down to ``2**-9``). This code spreads them evenly in the logarithm
between the block's smallest positive value and its largest: ``level_k =
low * (high / low) ** ((k - 1) / 14)`` for codes ``k = 1 .. 15``, 0 only for
a value that is not positive. A block whose values lie within a few percent
of each other (a second moment of near-Gaussian gradients) gets levels a
fraction of a percent apart, where the fixed levels are a quarter apart; a
block spanning many octaves gets them wider apart. ``low`` is held at least
``high * 2**-9`` (the floor of mpx's code), so that one tiny value does not
spread the levels over the whole float range; a positive value below it is
raised to it. Between two levels a value rounds up with probability
``log(value / below) / log(above / below)``, as mpx's nonnegative 4-bit code
rounds (docs/moment_codes.md, "Second moments keep their logarithm's mean").

Stored in mpx's 4-bit bytes: a code per element (4 bits packed, kept here in
a uint8 each) and one float32 word per block (``block_layout(shape, 4)``)
holding both ends: ``high`` rounded up to 11 mantissa bits, the range
``log2(high / low)`` rounded up to 1/256 of an octave in the low 12 bits,
and the sign bit set, which tells the word from the block maximum that mpx's
code stores there (so that a state saved before could still be decoded).
Coarser ranges cost fidelity: at 1/8 of an octave the levels jump as the
range crosses a step, and every value in the block rounds afresh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import moment_codes as mc
from mpx._src import rounding

LEVELS = 15
FLOOR_OCTAVES = 9
RANGE_STEPS = 256  # a word's range in 1/256 octave, in its low 12 bits
_RANGE_BITS = np.uint32(0xFFF)
_HIGH_BITS = np.uint32(0x7FFFF000)
_MARK = np.uint32(0x80000000)
_SALT = np.uint32(0x6C72)  # keeps these random bits apart from the first moment's


def _blocks(x: jax.Array) -> jax.Array:
  size, count = mc.block_layout(x.shape, 4)
  if size * count != x.shape[-1]:
    raise ValueError(f"blocks of {size} do not tile a last axis of {x.shape[-1]}")
  return x.reshape((*x.shape[:-1], count, size))


def unpack(words: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each block's ``high``, and log2 of its lowest level and of the step
  between levels, from its stored word."""
  bits = jax.lax.bitcast_convert_type(words, jnp.uint32)
  high = jax.lax.bitcast_convert_type(bits & _HIGH_BITS, jnp.float32)
  octaves = (bits & _RANGE_BITS).astype(jnp.float32) / RANGE_STEPS
  return high, jnp.log2(high) - octaves, octaves / (LEVELS - 1)


def encode(x: jax.Array, key: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Codes a non-negative float32 ``x`` (last axis tiled by the 4-bit blocks):
  returns ``(codes, words)``, codes in ``[0, 15]`` in ``x``'s shape, a
  float32 word per block."""
  blocks = _blocks(jnp.asarray(x, jnp.float32))
  positive = blocks > 0
  high = jnp.max(blocks, axis=-1)
  low = jnp.min(jnp.where(positive, blocks, jnp.inf), axis=-1)
  low = jnp.where(jnp.isfinite(low), low, high)
  low = jnp.maximum(low, high * np.float32(2.0**-FLOOR_OCTAVES))
  # high rounded up to 11 mantissa bits (at most the largest finite such float)
  bits = jax.lax.bitcast_convert_type(high, jnp.uint32)
  bits = jnp.minimum((bits + _RANGE_BITS) & ~_RANGE_BITS, np.uint32(0x7F7FF000))
  high = jax.lax.bitcast_convert_type(bits, jnp.float32)
  octaves = jnp.where(high > 0, jnp.log2(high) - jnp.log2(jnp.where(low > 0, low, high)), 0)
  steps = jnp.clip(jnp.ceil(octaves * RANGE_STEPS), 0, FLOOR_OCTAVES * RANGE_STEPS)
  words = jax.lax.bitcast_convert_type(bits | steps.astype(jnp.uint32) | _MARK, jnp.float32)
  _, log_low, log_step = unpack(words)
  spread = log_step > 0
  position = jnp.log2(jnp.maximum(blocks, np.float32(np.finfo(np.float32).tiny)))
  position = (position - log_low[..., None]) / jnp.where(spread, log_step, 1)[..., None]
  position = jnp.clip(position, 0, LEVELS - 1)
  bits = rounding.random_bits(jnp.bitwise_xor(jnp.asarray(key, jnp.uint32), _SALT), step, x.shape)
  uniform = _blocks((bits >> 8).astype(jnp.float32) * np.float32(2.0**-24))
  index = jnp.minimum(jnp.floor(position + uniform), LEVELS - 1)
  index = jnp.where(spread[..., None], index, LEVELS - 1)  # one value: the top level
  codes = jnp.where(positive, index + 1, 0).astype(jnp.uint8)
  return codes.reshape(x.shape), words


def decode(stored: tuple[jax.Array, jax.Array]) -> jax.Array:
  """The float32 values that ``encode``'s ``(codes, words)`` stand for."""
  codes, words = stored
  _, log_low, log_step = unpack(words)
  k = _blocks(codes.astype(jnp.float32))
  values = jnp.exp2(log_low[..., None] + (k - 1) * log_step[..., None])
  return jnp.where(k > 0, values, 0).reshape(codes.shape)


def bytes_per_element(shape: tuple[int, ...]) -> float:
  """What the code would take stored: 4 bits an element, a float32 a block."""
  return 0.5 + 4 / mc.block_layout(shape, 4)[0]


def coder() -> tuple[Any, Any]:
  """``(encode, decode)`` in the form ``moment_codes_4bit_error.code`` returns."""
  return (lambda x, key, step, previous: encode(x, key, step)), decode
