"""The 4-bit moment codes, two a byte, on :mod:`mpx._src.moment_codes`' block core
(docs/moment_codes.md, "4 bits")."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import compat, lowering, rounding
from mpx._src import moment_codes as core
from mpx._src.moment_codes import SIGNS, Sign, sign_of  # noqa: F401 (SIGNS: read here too)
from mpx._src.states import Nonnegative4bitMoment, Signed4bitMoment

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

# The nonnegative code is float-like: level ``k >= 1`` is the float32 whose bits
# are ``(k + _FLOAT_BASE) << _FLOAT_SHIFT`` (one mantissa bit: ``2**-7`` is
# ``240 << 22``, 1.0 is ``254 << 22``), coded and decoded on the bits.
_FLOAT_SHIFT = 22
_FLOAT_BASE = 239
# Its levels, index = the code: 0 (only for x <= 0), then 15 levels up to 1.0:
# 2**-7, 0.0117, 2**-6, ..., 0.375, 0.5, 0.75, 1.
NONNEGATIVE_LEVELS = (
  np.concatenate([[0], np.arange(_FLOAT_BASE + 1, _FLOAT_BASE + 16) << _FLOAT_SHIFT])
  .astype(np.int32)
  .view(np.float32)
)

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
  return core._fit_blocks(n, MAX_BLOCK, (range(MAX_BLOCK // 2 + 2, MAX_BLOCK + 1, 2),))


class _Layout(NamedTuple):
  """Where a leaf puts its elements: the first ``body`` (even) of each row in
  ``blocks`` blocks of ``size`` along the last axis, then ``tail`` (0 or 1) last
  element stored in float32; codes packed ``per`` together: 8, a uint32 word,
  where every block's codes fill whole words (so that a shard of the last axis
  on block boundaries holds whole words), else 2, a byte."""

  lead: tuple[int, ...]
  n: int
  body: int
  size: int
  blocks: int
  tail: int
  per: int

  @classmethod
  def of(cls, shape: tuple[int, ...]) -> _Layout:
    """The layout of a float32 leaf of ``shape``."""
    *lead, n = shape
    body = n - n % 2
    size, blocks = block_layout(body)
    per = 8 if size % 8 == 0 and body % 8 == 0 else 2
    return cls(tuple(lead), n, body, size, blocks, n % 2, per)

  @classmethod
  def of_codes(cls, codes_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> _Layout:
    """The layout whose codes and scales have these shapes: ``n`` is odd where
    the scales hold one more entry a row than the blocks."""
    *lead, pairs = codes_shape
    _, blocks = block_layout(2 * pairs)
    if tuple(scales_shape[:-1]) != tuple(lead) or scales_shape[-1] not in (blocks, blocks + 1):
      raise ValueError(
        f"scales of shape {scales_shape} do not match codes of shape {codes_shape}: expected "
        f"{(*lead, blocks)} (an even last axis) or {(*lead, blocks + 1)} (an odd one)"
      )
    return cls.of((*lead, 2 * pairs + scales_shape[-1] - blocks))


def _spread(scales: jax.Array, size: int, n: int) -> jax.Array:
  """Each block's scale broadcast to its ``size`` elements, the first ``n`` of a row kept."""
  return core._unblocked(jnp.broadcast_to(scales[..., None], (*scales.shape, size)), n)


def _check(shape: tuple[int, ...], sign: str) -> None:
  """Refuses an unknown sign, and a leaf with no axis or no element."""
  core._check_sign(sign)
  if not shape or math.prod(shape) == 0:
    raise ValueError(f"4-bit codes take a leaf of one or more axes and elements, got {shape}")


