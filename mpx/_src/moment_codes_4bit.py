"""The 4-bit moment codes: two codes a byte, a float32 scale per block of 128.

Pure lax functions, as :mod:`mpx._src.moment_codes` for 8 bits: :func:`encode`
and :func:`decode` for the code of each sign, :func:`maxima` for the scales
alone (a first pass that ``encode(..., scales=...)`` codes against),
:func:`stored_shapes` and :func:`bytes_per_element`. The levels, the layout
and the measurements behind them: docs/moment_codes.md, "4 bits".

Written for XLA:CPU as the 8-bit code is: each pass is one loop fusion that
LLVM vectorizes, nothing per element is written out in float32 or int32
between passes, and an optimizer step fuses the moment's computation into
each pass. What keeps it so (checked in the optimized HLO and the LLVM IR):

- Codes are packed by a reduction over each group of ``code << 4 * position``
  (``_pack``), never by strided slices or a concatenation, which leave the
  loop scalar or write an int32 array out.
- Where every block's codes fill whole uint32 words (block sizes that are
  multiples of 8), codes are packed and read back a word of 8 at a time
  (``_unpack``): a loop over elements then loads one word per vector of 8
  lanes, where from bytes it loads and inserts one byte per lane.
- Rounding is arithmetic on the float32 bits and comparisons against
  constants, the ratio to the scale read once (``_ratio``, ``_round``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import compat, lowering, rounding
from mpx._src.states import Nonnegative4bitMoment, Signed4bitMoment

Sign = Literal["signed", "nonnegative"]
SIGNS: tuple[Sign, ...] = ("signed", "nonnegative")

# Blocks hold at most this many elements along the last axis; ``block_layout``
# prefers an even size in (MAX_BLOCK / 2, MAX_BLOCK] that divides.
MAX_BLOCK = 128
# The shortest last axis for which the 4-bit code pays: a row of n <= 128
# elements costs n // 2 bytes of codes, 4 of its block's scale and, for an odd
# n, 4 more for its last element (in float32), against bfloat16's 2 n. That is
# less from n = 4 (6 bytes against 8) but for n = 5 (10 against 10), and for
# every n >= 6 (7 against 12; 11 against 14 for n = 7; under 0.6 bytes an
# element past 128). Shorter rows are for bfloat16, as
# ``moments.MIN_ROW_8BIT`` routes them for the 8-bit code.
MIN_ROW = 6

# Independent random bits per sign (and apart from the 8-bit code's salts).
_SALTS = {"signed": 0xA54FF53A, "nonnegative": 0x510E527F}
_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32
_SIGN_BIT = 8  # the signed code's sign, above its 3-bit magnitude


def _de_magnitudes(bits: int = 3) -> np.ndarray:
  """The dynamic-exponent map's magnitudes for ``bits`` bits after the sign:
  ``e`` leading zeros, an indicator bit, ``bits - 1 - e`` fraction bits over
  [0.1, 1] at decade ``10**-e`` (bin midpoints), and zero; divided by the
  largest, ascending, float64."""
  out = [0.0]
  for e in range(bits):
    f = bits - 1 - e
    out += [10.0**-e * (0.1 + 0.9 * (j + 0.5) / 2**f) for j in range(2**f)]
  levels = np.sort(np.asarray(out))
  return levels / levels[-1]


# The signed code's magnitudes, index = the code's low 3 bits: 0 and 7 levels
# up to 1.0 (0.0062, 0.0366, 0.0873, 0.2394, 0.4930, 0.7465, 1).
SIGNED_LEVELS = _de_magnitudes().astype(np.float32)


def _float_levels(mantissas: tuple[float, ...] = (1.0, 0.75), count: int = 15) -> np.ndarray:
  """``count`` float-like levels from 1 down: ``m * 2**-e`` for each mantissa
  ``m`` of each octave ``e``; with 0 first, ascending, float64."""
  out = [m * 2.0**-e for e in range(count) for m in mantissas][:count]
  return np.concatenate([[0.0], np.sort(out)])


# The nonnegative code's levels, index = the code: 0 (only for x <= 0), then 15
# levels up to 1.0: 2**-7, 0.0117, 2**-6, ..., 0.375, 0.5, 0.75, 1.
NONNEGATIVE_LEVELS = _float_levels().astype(np.float32)
# The paper's map for a second moment, k / 15 here (0 kept for x <= 0), which
# the benchmark compares.
LINEAR_LEVELS = (np.arange(16) / np.float32(15)).astype(np.float32)


class _Code(NamedTuple):
  """A 4-bit code: its magnitudes ascending from 0 to 1 (8 signed, with a sign
  bit above; 16 nonnegative, where 0 is only for a value that is not positive)."""

  levels: np.ndarray
  signed: bool

  @property
  def floatlike(self) -> bool:
    """Whether these are :data:`NONNEGATIVE_LEVELS`, coded on the float32 bits
    (``_round_floatlike``); other levels are coded by comparisons."""
    return not self.signed and np.array_equal(self.levels, NONNEGATIVE_LEVELS)


CODES: dict[str, _Code] = {
  "signed": _Code(SIGNED_LEVELS, True),
  "nonnegative": _Code(NONNEGATIVE_LEVELS, False),
}


FourBitMoment: TypeAlias = Signed4bitMoment | Nonnegative4bitMoment
STORED_TYPES: dict[Sign, type[FourBitMoment]] = {
  "signed": Signed4bitMoment,
  "nonnegative": Nonnegative4bitMoment,
}


def block_layout(n: int) -> tuple[int, int]:
  """Returns ``(block_size, n_blocks)`` for a row of ``n`` coded elements (even,
  or 0): one block up to ``MAX_BLOCK``; else the even divisor in (64, 128] that
  leaves the block count with the most factors of two, then the largest (4096:
  32 blocks of 128; 768: 8 of 96; 11008: 128 of 86; 50256: 698 of 72), so that
  sharding the axis 2, 4, 8... ways splits it on block boundaries; else
  ``ceil(n / 128)`` blocks of an even size, the last short (4098: 33 of 126).
  Smaller divisors would cost more in scales than 4-bit codes save.
  """
  if n <= MAX_BLOCK:
    return n, 1 if n else 0

  def twos(k: int) -> int:
    return (k & -k).bit_length()

  divisors = [d for d in range(MAX_BLOCK // 2 + 2, MAX_BLOCK + 1, 2) if n % d == 0]
  if divisors:
    size = max(divisors, key=lambda d: (twos(n // d), d))
    return size, n // size
  blocks = -(-n // MAX_BLOCK)
  size = -(-n // blocks)
  size += size % 2
  return size, -(-n // size)


def _check(shape: tuple[int, ...], sign: str) -> None:
  if sign not in SIGNS:
    raise ValueError(f"sign must be one of {SIGNS}, got {sign!r}")
  if not shape or math.prod(shape) == 0:
    raise ValueError(f"4-bit codes take a leaf of one or more axes and elements, got {shape}")


def stored_shapes(shape: tuple[int, ...], sign: Sign) -> FourBitMoment:
  """Returns the stored form of a float32 leaf of ``shape`` as
  ``jax.ShapeDtypeStruct``s in the stored type of ``sign``."""
  shape = tuple(shape)
  _check(shape, sign)
  lead = shape[:-1]

  def u8(s: tuple[int, ...]) -> Any:
    return jax.ShapeDtypeStruct(s, jnp.uint8)

  def f32(s: tuple[int, ...]) -> Any:
    return jax.ShapeDtypeStruct(s, jnp.float32)

  layout = _Layout.of(shape)
  codes = u8((*lead, layout.body // 2))
  scales = f32((*lead, layout.blocks + layout.tail))
  return STORED_TYPES[sign](codes, scales)


def bytes_per_element(shape: tuple[int, ...], sign: Sign) -> float:
  """Returns the bytes the 4-bit form of a leaf of ``shape`` stores per element:
  half a byte a code plus the float32 scales (an odd row's last element among
  them), over its size; the same for either sign."""
  stored = stored_shapes(shape, sign)
  total = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in stored)
  return total / math.prod(shape)


def sign_of(stored: FourBitMoment) -> Sign:
  """Returns the sign whose code ``stored`` holds."""
  for sign, stored_type in STORED_TYPES.items():
    if isinstance(stored, stored_type):
      return sign
  raise ValueError(
    f"expected a Signed4bitMoment or a Nonnegative4bitMoment, got {type(stored).__name__}"
  )


# --- Helpers ------------------------------------------------------------------


class _Layout(NamedTuple):
  """Where a leaf of ``shape`` puts its elements: the first ``body`` (even) of
  each row in ``blocks`` blocks of ``size`` along the last axis, then ``tail``
  (0 or 1) last element stored in float32."""

  lead: tuple[int, ...]
  n: int
  body: int
  size: int
  blocks: int
  tail: int

  @classmethod
  def of(cls, shape: tuple[int, ...]) -> _Layout:
    *lead, n = shape
    body = n - n % 2
    return cls(tuple(lead), n, body, *block_layout(body), n % 2)

  @classmethod
  def of_codes(cls, codes_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> _Layout:
    """The layout whose codes and scales have these shapes: ``n`` is odd where
    the scales hold one more entry a row than the blocks."""
    *lead, pairs = codes_shape
    body = 2 * pairs
    size, blocks = block_layout(body)
    if tuple(scales_shape[:-1]) != tuple(lead) or scales_shape[-1] not in (blocks, blocks + 1):
      raise ValueError(
        f"scales of shape {scales_shape} do not match codes of shape {codes_shape}: expected "
        f"{(*lead, blocks)} (an even last axis) or {(*lead, blocks + 1)} (an odd one)"
      )
    tail = scales_shape[-1] - blocks
    return cls(tuple(lead), body + tail, body, size, blocks, tail)

  @property
  def per(self) -> int:
    """How many codes are packed together: 8, a uint32 word, where every
    block's codes fill whole words (so that a shard of the last axis on block
    boundaries holds whole words), else 2, a byte."""
    return 8 if self.size % 8 == 0 and self.body % 8 == 0 else 2

  def wide(self, block_max: jax.Array) -> jax.Array:
    """Each block's value broadcast to its elements of the body."""
    full = jnp.broadcast_to(block_max[..., None], (*self.lead, self.blocks, self.size))
    return _unblocked(full, self.body)


