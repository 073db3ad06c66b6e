"""How a float32 value becomes a bfloat16 parameter, bit by bit.

bfloat16 is the top half of float32: a float32 value's bit pattern is a
bfloat16 pattern followed by 16 more bits. That makes two things cheap that
are not for float16:

- **Exact remainders.** A float32 master is its rounded bfloat16 param plus a
  signed 16-bit remainder: ``master_bits = (param_bits << 16) + remainder``
  (``join``). The rounding rule has to be one whose every outcome the
  remainder can encode: round to nearest, ties away from zero (``param_bits =
  (master_bits + 0x8000) >> 16``), which needs a remainder in [-0x8000,
  0x7fff]. Round-to-nearest-even cannot work: it rounds some ties down, which
  would need +0x8000. So mpx uses ties-away for every bfloat16 param with a
  float32 master, whether the master is stored whole or as a remainder, and
  the two storage modes stay bitwise interchangeable.
- **Stochastic rounding.** Adding 16 uniform random bits to a float32 pattern
  before keeping its top half rounds the magnitude up with probability
  ``low_16_bits / 2**16``: the expected bfloat16 value is the float32 value.

A master beyond the largest float32 whose nearest bfloat16 is finite
(``0x7f7f7fff``, about 3.3962e38), inf included, is clipped to it, so a param
saturates at the bfloat16 maximum instead of overflowing. A NaN master stays
NaN (XLA makes only the canonical quiet NaN, whose top half is NaN too;
gradients are checked finite before they reach a master). Subnormals become
zero, as in all of XLA's float32 arithmetic on CPU and GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

U32 = jnp.uint32
# The largest float32 whose nearest bfloat16 (ties away) is finite, 0x7f7f7fff.
_LIMIT = np.array(0x7F7F7FFF, np.uint32).view(np.float32)


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, U32)


def _float(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bf16(bits16: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits16.astype(jnp.uint16), jnp.bfloat16)


def _bf16_bits(param: jax.Array) -> jax.Array:
  """A bfloat16 array's 16-bit patterns, widened to uint32."""
  return jax.lax.bitcast_convert_type(param, jnp.uint16).astype(U32)


def canonical(master: jax.Array) -> jax.Array:
  """``master`` (float32) clipped to ``[-0x7f7f7fff, 0x7f7f7fff]``, inf
  included: the largest magnitude whose bfloat16 rounding (ties away) is
  finite, so that no master rounds to an infinite param. One use of
  ``master``: it sits inside the update's fusion, and XLA materialises a
  value its fusion would have to evaluate more than 15 times."""
  return jax.lax.clamp(-_LIMIT, master, _LIMIT)


def round_ties_away(master: jax.Array) -> jax.Array:
  """The bfloat16 nearest a canonical float32 ``master``, ties away from zero."""
  return _bf16(_shift_right(jax.lax.add(_bits(master), np.uint32(0x8000)), 16))