def stored_shapes(shape: tuple[int, ...], sign: Sign) -> FourBitMoment:
  """Returns the stored form of a float32 leaf of ``shape`` as
  ``jax.ShapeDtypeStruct``s in the stored type of ``sign``."""
  shape = tuple(shape)
  _check(shape, sign)
  layout = _Layout.of(shape)
  codes: Any = jax.ShapeDtypeStruct((*layout.lead, layout.body // 2), jnp.uint8)
  scales: Any = jax.ShapeDtypeStruct((*layout.lead, layout.blocks + layout.tail), jnp.float32)
  return STORED_TYPES[sign](codes, scales)


# --- Coding -------------------------------------------------------------------


def maxima(x: jax.Array, sign: Sign) -> jax.Array:
  """Returns the scales :func:`encode` computes for ``x``, as its ``scales=``
  argument takes them, for either sign: float32, ``(*lead, n_blocks + n %
  2)``, each row's block maxima (the largest magnitude, signed; the largest
  value, at least 0, nonnegative), then for an odd row its last element as
  stored. Along the last axis only: nothing is reduced across rows."""
  x = jnp.asarray(x, jnp.float32)
  _check(x.shape, sign)
  layout = _Layout.of(x.shape)
  blocked = core._blocked(x[..., : layout.body], layout.size, layout.blocks)
  if layout.per == 8:
    # A moment decoded from words (``_unpack``) in here reads a word a vector.
    scales = core._block_max(blocked, (x.ndim,), sign == "signed")
  else:
    # Each block as (size / 2) pairs: the reduction's inner loops then run
    # over a pair and over the bytes, which it reads a vector at a time.
    pairs = blocked.reshape((*blocked.shape[:-1], layout.size // 2, 2))
    scales = core._block_max(pairs, (x.ndim, x.ndim + 1), sign == "signed")
  return _with_tail(scales, x, sign, layout)


def _with_tail(scales: jax.Array, x: jax.Array, sign: Sign, layout: _Layout) -> jax.Array:
  """``scales``' first ``layout.blocks`` per row then, for an odd row, its last
  element as stored: itself, signed; nonnegative, at least the smallest normal
  if positive (read from the bits, so that a positive subnormal counts even
  where the hardware flushes it to zero), 0 if not positive."""
  if not layout.tail:
    return scales
  tail = x[..., layout.body :]
  if sign == "nonnegative":
    kept = jax.lax.max(tail, jnp.full_like(tail, core._TINY))
    positive = jax.lax.gt(core._int32_bits(tail), np.int32(0))
    tail = jax.lax.select(positive, kept, jnp.zeros_like(tail))
  return jnp.concatenate([scales[..., : layout.blocks], tail], axis=-1)


def encode(
  x: jax.Array,
  sign: Sign,
  key: jax.Array,
  step: jax.Array,
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
  key = core._salted(key, f"4bit {sign}")
  layout = _Layout.of(x.shape)
  if scales is None:
    block_max = maxima(x, sign)
  else:
    block_max = jnp.asarray(scales, jnp.float32)
    expected = (*layout.lead, layout.blocks + layout.tail)
    if block_max.shape != expected:
      raise ValueError(f"scales of shape {block_max.shape}, expected {expected}")
    block_max = _with_tail(block_max, x, sign, layout)
  if not layout.body:
    codes = jnp.zeros((*layout.lead, 0), jnp.uint8)
  else:
    scale = _spread(block_max[..., : layout.blocks], layout.size, layout.body)
    codes = _codes(sign, x[..., : layout.body], scale, key, step, x.shape)
    # On accelerators (the same bytes) by a bitcast of uint4 pairs, the view in
    # which the step reads and keeps the codes, so that XLA:GPU writes them in
    # place (docs/design.md, "Compressed moments at the byte floor").
    pack = functools.partial(_pack, per=layout.per)
    codes = lowering.by_platform(codes, cpu=pack, accelerator=_pack_by_bitcast)
  return STORED_TYPES[sign](codes, block_max)


def _codes(
  sign: Sign,
  v: jax.Array,
  scale: jax.Array,
  key: jax.Array,
  step: jax.Array,
  shape: tuple[int, ...],
) -> jax.Array:
  """The int32 code of each element of the body ``v`` against its block's
  ``scale`` (broadcast to ``v``'s shape), rounded at random; random bits drawn
  for a leaf of ``shape``. Elementwise: one loop fusion with the packing.

  The ratio ``|v| / scale`` (a scale of 0 divides by 1) is not clamped: a scale
  below the magnitude gives a ratio above 1, which the rounding takes to the
  top level, never a wrap. A true division, so that a block's largest element
  gives exactly 1; the select is per element, after the broadcast, so that
  XLA does not turn the division by a broadcast into a product by a
  reciprocal. Of |v| for either sign: a value that is not positive is zeroed
  below under the nonnegative code. (Dividing v itself, XLA:CPU writes v out
  in float32 instead of fusing its computation, e.g. Adam's new moment, in
  here.)"""
  magnitude = jax.lax.abs(v)
  safe = jax.lax.select(jax.lax.gt(scale, np.float32(0)), scale, jnp.ones_like(scale))
  a = jax.lax.div(magnitude, safe)
  # The top bits of each element's random bits: 24 for a uniform float (signed),
  # _FLOAT_SHIFT to add below the float-like code's mantissa bit. Via int32:
  # uint32 to float32 does not vectorize on CPU.
  random = rounding.random_bits(key, jnp.asarray(step, jnp.int32), shape)
  if shape[-1] != v.shape[-1]:
    random = jax.lax.slice_in_dim(random, 0, v.shape[-1], axis=len(shape) - 1)
  top = 24 if sign == "signed" else _FLOAT_SHIFT
  random = jax.lax.shift_right_logical(random, np.uint32(32 - top)).astype(jnp.int32)
  if sign == "signed":
    index = _round(a, SIGNED_LEVELS, jax.lax.mul(random.astype(jnp.float32), np.float32(2.0**-24)))
    negative = jax.lax.bitwise_and(jax.lax.lt(v, np.float32(0)), jax.lax.gt(index, np.int32(0)))
    sign_bit = jax.lax.mul(negative.astype(jnp.int32), np.int32(_SIGN_BIT))
    return jax.lax.bitwise_or(index, sign_bit)
  # The float-like code: the random bits added below the one mantissa bit kept
  # (they round up with probability ``(a - low) / (high - low)``), then the
  # exponent and that bit read as the code; below ``2**-7`` (an ``a`` that
  # underflowed included) to the smallest level, never to zero, above 1 to the
  # top. 0 only for v <= 0, read from the bits (a positive subnormal counts).
  rounded = jax.lax.shift_right_arithmetic(
    jax.lax.add(core._int32_bits(a), random), np.int32(_FLOAT_SHIFT)
  )
  t = jax.lax.clamp(np.int32(_FLOAT_BASE + 1), rounded, np.int32(_FLOAT_BASE + 15))
  index = jax.lax.sub(t, np.int32(_FLOAT_BASE))
  positive = jax.lax.gt(core._int32_bits(v), np.int32(0))
  return jax.lax.select(positive, index, jnp.zeros_like(index))


def _round(a: jax.Array, levels: np.ndarray, u: jax.Array) -> jax.Array:
  """The index of ``a`` (at least 0) among ``levels`` (ascending, from 0 to 1;
  above 1, the top): the one below or above with probabilities proportional
  to the distance to the other (unbiased), for ``u`` uniform in [0, 1).

  A count of the thresholds ``levels[k - 1] + u * (levels[k] - levels[k -
  1])`` that ``a`` reaches, which ``a`` in ``[levels[j], levels[j + 1])``
  reaches for every ``k <= j`` and, for ``k = j + 1``, with probability ``(a -
  levels[j]) / (levels[j + 1] - levels[j])``. Compared as int32 bits
  (non-negative floats order as their bits), so that ``a`` has one user,
  which XLA fuses its division into."""
  bits = core._int32_bits(a)
  index = jnp.zeros(a.shape, jnp.int32)
  for low, high in itertools.pairwise(levels):
    threshold = jax.lax.add(jax.lax.mul(u, np.float32(high - low)), np.float32(low))
    index = jax.lax.add(index, jax.lax.ge(bits, core._int32_bits(threshold)).astype(jnp.int32))
  return index


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


def _pack_by_bitcast(codes: jax.Array) -> jax.Array:
  """``_pack(codes)`` as a bitcast of uint4 pairs: element ``2i`` in the low
  nibble of byte ``i`` (XLA's order for a bitcast to a wider type)."""
  *lead, n = codes.shape
  pairs = codes.astype(jnp.uint4).reshape((*lead, n // 2, 2))
  return jax.lax.bitcast_convert_type(pairs, jnp.uint8)


def kept_codes(applied: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  """Returns the packed codes ``new`` where ``applied``, else ``old``, selected as
  uint4 pairs: XLA:GPU then fuses the select into the kernel that codes
  ``new`` (packed by ``_pack_by_bitcast``) and writes it in place, where a
  select of the packed bytes is a kernel of its own that reads the new codes
  back from scratch (docs/design.md, "Compressed moments at the byte floor")."""
  new, old = (jax.lax.bitcast_convert_type(c, jnp.uint4) for c in (new, old))
  codes = jnp.where(applied, new, old)
  return jax.lax.bitcast_convert_type(codes, jnp.uint8)


# --- Decoding -----------------------------------------------------------------


def decode(stored: FourBitMoment) -> jax.Array:
  """Returns the float32 leaf that ``stored`` codes, in the shape that was
  encoded: each level times its scale, in the code its type names."""
  signed = sign_of(stored) == "signed"
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
    scale = _spread(scales, layout.size, layout.n)
  else:
    # On accelerators by a bitcast to uint4 pairs, the view in which
    # ``kept_codes`` selects the new codes: read and written alike, XLA writes
    # the new codes over the old ones in place (read as bytes, it copies).
    unpack = functools.partial(_unpack, per=layout.per)
    k = lowering.by_platform(codes, cpu=unpack, accelerator=_unpack_by_bitcast)
    scale = _spread(scales[..., : layout.blocks], layout.size, layout.body)
  if signed:
    magnitude = _lookup(jax.lax.bitwise_and(k, np.int32(_SIGN_BIT - 1)), SIGNED_LEVELS)
    # The code's sign bit moves to float32's: -level, exactly.
    sign = jax.lax.shift_left(jax.lax.bitwise_and(k, np.int32(_SIGN_BIT)), np.int32(28))
    bits = jax.lax.bitwise_or(core._int32_bits(magnitude), sign)
    value = jax.lax.mul(jax.lax.bitcast_convert_type(bits, jnp.float32), scale)
  else:
    # The float-like level from the code's bits (code 0 gives a tiny positive
    # float, zeroed below).
    bits = jax.lax.shift_left(jax.lax.add(k, np.int32(_FLOAT_BASE)), np.int32(_FLOAT_SHIFT))
    value = jax.lax.mul(jax.lax.bitcast_convert_type(bits, jnp.float32), scale)
    value = _at_least_tiny(value, k)
  if layout.tail:
    last = value.ndim - 1
    at_tail = jax.lax.eq(
      jax.lax.broadcasted_iota(jnp.int32, value.shape, last), np.int32(layout.body)
    )
    tail = jax.lax.broadcast_in_dim(tail, value.shape, tuple(range(value.ndim)))
    value = jax.lax.select(at_tail, tail, value)
  return value


def _at_least_tiny(value: jax.Array, k: jax.Array) -> jax.Array:
  """A nonnegative ``value`` kept at least float32's smallest normal (a product
  below it would flush to zero), and 0 where its code ``k`` is 0. On the int32
  bits (the product is not negative): one instruction, where float32's
  NaN-propagating maximum takes three."""
  bits = jax.lax.max(core._int32_bits(value), np.int32(core._TINY.view(np.int32)))
  value = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return jax.lax.select(jax.lax.gt(k, np.int32(0)), value, jnp.zeros_like(value))


def decode_by_table(stored: FourBitMoment) -> jax.Array:
  """Returns :func:`decode`'s values, bitwise, each code's level looked up in a
  table of 16 (an odd last axis: :func:`decode` itself).

  A gather that XLA:GPU fuses as a cheap producer into a reduction over the
  moment computed from it, where the selects of :func:`decode`'s signed levels
  tip its cost model into writing that moment out in float32; its gather
  keeps XLA from writing codes in place, so it serves a pass that writes no
  codes (docs/design.md, "Compressed moments at the byte floor").
  """
  signed = sign_of(stored) == "signed"
  codes = jnp.asarray(stored.codes)
  scales = jnp.asarray(stored.scales, jnp.float32)
  layout = _Layout.of_codes(codes.shape, scales.shape)
  if layout.tail or not layout.body:
    return decode(stored)
  unpack = functools.partial(_unpack, per=layout.per)  # as in decode
  k = lowering.by_platform(codes, cpu=unpack, accelerator=_unpack_by_bitcast)
  scale = _spread(scales[..., : layout.blocks], layout.size, layout.body)
  # Signed: index = the code, its low 3 bits the magnitude, the 4th the sign.
  table = np.concatenate([SIGNED_LEVELS, -SIGNED_LEVELS]) if signed else NONNEGATIVE_LEVELS
  value = jax.lax.mul(compat.lookup(table.astype(np.float32), k), scale)
  return value if signed else _at_least_tiny(value, k)


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
