"""A 4-bit second-moment code mpx does not store, to measure: levels over each block's range.

mpx's nonnegative 4-bit code places its 15 levels at fixed fractions of each
block's largest value (``{1, 3/4} * 2**-e`` down to ``2**-5``, then powers of
two down to ``2**-9``). This code stores each block's smallest positive value
beside its largest and spreads the 15 levels evenly in the logarithm between
the two: ``level_k = low * (high / low) ** ((k - 1) / 14)`` for codes ``k =
1 .. 15``, 0 only for a value that is not positive. A block whose values lie
within a few percent of each other (a second moment of near-Gaussian
gradients) gets levels a fraction of a percent apart, where the fixed levels
are a quarter apart; a block spanning many octaves gets them wider apart.
``low`` is held at least ``high * 2**-floor_octaves`` (``2**-9``, the floor of
mpx's code), so that one tiny value does not spread the levels over the
whole float range; a positive value below it is raised to it. Between two
levels a value rounds up with probability ``log(value / below) / log(above
/ below)``, as mpx's nonnegative 4-bit code rounds (docs/moment_codes.md,
"Second moments keep their logarithm's mean").

Stored: a code per element (4 bits packed, kept here in a uint8 each) and two
float32 per block of the 4-bit layout (``moment_codes.block_layout(shape,
4)``): ``0.5 + 8 / block`` bytes an element. Used by
``benchmarks/moment_codes_4bit_error.py`` (docs/moment_codes.md, "4 bits").
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
_SALT = np.uint32(0x6C72)  # keeps these random bits apart from the first moment's


def _blocks(x: jax.Array) -> jax.Array:
  size, count = mc.block_layout(x.shape, 4)
  if size * count != x.shape[-1]:
    raise ValueError(f"blocks of {size} do not tile a last axis of {x.shape[-1]}")
  return x.reshape((*x.shape[:-1], count, size))


def _log_levels(high: jax.Array, low: jax.Array) -> tuple[jax.Array, jax.Array]:
  """log2 of each block's lowest level, and the log2 step between levels."""
  log_low = jnp.log2(jnp.maximum(low, np.float32(np.finfo(np.float32).tiny)))
  log_high = jnp.log2(jnp.maximum(high, np.float32(np.finfo(np.float32).tiny)))
  return log_low, (log_high - log_low) / (LEVELS - 1)


def encode(
  x: jax.Array, key: jax.Array, step: jax.Array, floor_octaves: int = FLOOR_OCTAVES
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Codes a non-negative float32 ``x`` (last axis tiled by the 4-bit blocks):
  returns ``(codes, high, low)``, codes in ``[0, 15]`` in ``x``'s shape."""
  blocks = _blocks(jnp.asarray(x, jnp.float32))
  positive = blocks > 0
  high = jnp.max(blocks, axis=-1)
  low = jnp.min(jnp.where(positive, blocks, jnp.inf), axis=-1)
  low = jnp.where(jnp.isfinite(low), low, high)
  low = jnp.maximum(low, high * np.float32(2.0**-floor_octaves))
  log_low, log_step = _log_levels(high, low)
  spread = log_step > 0
  position = jnp.log2(jnp.maximum(blocks, low[..., None])) - log_low[..., None]
  position = position / jnp.where(spread, log_step, 1)[..., None]
  position = jnp.clip(position, 0, LEVELS - 1)
  bits = rounding.random_bits(jnp.bitwise_xor(jnp.asarray(key, jnp.uint32), _SALT), step, x.shape)
  uniform = _blocks((bits >> 8).astype(jnp.float32) * np.float32(2.0**-24))
  index = jnp.minimum(jnp.floor(position + uniform), LEVELS - 1)
  index = jnp.where(spread[..., None], index, LEVELS - 1)  # one value: the top level
  codes = jnp.where(positive, index + 1, 0).astype(jnp.uint8)
  return codes.reshape(x.shape), high, low


def decode(stored: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
  """The float32 values that ``encode``'s ``(codes, high, low)`` stand for."""
  codes, high, low = stored
  log_low, log_step = _log_levels(high, low)
  k = _blocks(codes.astype(jnp.float32))
  values = jnp.exp2(log_low[..., None] + (k - 1) * log_step[..., None])
  return jnp.where(k > 0, values, 0).reshape(codes.shape)


def bytes_per_element(shape: tuple[int, ...]) -> float:
  """What the code would take stored: 4 bits an element, two float32 a block."""
  return 0.5 + 8 / mc.block_layout(shape, 4)[0]


def coder() -> tuple[Any, Any]:
  """``(encode, decode)`` in the form ``moment_codes_4bit_error.code`` returns."""
  return (lambda x, key, step, previous: encode(x, key, step)), decode