def _salted(key: jax.Array, sign: str) -> jax.Array:
  return jax.lax.bitwise_xor(jnp.asarray(key).astype(jnp.uint32), np.uint32(_SALTS[sign]))


def _blocked(x: jax.Array, size: int, blocks: int) -> jax.Array:
  """``x``'s last axis cut into ``(blocks, size)``, zero-padded at the end."""
  pad = size * blocks - x.shape[-1]
  if pad:
    x = jax.lax.pad(x, np.float32(0), [(0, 0, 0)] * (x.ndim - 1) + [(0, pad, 0)])
  return x.reshape((*x.shape[:-1], blocks, size))


def _unblocked(wide: jax.Array, n: int) -> jax.Array:
  """Merges the last two axes and drops the padding past ``n``."""
  wide = wide.reshape((*wide.shape[:-2], wide.shape[-2] * wide.shape[-1]))
  return jax.lax.slice_in_dim(wide, 0, n, axis=wide.ndim - 1) if wide.shape[-1] != n else wide


def _max_over(x: jax.Array, axes: tuple[int, ...], signed: bool) -> jax.Array:
  """The largest magnitude (signed) or value (nonnegative) over ``axes``, at
  least 0; as a two-result reduction, which XLA:CPU fuses its producer into
  (docs/moment_codes.md, ``_block_scales``)."""
  zero = np.float32(0)
  second = jax.lax.min if signed else jax.lax.max

  def reducer(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
  ) -> tuple[jax.Array, jax.Array]:
    return jax.lax.max(a[0], b[0]), second(a[1], b[1])

  largest, other = jax.lax.reduce((x, x), (zero, zero), reducer, axes)
  return jax.lax.max(largest, jax.lax.neg(other) if signed else other)


