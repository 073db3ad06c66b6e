"""The moment codes' block core, shared with the 4-bit codes, and the bfloat16
and 8-bit codes (docs/moment_codes.md)."""

from __future__ import annotations

from typing import Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import compat, rounding
from mpx._src.states import (
  Nonnegative4bitMoment,
  Nonnegative8bitMoment,
  Signed4bitMoment,
  Signed8bitMoment,
)

# A moment's sign: "signed" (a first moment, any sign) or "nonnegative" (a
# second moment, which never decodes to zero).
Sign = Literal["signed", "nonnegative"]
SIGNS: tuple[Sign, ...] = ("signed", "nonnegative")
EightBitMoment: TypeAlias = Signed8bitMoment | Nonnegative8bitMoment
# The stored type of each sign's code.
STORED_TYPES: dict[Sign, type[EightBitMoment]] = {
  "signed": Signed8bitMoment,
  "nonnegative": Nonnegative8bitMoment,
}

# Blocks hold at most this many elements; ``block_layout`` prefers one in
# (MAX_BLOCK / 2, MAX_BLOCK] and accepts one down to MIN_BLOCK that divides.
MAX_BLOCK = 256
MIN_BLOCK = 32

_ONE_BITS = 0x3F800000  # bits of float32 1.0
_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32
# Salts xored into the caller's key: independent bits per format and sign.
_SALTS = {
  "bfloat16": 0x6A09E667,
  "signed": 0xBB67AE85,
  "nonnegative": 0x3C6EF372,
  "4bit signed": 0xA54FF53A,
  "4bit nonnegative": 0x510E527F,
}


# --- The block core: what the 8- and 4-bit codes share ---------------------------