def round_ties_away_f32(master: jax.Array) -> jax.Array:
  """``round_ties_away(master)`` as the float32 that holds it exactly: the
  top half of ``master_bits + 0x8000``, the low half zeroed. Where the
  result is used in float32 (an update, a landing), this saves the round
  trip through bfloat16: fewer ops per leaf for XLA to compile."""
  top = jax.lax.bitwise_and(jax.lax.add(_bits(master), np.uint32(0x8000)), np.uint32(0xFFFF0000))
  return _float(top)


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A canonical float32 ``master`` as ``(param, remainder)``: its bfloat16
  rounding (ties away) and the int16 that ``join`` adds back."""
  param = round_ties_away(master)
  low = jax.lax.sub(_bits(master), _shift_left(_bf16_bits(param), 16))
  remainder = jax.lax.bitcast_convert_type(low.astype(jnp.uint16), jnp.int16)
  return param, remainder


def remainder(master: jax.Array) -> jax.Array:
  """``split(master)[1]``, without making the bfloat16 param: the low half of
  ``master_bits - round_ties_away_f32(master)_bits``, as an int16."""
  low = jax.lax.sub(_bits(master), _bits(round_ties_away_f32(master)))
  return jax.lax.bitcast_convert_type(low.astype(jnp.uint16), jnp.int16)


def join(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """The float32 master of a bfloat16 ``param`` and its int16 ``remainder``:
  ``(param_bits << 16) + remainder``. Exact for every pair ``split`` made.

  ``split`` never pairs a zero param with a negative remainder; such a pair
  (a param set to zero outside the optimizer) joins as if the remainder were
  0, where the sum would wrap into a NaN pattern."""
  low = jax.lax.select(wraps(param, remainder), jnp.zeros_like(remainder), remainder)
  high = _shift_left(_bf16_bits(param), 16)
  return _float(jax.lax.add(high, low.astype(jnp.int32).astype(U32)))


def wraps(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """Where ``(param_bits << 16) + remainder`` would wrap: a zero param (either
  sign) with a negative remainder."""
  magnitude = jax.lax.bitwise_and(_bf16_bits(param), np.uint32(0x7FFF))
  is_zero = jax.lax.eq(magnitude, np.uint32(0))
  return jax.lax.bitwise_and(is_zero, jax.lax.lt(remainder, jnp.zeros_like(remainder)))


def landing(param: jax.Array, target: jax.Array) -> jax.Array:
  """Where ``optax.apply_updates(param, target - param)`` puts a bfloat16
  ``param`` (the update in float32): ``target`` itself unless the two are so
  far apart in magnitude (more than 2**16) that ``target - param`` rounds in
  float32. Applied to what it returns, the same update lands exactly."""
  f32 = lambda x: jax.lax.convert_element_type(x, jnp.float32)  # noqa: E731
  param32 = f32(param)
  update = jax.lax.sub(target if target.dtype == jnp.float32 else f32(target), param32)
  return jax.lax.convert_element_type(jax.lax.add(param32, update), jnp.bfloat16)


def landing_f32(param: jax.Array, target: jax.Array) -> jax.Array:
  """``landing(param, target)`` in float32 (exactly), for a float32
  ``target`` that holds a bfloat16 value."""
  return jax.lax.convert_element_type(landing(param, target), jnp.float32)


def same_bits(a: jax.Array, b: jax.Array) -> jax.Array:
  """Elementwise bitwise equality of two arrays of one floating dtype (NaN,
  -0 included)."""
  uint = jnp.dtype(f"uint{jnp.dtype(a.dtype).itemsize * 8}")
  as_bits = lambda x: jax.lax.bitcast_convert_type(x, uint)  # noqa: E731
  return jax.lax.eq(as_bits(a), as_bits(b))


def stochastic_round(value: jax.Array, random_bits: jax.Array) -> jax.Array:
  """``value`` (float32) rounded to bfloat16 up or down at random: up in
  magnitude with probability ``(value's low 16 bits) / 2**16``, using the low
  16 of ``random_bits`` (uint32, uniform). Unbiased for every finite value
  whose upward neighbour is finite; beyond that it saturates at the bfloat16
  maximum, as it does for inf (see ``canonical``)."""
  value = canonical(value)
  bits = _bits(value)
  noise = jax.lax.bitwise_and(random_bits, np.uint32(0xFFFF))
  rounded = _shift_right(jax.lax.add(bits, noise), 16)
  # Rounding up from the bfloat16 maximum would give inf: stay at the maximum.
  magnitude = jax.lax.bitwise_and(rounded, np.uint32(0x7FFF))
  at_inf = jax.lax.eq(magnitude, np.uint32(0x7F80))
  overflows = jax.lax.bitwise_and(jax.lax.is_finite(value), at_inf)
  return _bf16(jax.lax.select(overflows, _shift_right(bits, 16), rounded))


def _shift_right(bits: jax.Array, by: int) -> jax.Array:
  return jax.lax.shift_right_logical(bits, np.uint32(by))


def _shift_left(bits: jax.Array, by: int) -> jax.Array:
  return jax.lax.shift_left(bits, np.uint32(by))


def leaf_key(seed: int, leaf: int) -> np.uint32:
  """The uint32 key of one leaf's stream of random bits: a hash of ``seed``
  and the leaf's position in the param tree."""
  h = (seed ^ (leaf * 0x9E3779B9)) % 2**32
  # _mix in Python integers: the key is a constant of the state, not traced.
  h ^= h >> 16
  h = (h * 0x85EBCA6B) % 2**32
  h ^= h >> 13
  h = (h * 0xC2B2AE35) % 2**32
  return np.uint32(h ^ (h >> 16))


def random_bits(key: jax.Array, count: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """uint32 random bits for every element of a leaf of ``shape``.

  A counter-based hash of ``(key, count, element index)``: no state beyond
  ``count``, no host sync, and the element index is the global one, so under
  GSPMD every device draws the bits of its own elements and the result is the
  same under any sharding.
  """
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
  """MurmurHash3's 32-bit finaliser: a bijection that mixes every input bit
  into every output bit."""
  h = jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(16)))
  h = jax.lax.mul(h, np.uint32(0x85EBCA6B))
  h = jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(13)))
  h = jax.lax.mul(h, np.uint32(0xC2B2AE35))
  return jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(16)))