def _positive(x: jax.Array) -> jax.Array:
  """``x > 0`` read from the bits, so that a positive subnormal counts even
  where the hardware flushes it to zero."""
  return jax.lax.gt(jax.lax.bitcast_convert_type(x, jnp.int32), np.int32(0))


def _tail_nonnegative(tail: jax.Array) -> jax.Array:
  """A nonnegative odd row's last element as stored: itself, at least the
  smallest normal if positive, 0 if not positive."""
  kept = jax.lax.max(tail, jnp.full_like(tail, _TINY))
  return jax.lax.select(_positive(tail), kept, jnp.zeros_like(tail))


def _ratio(magnitude: jax.Array, scale: jax.Array) -> jax.Array:
  """``magnitude / scale`` (a scale of 0 divides by 1), not clamped: a scale
  below the magnitude gives a ratio above 1, which the rounding takes to the
  top level, never a wrap. A true division, so that a block's largest element
  gives exactly 1; the select is per element, after the broadcast, so that
  XLA does not turn the division by a broadcast into a product by a
  reciprocal."""
  safe = jax.lax.select(jax.lax.gt(scale, np.float32(0)), scale, jnp.ones_like(scale))
  return jax.lax.div(magnitude, safe)


def _uniform(key: jax.Array, step: jax.Array, shape: tuple[int, ...], n: int) -> jax.Array:
  """Uniform float32 in [0, 1), 24 bits, per element of a leaf of ``shape``,
  sliced to the first ``n`` along its last axis."""
  top = _random_top(key, step, shape, n, 24)
  return jax.lax.mul(top.astype(jnp.float32), np.float32(2.0**-24))