def _fit_blocks(n: int, max_block: int, sizes: tuple[range, ...]) -> tuple[int, int]:
  """Returns ``(block_size, n_blocks)`` for ``n > max_block`` elements: the size
  in the first of ``sizes`` with divisors of ``n`` that leaves the block count
  with the most factors of two, then the largest; with none, about ``ceil(n /
  max_block)`` blocks of ``ceil(n / blocks)`` rounded up to a multiple of the
  sizes' step (4 bits: even), the last one short."""
  for candidates in sizes:
    # (the block count's lowest set bit, the size): the largest wins.
    best = max((((n // d) & -(n // d), d) for d in candidates if n % d == 0), default=None)
    if best:
      return best[1], n // best[1]
  blocks = -(-n // max_block)
  size = -(-n // blocks)
  size += -size % sizes[0].step
  return size, -(-n // size)


def _blocked(x: jax.Array, size: int, blocks: int) -> jax.Array:
  """Cuts ``x``'s last axis into ``(blocks, size)``, zero-padding the last block
  where they do not tile."""
  pad = size * blocks - x.shape[-1]
  if pad:
    x = jax.lax.pad(x, np.zeros((), x.dtype), [(0, 0, 0)] * (x.ndim - 1) + [(0, pad, 0)])
  return x.reshape((*x.shape[:-1], blocks, size))


def _unblocked(wide: jax.Array, n: int) -> jax.Array:
  """Merges the last two axes of ``wide`` and drops the padding past ``n``."""
  wide = wide.reshape((*wide.shape[:-2], wide.shape[-2] * wide.shape[-1]))
  return jax.lax.slice_in_dim(wide, 0, n, axis=wide.ndim - 1) if wide.shape[-1] != n else wide


def _block_max(x: jax.Array, axes: tuple[int, ...], signed: bool) -> jax.Array:
  """Returns the largest magnitude (signed) or value (nonnegative) over ``axes``,
  at least 0, as one two-result reduction, which XLA:CPU fuses the moment's
  computation into (docs/moment_codes.md)."""
  zero = np.float32(0)
  second = jax.lax.min if signed else jax.lax.max

  def reducer(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
  ) -> tuple[jax.Array, jax.Array]:
    return jax.lax.max(a[0], b[0]), second(a[1], b[1])

  largest, other = jax.lax.reduce((x, x), (zero, zero), reducer, axes)
  return jax.lax.max(largest, jax.lax.neg(other) if signed else other)


def _salted(key: jax.Array, salt: str) -> jax.Array:
  """Xors the salt of a format and sign (``_SALTS``) into ``key``."""
  return jax.lax.bitwise_xor(jnp.asarray(key).astype(jnp.uint32), np.uint32(_SALTS[salt]))


def _int32_bits(x: jax.Array) -> jax.Array:
  """Reinterprets float32 ``x`` as int32 bit patterns."""
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def _check_sign(sign: str) -> None:
  """Refuses a sign other than those in :data:`SIGNS`."""
  if sign not in SIGNS:
    raise ValueError(f"sign must be one of {SIGNS}, got {sign!r}")


def sign_of(stored: EightBitMoment | Signed4bitMoment | Nonnegative4bitMoment) -> Sign:
  """Returns the sign whose code ``stored`` (8- or 4-bit) holds."""
  if isinstance(stored, Signed8bitMoment | Signed4bitMoment):
    return "signed"
  if isinstance(stored, Nonnegative8bitMoment | Nonnegative4bitMoment):
    return "nonnegative"
  raise ValueError(
    f"expected a Signed8bitMoment or a Nonnegative8bitMoment (or a 4-bit one), got "
    f"{type(stored).__name__}"
  )


# --- The 8-bit code ------------------------------------------------------------------


class _Code(NamedTuple):
  """A float-like code of magnitudes in [0, 1] (docs/moment_codes.md): ``(low_bits,
  low_code, shift)`` per region of levels, from the top, as :func:`_float_code`
  lays them out. Region ``r`` codes float32 ``bits`` in ``[low_bits, next
  region's low_bits)`` as ``low_code + ((bits - low_bits) >> shift)``."""

  signed: bool
  layout: tuple[tuple[int, int, int], ...]


def _float_code(signed: bool, regions: tuple[tuple[int, int], ...]) -> _Code:
  """Lays out the 127 (signed) or 255 nonzero levels counted down from 1.0 over
  ``regions`` of ``(octaves, mantissa bits)``, the last taking the levels left."""
  upper_bits, upper_code = _ONE_BITS, 127 if signed else 255
  layout = []
  for i, (octaves, mantissa) in enumerate(regions):
    shift = 23 - mantissa
    n_levels = upper_code - 1 if i == len(regions) - 1 else octaves << mantissa
    upper_bits, upper_code = upper_bits - (n_levels << shift), upper_code - n_levels
    layout.append((upper_bits, upper_code, shift))
  if upper_code != 1 or upper_bits <= 0x00800000:
    raise ValueError(f"regions {regions} leave no room for {127 if signed else 255} levels")
  return _Code(signed, tuple(layout))


# More levels near the block's largest, where most elements of a moment sit;
# 8 per octave below for the range (docs/moment_codes.md).
CODES: dict[Sign, _Code] = {
  "signed": _float_code(True, ((3, 4), (0, 3))),  # 48 + 79 levels, down to 2**-12.68
  "nonnegative": _float_code(False, ((1, 6), (2, 4), (0, 3))),  # 64 + 32 + 159, to 2**-22.68
}


def block_layout(shape: tuple[int, ...]) -> tuple[int, int]:
  """Returns ``(block_size, n_blocks)`` of a leaf of ``shape``, blocks along its
  last axis (a scalar is one row of one element).

  A last axis of at most ``MAX_BLOCK`` is one block. A longer one takes the
  divisor in (128, 256] (else in [32, 128]) that leaves the block count with
  the most factors of two, then the largest: 4096 gives 16 blocks of 256, 768
  gives 4 of 192, 11008 gives 64 of 172, 32000 gives 128 of 250, so sharding
  the axis 2, 4, 8... ways (up to the block count) splits it on block
  boundaries. With no such divisor (50257, 4097) the axis is cut into
  ``ceil(n / 256)`` blocks of ``ceil(n / n_blocks)``, the last one short.
  """
  n = shape[-1] if shape else 1
  if n <= MAX_BLOCK:
    return n, 1
  sizes = (range(MAX_BLOCK // 2 + 1, MAX_BLOCK + 1), range(MIN_BLOCK, MAX_BLOCK // 2 + 1))
  return _fit_blocks(n, MAX_BLOCK, sizes)


def _expand(scales: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Broadcasts each block's scale to its elements, in the leaf's ``shape``, so
  that a kernel rewriting the codes reads the old ones where it writes."""
  size, blocks = block_layout(shape)
  lead = shape[:-1] if shape else ()
  wide = jax.lax.broadcast_in_dim(scales, (*lead, blocks, size), range(len(lead) + 1))
  return _unblocked(wide, shape[-1] if shape else 1).reshape(shape)


def encode(
  x: jax.Array,
  sign: Sign,
  key: jax.Array,
  step: jax.Array,
  scales: jax.Array | None = None,
) -> EightBitMoment:
  """Codes ``x`` (float32) in 8 bits per element and a float32 scale per block.

  Args:
    x: the moment leaf, float32, finite; under ``"nonnegative"``, negative
      values code as zero.
    sign: ``"signed"`` or ``"nonnegative"``: which code.
    key: uint32 scalar, the leaf's key for random bits.
    step: int32 scalar, the step the random bits are drawn for; it must change
      every time the leaf is encoded anew (mpx passes the count of applied
      steps).
    scales: optional, float32 ``(*shape[:-1], n_blocks)``, the scales to code
      against, as :func:`maxima` returns them (a first pass); by default
      ``maxima(x, sign)``. An element larger than its block's scale codes to
      the top level: it decodes to the scale.

  Returns:
    A ``Signed8bitMoment`` or ``Nonnegative8bitMoment`` (``STORED_TYPES[sign]``);
    :func:`decode` turns it back into float32.
  """
  _check_sign(sign)
  if scales is not None:
    x = jnp.asarray(x, jnp.float32)
    expected = (*x.shape[:-1], block_layout(x.shape)[1]) if x.ndim else (1,)
    scales = jnp.asarray(scales, jnp.float32)
    if scales.shape != expected:
      raise ValueError(f"scales of shape {scales.shape}, expected {expected}")
  codes, scales = _encode(sign, x, _salted(key, sign), step, scales)
  return STORED_TYPES[sign](codes, scales)


def maxima(x: jax.Array, sign: Sign) -> jax.Array:
  """Returns the scales :func:`encode` computes for ``x`` (each block's largest
  magnitude, signed; its largest value, at least 0, nonnegative), as its
  ``scales=`` argument takes them."""
  _check_sign(sign)
  x = jnp.asarray(x, jnp.float32)
  rows = _blocked(x.reshape((1,)) if x.ndim == 0 else x, *block_layout(x.shape))
  return _block_max(rows, (rows.ndim - 1,), sign == "signed")


def _region_values(x: jax.Array, bounds: list[int], values: list[int]) -> jax.Array:
  """Maps each int32 element of ``x`` to ``values[r]`` of the first region ``r``
  whose lower bound ``bounds[r]`` (descending) it reaches, else ``values[-1]``."""
  # full_like, not full: under explicit sharding it takes x's sharding.
  out = jnp.full_like(x, values[-1], jnp.int32)
  for bound, value in zip(reversed(bounds), reversed(values[:-1]), strict=True):
    inside = jax.lax.ge(x, np.int32(bound))
    out = jax.lax.select(inside, jnp.full_like(x, value, jnp.int32), out)
  return out


def _encode(
  sign: Sign,
  x: jax.Array,
  key: jax.Array,
  step: jax.Array,
  given: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Returns ``(codes, scales)`` of ``x`` in the code of ``sign``, with an
  already salted ``key``, against the ``given`` scales (None: ``x``'s block
  maxima)."""
  code = CODES[sign]
  x = jnp.asarray(x, jnp.float32)
  shape = x.shape
  zero = np.float32(0)
  scales = maxima(x, sign) if given is None else given
  if code.signed:
    magnitude = jax.lax.abs(x)
  else:
    # Negative values (and -0.0, whose int32 bits would wrap below) code as 0.
    magnitude = jax.lax.select(jax.lax.gt(x, zero), x, jnp.zeros_like(x))
  # A true division: the block's largest element becomes exactly 1.0.
  safe = jax.lax.select(scales > zero, scales, jnp.ones_like(scales))
  a = jax.lax.div(magnitude, _expand(safe, shape))
  if given is not None:
    # Scales from another computation of ``x`` (a first pass, which XLA may
    # contract ``a * b + c`` in differently) may sit an ulp below an element:
    # its ratio, above 1, would code past the top level into the sign bit.
    a = jax.lax.min(a, np.float32(1))
  bits = _int32_bits(a)
  layout = code.layout
  bounds = [low for low, _, _ in layout[:-1]]
  # In region r, level = base + ((bits - low + noise) >> shift), which is
  # (bits + noise + (base << shift) - low) >> shift: an offset and a shift.
  offset = _region_values(bits, bounds, [(c << sh) - low for low, c, sh in layout])
  shift = _region_values(bits, bounds, [sh for _, _, sh in layout])
  one = np.int32(1)
  random = rounding.random_bits(key, step, shape)
  mask = jax.lax.sub(jax.lax.shift_left(one, shift), one)
  noise = jax.lax.bitwise_and(random.astype(jnp.int32), mask)
  level = jax.lax.shift_right_arithmetic(jax.lax.add(jax.lax.add(bits, offset), noise), shift)
  lowest = np.array(layout[-1][0], np.int32).view(np.float32)
  if code.signed:
    # Below the smallest level: to it with probability a / lowest, else to 0.
    # Via int32 (the value fits 24 bits): uint32 to float32 does not vectorize.
    uniform = jax.lax.shift_right_logical(random, np.uint32(8)).astype(jnp.int32)
    uniform = uniform.astype(jnp.float32)
    threshold = jax.lax.mul(uniform, np.float32(lowest * 2.0**-24))
    # As integers: the bits of non-negative floats order as their values (and
    # then ``a`` is read only as bits, so XLA keeps it in registers).
    small = jax.lax.gt(bits, _int32_bits(threshold))
  else:
    # Never to zero: a positive value below the smallest level takes it, even
    # one whose ratio to the scale underflowed (so test x, not a).
    small = jax.lax.gt(x, zero)
  below = jax.lax.lt(bits, np.int32(layout[-1][0]))
  level = jax.lax.select(below, small.astype(jnp.int32), level)
  if code.signed:
    negative = jax.lax.bitwise_and(jax.lax.lt(x, zero), jax.lax.gt(level, np.int32(0)))
    level = jax.lax.bitwise_or(level, jax.lax.shift_left(negative.astype(jnp.int32), np.int32(7)))
  return level.astype(jnp.uint8), scales


def decode(stored: EightBitMoment) -> jax.Array:
  """Returns the float32 leaf that ``stored`` codes: each level times its
  block's scale, in the code its type names."""
  code = CODES[sign_of(stored)]
  codes, scales = jnp.asarray(stored.codes), jnp.asarray(stored.scales)
  shape = codes.shape
  _, blocks = block_layout(shape)
  expected = (*shape[:-1], blocks)
  if scales.shape != expected:
    raise ValueError(
      f"scales of shape {scales.shape} do not match codes of shape {shape}: expected {expected}"
    )
  k = codes.astype(jnp.int32)
  magnitude = jax.lax.bitwise_and(k, np.int32(127)) if code.signed else k
  layout = code.layout
  bounds = [c for _, c, _ in layout[:-1]]
  # In region r, bits = low + ((k - base) << shift) = (low - (base << shift)) + (k << shift).
  offset = _region_values(magnitude, bounds, [low - (c << sh) for low, c, sh in layout])
  shift = _region_values(magnitude, bounds, [sh for _, _, sh in layout])
  bits = jax.lax.add(offset, jax.lax.shift_left(magnitude, shift))
  if code.signed:
    # The sign bit moves to float32's sign bit; the level's bits stay.
    sign = jax.lax.shift_left(jax.lax.shift_right_logical(k, np.int32(7)), np.int32(31))
    bits = jax.lax.bitwise_or(bits, sign)
  level = jax.lax.bitcast_convert_type(bits, jnp.float32)
  value = jax.lax.mul(level, _expand(scales, shape))
  if not code.signed:
    # A product below float32's normals would flush to zero: keep it positive.
    value = jax.lax.max(value, jnp.full_like(value, _TINY))
  return jax.lax.select(jax.lax.eq(magnitude, np.int32(0)), jnp.zeros_like(value), value)


def level_table(sign: Sign) -> np.ndarray:
  """Returns the float32 level of each of the 256 codes of ``sign`` at scale 1
  (the sign bit applied): what :func:`decode` computes, as a table."""
  _check_sign(sign)
  return _LEVEL_TABLES[sign].copy()


def _level_table(code: _Code) -> np.ndarray:
  """:func:`level_table` of any float-like ``code``, in numpy."""
  k = np.arange(256, dtype=np.int64)
  magnitude = k & 127 if code.signed else k
  layout = code.layout
  bounds = [c for _, c, _ in layout[:-1]]
  region = np.zeros_like(magnitude)
  for bound in bounds:
    region += magnitude < bound
  offset = np.array([low - (c << sh) for low, c, sh in layout])[region]
  shift = np.array([sh for _, _, sh in layout])[region]
  bits = (offset + (magnitude << shift)) & 0xFFFFFFFF
  if code.signed:
    bits |= (k >> 7) << 31
  levels = bits.astype(np.uint32).view(np.float32)
  return np.where(magnitude == 0, np.float32(0), levels).astype(np.float32)


_LEVEL_TABLES = {sign: _level_table(CODES[sign]) for sign in SIGNS}


def decode_by_table(stored: EightBitMoment) -> jax.Array:
  """Returns :func:`decode`'s values, bitwise, by a lookup in :func:`level_table`.

  A gather that XLA:GPU fuses as a cheap producer, where the arithmetic
  decode's shifts and selects tip its cost model into writing a new moment
  computed from it out in float32 (docs/design.md); its gather keeps XLA
  from writing codes in place, so it serves a pass that writes no codes.
  """
  sign = sign_of(stored)
  codes = jnp.asarray(stored.codes)
  scales = jnp.asarray(stored.scales)
  _, blocks = block_layout(codes.shape)
  if scales.shape != (*codes.shape[:-1], blocks):
    raise ValueError(f"scales of shape {scales.shape} do not match codes of shape {codes.shape}")
  k = codes.astype(jnp.int32)
  # A copy per call: JAX lowers one array object used twice as one constant.
  level = compat.lookup(_LEVEL_TABLES[sign].copy(), k)
  value = jax.lax.mul(level, _expand(scales, codes.shape))
  magnitude = k
  if sign == "nonnegative":
    value = jax.lax.max(value, jnp.full_like(value, _TINY))
  else:
    magnitude = jax.lax.bitwise_and(k, np.int32(127))
  return jax.lax.select(jax.lax.eq(magnitude, np.int32(0)), jnp.zeros_like(value), value)


def encode_bfloat16(x: jax.Array, key: jax.Array, step: jax.Array) -> jax.Array:
  """Rounds ``x`` (float32) to bfloat16, up or down in magnitude at random with
  probability proportional to the distance (unbiased). Magnitudes beyond
  bfloat16's largest finite value saturate at it."""
  x = rounding.canonical(jnp.asarray(x, jnp.float32))
  bits = rounding.random_bits(_salted(key, "bfloat16"), step, x.shape)
  return rounding.stochastic_round(x, bits)


def decode_bfloat16(x: jax.Array) -> jax.Array:
  """Returns a bfloat16 moment in float32 (exact)."""
  return jnp.asarray(x).astype(jnp.float32)