def _random_top(
  key: jax.Array, step: jax.Array, shape: tuple[int, ...], n: int, bits: int
) -> jax.Array:
  """The top ``bits`` (at most 31) of each element's random bits, as int32,
  for a leaf of ``shape`` sliced to the first ``n`` along its last axis."""
  random = rounding.random_bits(key, jnp.asarray(step, jnp.int32), shape)
  if shape[-1] != n:
    random = jax.lax.slice_in_dim(random, 0, n, axis=len(shape) - 1)
  # Via int32: uint32 to float32 (for ``_uniform``) does not vectorize on CPU.
  return jax.lax.shift_right_logical(random, np.uint32(32 - bits)).astype(jnp.int32)


def _lookup(index: jax.Array, table: np.ndarray) -> jax.Array:
  """``table[index]`` for a small constant table (a power of two long), as a
  tree of selects on the bits of ``index``: for 8 entries 7 selects on 3 bit
  tests, where a chain takes 7 selects on 7 comparisons."""
  # Like index, its sharding too (an explicit mesh refuses a select of mixed ones).
  level = [jax.lax.full_like(index, value, jnp.float32) for value in table]
  bit = 0
  while len(level) > 1:
    on = jax.lax.ne(jax.lax.bitwise_and(index, np.int32(1 << bit)), np.int32(0))
    level = [jax.lax.select(on, hi, lo) for lo, hi in zip(level[0::2], level[1::2], strict=True)]
    bit += 1
  return level[0]


def _pack(codes: jax.Array, per: int | None = None) -> jax.Array:
  """int32 codes in [0, 16), an even count along the last axis, two a byte:
  element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one.

  ``per`` codes at a time (by default 8 where the count allows, else 2), as a
  reduction over each group of ``code << 4 * position``, not strided slices:
  XLA:CPU then emits one loop over the groups that LLVM vectorizes (with the
  slices the loop stays scalar). Eight make a uint32 word, split into its
  bytes (little-endian: the same bytes) by a small second pass; a loop over
  words reads a moment decoded from words (``_unpack``) a vector at a time,
  where a loop over bytes would gather its words. XLA:CPU's form:
  accelerators pack by a bitcast (``_pack_by_bitcast``)."""
  *lead, n = codes.shape
  per = per or (8 if n % 8 == 0 else 2)
  groups = codes.reshape((*lead, n // per, per))
  last = groups.ndim - 1
  shift = jax.lax.mul(jax.lax.broadcasted_iota(jnp.int32, groups.shape, last), np.int32(4))
  packed = jax.lax.reduce(
    jax.lax.shift_left(groups, shift), np.int32(0), jax.lax.bitwise_or, (last,)
  )
  if per == 2:
    return packed.astype(jnp.uint8)
  words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
  return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape((*lead, n // 2))


def kept_codes(applied: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  """Returns the packed codes ``new`` where ``applied``, else ``old``, selected as
  uint4 pairs: XLA:GPU then fuses the select into the kernel that codes
  ``new`` (packed by ``_pack_by_bitcast``) and writes it in place, where a
  select of the packed bytes is a kernel of its own that reads the new codes
  back from scratch (docs/design.md, "Compressed moments at the byte floor")."""
  nibbles = lambda codes: jax.lax.bitcast_convert_type(codes, jnp.uint4)  # noqa: E731
  codes = jnp.where(applied, nibbles(new), nibbles(old))
  return jax.lax.bitcast_convert_type(codes, jnp.uint8)


def _pack_by_bitcast(codes: jax.Array) -> jax.Array:
  """``_pack(codes)`` as a bitcast of uint4 pairs: element ``2i`` in the low
  nibble of byte ``i`` (XLA's order for a bitcast to a wider type)."""
  *lead, n = codes.shape
  pairs = codes.astype(jnp.uint4).reshape((*lead, n // 2, 2))
  return jax.lax.bitcast_convert_type(pairs, jnp.uint8)


def _packed(codes: jax.Array, per: int) -> jax.Array:
  """``_pack(codes, per)``; on accelerators (the same bytes) by a bitcast of uint4
  pairs, the view in which the step reads and keeps the codes, so that XLA:GPU
  writes them in place (docs/design.md, "Compressed moments at the byte floor")."""
  return lowering.by_platform(codes, cpu=lambda c: _pack(c, per), accelerator=_pack_by_bitcast)


def _unpacked(codes: jax.Array, per: int) -> jax.Array:
  """``_unpack(codes, per)``; on accelerators by a bitcast to uint4 pairs, the
  view in which ``kept`` selects the new codes: read and written alike, XLA
  writes the new codes over the old ones in place (read as bytes, it copies)."""
  return lowering.by_platform(codes, cpu=lambda c: _unpack(c, per), accelerator=_unpack_by_bitcast)


def _unpack_by_bitcast(codes: jax.Array) -> jax.Array:
  """``_unpack(codes)`` as a bitcast to uint4 pairs (see ``_pack_by_bitcast``)."""
  nibbles = jax.lax.bitcast_convert_type(codes, jnp.uint4)
  return nibbles.reshape((*codes.shape[:-1], 2 * codes.shape[-1])).astype(jnp.int32)


def _unpack(codes: jax.Array, per: int | None = None) -> jax.Array:
  """The int32 codes of a packed uint8 array, twice as many along the last
  axis: each group (a byte, or with ``per = 8`` a uint32 word of four bytes;
  by default words where the count allows) broadcast to its codes and shifted,
  in one loop fusion with what uses them (no concatenation, which XLA:CPU
  writes out as an int32 array). A loop over elements reads a word per vector
  of 8 lanes (``element >> 3`` is the same across the vector: one load and a
  broadcast), a byte per lane. The words take a small pass of their own
  (uint32, half a byte an element, written out)."""
  k = jnp.asarray(codes)
  *lead, n_bytes = k.shape
  per = per or (8 if n_bytes % 4 == 0 else 2)
  if per == 8:
    k = jax.lax.bitcast_convert_type(k.reshape((*lead, n_bytes // 4, 4)), jnp.uint32)
  k = k.astype(jnp.int32)
  wide = jax.lax.broadcast_in_dim(k, (*k.shape, per), tuple(range(k.ndim)))
  shift = jax.lax.mul(jax.lax.broadcasted_iota(jnp.int32, wide.shape, k.ndim), np.int32(4))
  nibbles = jax.lax.bitwise_and(jax.lax.shift_right_logical(wide, shift), np.int32(15))
  return nibbles.reshape((*lead, 2 * n_bytes))


def _int32_bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def _round(a: jax.Array, levels: np.ndarray, u: jax.Array | None) -> jax.Array:
  """The index of ``a`` (at least 0) among ``levels`` (ascending, from 0 to 1;
  above 1, the top): the nearest (ties up) when ``u`` is None, else the one
  below or above with probabilities proportional to the distance to the other
  (unbiased).

  A count of the thresholds that ``a`` reaches: the midpoints to nearest;
  stochastic, ``levels[k - 1] + u * (levels[k] - levels[k - 1])`` for each
  ``k``, which ``a`` in ``[levels[j], levels[j + 1])`` reaches for every ``k <=
  j`` and, for ``k = j + 1``, with probability ``(a - levels[j]) / (levels[j +
  1] - levels[j])``. Compared as int32 bits (non-negative floats order as their
  bits), so that ``a`` has one user, which XLA fuses its division into."""
  bits = _int32_bits(a)
  index = jnp.zeros(a.shape, jnp.int32)
  if u is None:
    mids = ((levels[:-1].astype(np.float64) + levels[1:]) / 2).astype(np.float32)
    for mid in mids.view(np.int32):
      index = jax.lax.add(index, jax.lax.ge(bits, mid).astype(jnp.int32))
    return index
  for low, high in itertools.pairwise(levels):
    threshold = jax.lax.add(jax.lax.mul(u, np.float32(high - low)), np.float32(low))
    index = jax.lax.add(index, jax.lax.ge(bits, _int32_bits(threshold)).astype(jnp.int32))
  return index


# The nonnegative code as float32 bits: level ``k >= 1`` is the float whose
# bits are ``(k + _FLOAT_BASE) << 22`` (one mantissa bit: ``2**-7`` is ``240 <<
# 22``, 1.0 is ``254 << 22``).
_FLOAT_SHIFT = 22
_FLOAT_BASE = 239


def _round_floatlike(a: jax.Array, noise: jax.Array | np.int32 | int) -> jax.Array:
  """The nonnegative code (1 to 15) of a positive ratio ``a`` to its scale,
  from its float32 bits: ``noise`` added below the one mantissa bit kept (half
  of it to nearest, ties up; 22 uniform random bits stochastic, which round up
  with probability ``(a - low) / (high - low)``), then the exponent and that
  bit read as the code; below ``2**-7`` (an ``a`` that underflowed included)
  to the smallest level, above 1 to the top."""
  bits = _int32_bits(a)
  rounded = jax.lax.shift_right_arithmetic(jax.lax.add(bits, noise), np.int32(_FLOAT_SHIFT))
  t = jax.lax.clamp(np.int32(_FLOAT_BASE + 1), rounded, np.int32(_FLOAT_BASE + 15))
  return jax.lax.sub(t, np.int32(_FLOAT_BASE))


def _floatlike_levels(k: jax.Array) -> jax.Array:
  """The nonnegative code's level of each code ``k`` in 1 .. 15, built from its
  bits (code 0 gives a tiny positive float; the caller zeroes it)."""
  bits = jax.lax.shift_left(jax.lax.add(k, np.int32(_FLOAT_BASE)), np.int32(_FLOAT_SHIFT))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _check_scales(given: jax.Array, expected: tuple[int, ...], what: str) -> jax.Array:
  given = jnp.asarray(given, jnp.float32)
  if given.shape != expected:
    raise ValueError(f"{what} of shape {given.shape}, expected {expected}")
  return given


# --- The codes ----------------------------------------------------------------


def maxima(x: jax.Array, sign: Sign) -> jax.Array:
  """Returns the scales :func:`encode` computes for ``x``, as its ``scales=``
  argument takes them, for either sign: float32, ``(*lead, n_blocks + n %
  2)``, each row's block maxima (the largest magnitude, signed; the largest
  value, at least 0, nonnegative), then for an odd row its last element as
  stored. Along the last axis only: nothing is reduced across rows."""
  x = jnp.asarray(x, jnp.float32)
  _check(x.shape, sign)
  return _maxima(x, sign == "signed", _Layout.of(x.shape))


def _maxima(x: jax.Array, signed: bool, layout: _Layout) -> jax.Array:
  body = x[..., : layout.body]
  blocked = _blocked(body, layout.size, layout.blocks)
  if layout.per == 8:
    # A moment decoded from words (``_unpack``) in here reads a word a vector.
    scales = _max_over(blocked, (x.ndim,), signed)
  else:
    # Each block as (size / 2) pairs: the reduction's inner loops then run
    # over a pair and over the bytes, which it reads a vector at a time.
    pairs = blocked.reshape((*blocked.shape[:-1], layout.size // 2, 2))
    scales = _max_over(pairs, (x.ndim, x.ndim + 1), signed)
  if layout.tail:
    tail = x[..., layout.body :]
    scales = jnp.concatenate([scales, tail if signed else _tail_nonnegative(tail)], axis=-1)
  return scales


def encode(
  x: jax.Array,
  sign: Sign,
  key: jax.Array,
  step: jax.Array,
  stochastic: bool,
  scales: jax.Array | None = None,
) -> FourBitMoment:
  """Codes ``x`` (float32, one or more axes) in 4 bits per element plus scales.

  Args:
    x: the moment leaf, float32, finite; under ``"nonnegative"``, values that
      are not positive code as zero.
    sign: ``"signed"`` or ``"nonnegative"``: which code.
    key: uint32 scalar, the leaf's key for random bits.
    step: int32 scalar, the step the random bits are drawn for; it must change
      every time the leaf is encoded anew.
    stochastic: round up or down at random (unbiased but for nonnegative
      values below the smallest level, which always take it) instead of to
      nearest.
    scales: optional, float32 ``(*lead, n_blocks + n % 2)``, the scales to
      code against, as :func:`maxima` returns them (a first pass); by default,
      ``maxima(x, sign)``. An element larger than its scale codes to the top
      level: it decodes to the scale. An odd row's last element (the last
      entry of each row of ``scales``) is taken from ``x`` whatever is
      given.

  Returns:
    A ``Signed4bitMoment`` or ``Nonnegative4bitMoment`` (``STORED_TYPES[sign]``);
    :func:`decode` turns it back into float32 of ``x``'s shape.
  """
  x = jnp.asarray(x, jnp.float32)
  _check(x.shape, sign)
  return _encode(CODES[sign], x, _salted(key, sign), step, stochastic, scales)


def _encode(
  code: _Code,
  x: jax.Array,
  key: jax.Array,
  step: jax.Array,
  stochastic: bool,
  scales: jax.Array | None,
) -> FourBitMoment:
  """``encode`` in ``code``, with an already salted ``key``."""
  layout = _Layout.of(x.shape)
  lead, body = layout.lead, layout.body
  if scales is None:
    block_max = _maxima(x, code.signed, layout)
  else:
    block_max = _check_scales(scales, (*lead, layout.blocks + layout.tail), "scales")
  if layout.tail and scales is not None:
    tail = x[..., body:]
    tail = tail if code.signed else _tail_nonnegative(tail)
    block_max = jnp.concatenate([block_max[..., : layout.blocks], tail], axis=-1)
  if not body:
    codes = jnp.zeros((*lead, 0), jnp.uint8)
  else:
    scale = layout.wide(block_max[..., : layout.blocks])
    codes = _codes(code, x[..., :body], scale, key, step, stochastic, x.shape)
    codes = _packed(codes, layout.per)
  if code.signed:
    return Signed4bitMoment(codes, block_max)
  return Nonnegative4bitMoment(codes, block_max)


def _codes(
  code: _Code,
  v: jax.Array,
  scale: jax.Array,
  key: jax.Array,
  step: jax.Array,
  stochastic: bool,
  shape: tuple[int, ...],
) -> jax.Array:
  """The int32 code of each element of the body ``v`` against its block's
  ``scale`` (broadcast to ``v``'s shape); random bits drawn for a leaf of
  ``shape``. Elementwise: one loop fusion with the packing."""
  body = v.shape[-1]
  # Of |v| for either sign: a value that is not positive is zeroed below under
  # the nonnegative code. (Dividing v itself, XLA:CPU writes v out in float32
  # instead of fusing its computation, e.g. Adam's new moment, in here.)
  a = _ratio(jax.lax.abs(v), scale)
  if code.floatlike:
    noise = (
      _random_top(key, step, shape, body, _FLOAT_SHIFT)
      if stochastic
      else np.int32(1 << (_FLOAT_SHIFT - 1))
    )
    index = _round_floatlike(a, noise)
  else:
    u = _uniform(key, step, shape, body) if stochastic else None
    index = _round(a, code.levels, u)
  if code.signed:
    negative = jax.lax.bitwise_and(jax.lax.lt(v, np.float32(0)), jax.lax.gt(index, np.int32(0)))
    sign_bit = jax.lax.mul(negative.astype(jnp.int32), np.int32(_SIGN_BIT))
    return jax.lax.bitwise_or(index, sign_bit)
  # Never to zero: a positive value below the smallest level takes it (the
  # float-like rounding does so itself; test x, not a, which may have
  # underflowed); 0 only for x <= 0.
  if not code.floatlike:
    index = jax.lax.max(index, jnp.ones_like(index))
  return jax.lax.select(_positive(v), index, jnp.zeros_like(index))


def decode(stored: FourBitMoment) -> jax.Array:
  """Returns the float32 leaf that ``stored`` codes, in the shape that was
  encoded: each level times its scale, in the code its type names."""
  return _decode(CODES[sign_of(stored)], stored)


def decode_by_table(stored: FourBitMoment) -> jax.Array:
  """Returns :func:`decode`'s values, bitwise, each code's level looked up in a
  table of 16 (an odd last axis: :func:`decode` itself).

  A gather that XLA:GPU fuses as a cheap producer into a reduction over the
  moment computed from it, where the selects of :func:`decode`'s signed levels
  tip its cost model into writing that moment out in float32; its gather
  keeps XLA from writing codes in place, so it serves a pass that writes no
  codes (docs/design.md, "Compressed moments at the byte floor").
  """
  code = CODES[sign_of(stored)]
  codes = jnp.asarray(stored.codes)
  scales = jnp.asarray(stored.scales, jnp.float32)
  layout = _Layout.of_codes(codes.shape, scales.shape)
  if layout.tail or not layout.body:
    return _decode(code, stored)
  k = _unpacked(codes, layout.per)
  scale = layout.wide(scales[..., : layout.blocks])
  if code.signed:
    # Index = the code: its low 3 bits the magnitude, the 4th the sign.
    table = np.concatenate([code.levels, -code.levels]).astype(np.float32)
  else:
    table = code.levels.astype(np.float32)
  value = jax.lax.mul(compat.lookup(table, k), scale)
  if code.signed:
    return value
  bits = jax.lax.max(_int32_bits(value), np.int32(_TINY.view(np.int32)))
  value = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return jax.lax.select(jax.lax.gt(k, np.int32(0)), value, jnp.zeros_like(value))


def _decode(code: _Code, stored: FourBitMoment) -> jax.Array:
  codes = jnp.asarray(stored.codes)
  scales = jnp.asarray(stored.scales, jnp.float32)
  layout = _Layout.of_codes(codes.shape, scales.shape)
  tail = scales[..., layout.blocks :]
  if not layout.body:
    return tail
  if layout.tail:
    # Codes and scales over all n columns, the last one's a padding code and
    # some scale, replaced by the tail below: no concatenation or pad of the
    # decoded floats, which XLA:CPU would write out in float32.
    group = 4 if layout.per == 8 else 1  # bytes unpacked together
    padded = -(-(codes.shape[-1] + 1) // group) * group
    widen = [(0, 0, 0)] * (codes.ndim - 1) + [(0, padded - codes.shape[-1], 0)]
    codes = jax.lax.pad(codes, np.uint8(0), widen)
    k = jax.lax.slice_in_dim(_unpack(codes, layout.per), 0, layout.n, axis=codes.ndim - 1)
    full = jnp.broadcast_to(scales[..., None], (*layout.lead, scales.shape[-1], layout.size))
    scale = _unblocked(full, layout.n)
  else:
    k = _unpacked(codes, layout.per)
    scale = layout.wide(scales[..., : layout.blocks])
  if code.signed:
    magnitude = _lookup(jax.lax.bitwise_and(k, np.int32(_SIGN_BIT - 1)), code.levels)
    # The code's sign bit moves to float32's: -level, exactly.
    sign = jax.lax.shift_left(jax.lax.bitwise_and(k, np.int32(_SIGN_BIT)), np.int32(28))
    bits = jax.lax.bitwise_or(_int32_bits(magnitude), sign)
    value = jax.lax.mul(jax.lax.bitcast_convert_type(bits, jnp.float32), scale)
  else:
    level = _floatlike_levels(k) if code.floatlike else _lookup(k, code.levels)
    value = jax.lax.mul(level, scale)
    # A product below float32's normals would flush to zero: keep it positive.
    # On the int32 bits (the product is not negative): one instruction, where
    # float32's NaN-propagating maximum takes three.
    bits = jax.lax.max(_int32_bits(value), np.int32(_TINY.view(np.int32)))
    value = jax.lax.bitcast_convert_type(bits, jnp.float32)
    value = jax.lax.select(jax.lax.gt(k, np.int32(0)), value, jnp.zeros_like(value))
  if layout.tail:
    last = value.ndim - 1
    at_tail = jax.lax.eq(
      jax.lax.broadcasted_iota(jnp.int32, value.shape, last), np.int32(layout.body)
    )
    tail = jax.lax.broadcast_in_dim(tail, value.shape, tuple(range(value.ndim)))
    value = jax.lax.select(at_tail, tail, value)
  return value
