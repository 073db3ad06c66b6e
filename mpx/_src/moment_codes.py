"""The moment codes (docs/moment_codes.md) and the kinds that store one leaf of
the inner state in them: as it is, in bfloat16, or in a signed or nonnegative
code of 8 or 4 bits against a float32 word per block along the last axis (a
scale, or the 4-bit nonnegative code's range). One block core (the layout,
the block maxima, the words spread to their elements) serves both
block-scaled codes; each keeps its own levels."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Literal, NamedTuple, Protocol, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import rounding
from mpx._src import tree as tree_lib
from mpx._src.states import (
  Bfloat16Moment,
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
FourBitMoment: TypeAlias = Signed4bitMoment | Nonnegative4bitMoment
# The stored type of each sign's code.
STORED_TYPES: dict[Sign, type[EightBitMoment]] = {
  "signed": Signed8bitMoment,
  "nonnegative": Nonnegative8bitMoment,
}
STORED_TYPES_4BIT: dict[Sign, type[FourBitMoment]] = {
  "signed": Signed4bitMoment,
  "nonnegative": Nonnegative4bitMoment,
}

# 8-bit blocks hold at most this many elements; ``block_layout`` prefers one in
# (MAX_BLOCK / 2, MAX_BLOCK] and accepts one down to MIN_BLOCK that divides.
MAX_BLOCK = 256
MIN_BLOCK = 32
# 4-bit blocks hold at most this many elements along the last axis;
# ``block_layout(shape, 4)`` prefers an even size in (MAX_BLOCK_4BIT / 2,
# MAX_BLOCK_4BIT] that divides.
MAX_BLOCK_4BIT = 128
# The shortest last axis for which the 4-bit code pays: a row of n <= 128
# elements costs n // 2 bytes of codes, 4 of its block's scale and, for an odd
# n, 4 more for its last element (in float32), against bfloat16's 2 n. That is
# less from n = 4 (6 bytes against 8) but for n = 5 (10 against 10), and for
# every n >= 6 (7 against 12; 11 against 14 for n = 7; under 0.6 bytes an
# element past 128). Shorter rows are for bfloat16, as
# ``moments.MIN_ROW_8BIT`` routes them for the 8-bit code.
MIN_ROW_4BIT = 6

_ONE_BITS = 0x3F800000  # bits of float32 1.0
_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32
# Salts xored into the caller's key (None: the kind's): independent bits per
# format and sign.
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


def block_layout(shape: tuple[int, ...], bits: int = 8) -> tuple[int, int]:
  """Returns the ``(block_size, n_blocks)`` of a leaf of ``shape`` in the code
  of ``bits`` (8 or 4), blocks along its last axis.

  8 bits: a scalar is one row of one element; a last axis of at most
  ``MAX_BLOCK`` is one block; a longer one takes the divisor in (128, 256]
  (else in [32, 128]) that leaves the block count with the most factors of
  two, then the largest: 4096 gives 16 blocks of 256, 768 gives 4 of 192,
  11008 gives 64 of 172, 32000 gives 128 of 250, so sharding the axis 2, 4,
  8... ways (up to the block count) splits it on block boundaries. With no
  such divisor (50257, 4097) the axis is cut into ``ceil(n / 256)`` blocks of
  ``ceil(n / n_blocks)``, the last one short.

  4 bits: the blocks hold a row's first ``n - n % 2`` elements (an odd last
  one is stored apart): one block up to ``MAX_BLOCK_4BIT``; else the even
  divisor in (64, 128], chosen as above (4096: 32 blocks of 128; 768: 8 of
  96; 11008: 128 of 86; 50256: 698 of 72); else ``ceil(n / 128)`` blocks of
  an even size, the last short (4098: 33 of 126). Smaller divisors would
  cost more in scales than 4-bit codes save.
  """
  n = shape[-1] if shape else 1
  if bits == 4:
    n -= n % 2
    if n <= MAX_BLOCK_4BIT:
      return n, 1 if n else 0
    return _fit_blocks(n, MAX_BLOCK_4BIT, (range(MAX_BLOCK_4BIT // 2 + 2, MAX_BLOCK_4BIT + 1, 2),))
  if n <= MAX_BLOCK:
    return n, 1
  sizes = (range(MAX_BLOCK // 2 + 1, MAX_BLOCK + 1), range(MIN_BLOCK, MAX_BLOCK // 2 + 1))
  return _fit_blocks(n, MAX_BLOCK, sizes)


def _spread(scales: jax.Array, shape: tuple[int, ...], size: int) -> jax.Array:
  """Broadcasts each block's scale (``scales``' last axis) to its ``size``
  elements, in ``shape`` (each row's first ``shape[-1]`` kept, a scalar one
  element), so that a kernel rewriting the codes reads the old ones where it
  writes."""
  *lead, blocks = scales.shape
  n = shape[-1] if shape else 1
  wide = jax.lax.broadcast_in_dim(scales, (*lead, blocks, size), range(len(lead) + 1))
  # The blocks merged, the last one's padding dropped.
  wide = wide.reshape((*lead, blocks * size))
  if blocks * size != n:
    wide = jax.lax.slice_in_dim(wide, 0, n, axis=len(lead))
  return wide.reshape(shape)


def _max_and_min(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """The signed block maxima's reduction: the larger of the first pair, the
  smaller of the second (``tree.elementwise_max`` takes the larger of both)."""
  return jax.lax.max(a[0], b[0]), jax.lax.min(a[1], b[1])


def _blocked(
  x: jax.Array, size: int, blocks: int, pairs: bool
) -> tuple[jax.Array, tuple[int, ...]]:
  """Returns ``x`` cut into ``blocks`` of ``size`` along its last axis (the last
  zero-padded where they do not tile) and the axes that reduce a block; with
  ``pairs``, each block read as ``size / 2`` pairs."""
  pad = size * blocks - x.shape[-1]
  if pad:
    x = jax.lax.pad(x, np.zeros((), x.dtype), [(0, 0, 0)] * (x.ndim - 1) + [(0, pad, 0)])
  x = x.reshape((*x.shape[:-1], blocks, size))
  if pairs:
    return x.reshape((*x.shape[:-1], size // 2, 2)), (x.ndim - 1, x.ndim)
  return x, (x.ndim - 1,)


def _block_max(
  x: jax.Array, size: int, blocks: int, signed: bool, pairs: bool = False
) -> jax.Array:
  """Returns the largest magnitude (signed) or value (nonnegative), at least 0,
  of each block of ``size`` along ``x``'s last axis, cut as :func:`_blocked`
  cuts it. One two-result reduction, which XLA:CPU fuses the moment's
  computation into (docs/moment_codes.md)."""
  x, axes = _blocked(x, size, blocks, pairs)
  zero = np.float32(0)
  reducer = _max_and_min if signed else tree_lib.elementwise_max
  largest, other = jax.lax.reduce((x, x), (zero, zero), reducer, axes)
  return jax.lax.max(largest, jax.lax.neg(other) if signed else other)


def lookup(table: np.ndarray, index: jax.Array) -> jax.Array:
  """Returns ``table[index]`` for a small constant table (indices clipped), in
  ``index``'s sharding. Under explicit sharding (types that carry mesh axes,
  jax >= 0.6) a gather from the replicated table must be told its output's
  sharding; older jax has no such types. Pinned by
  tests/test_containers.py::test_nnx_optimizer_state_is_sharded_like_the_params_on_a_mesh."""
  values = jnp.asarray(table)
  typeof = getattr(jax, "typeof", None)
  sharding = None if typeof is None else getattr(typeof(index), "sharding", None)
  if any(axis is not None for axis in getattr(sharding, "spec", ())):
    return values.at[index].get(mode="clip", out_sharding=sharding)
  return jnp.take(values, index, mode="clip")


# --- The 8-bit levels --------------------------------------------------------------


class _Code(NamedTuple):
  """A float-like code of magnitudes in [0, 1] (docs/moment_codes.md): ``(low_bits,
  low_code, shift)`` per region of levels, from the top, as :func:`_float_code`
  lays them out. Region ``r`` codes float32 ``bits`` in ``[low_bits, next
  region's low_bits)`` as ``low_code + ((bits - low_bits) >> shift)``."""

  signed: bool
  layout: tuple[tuple[int, int, int], ...]


def _float_code(signed: bool, regions: tuple[tuple[int, int], ...]) -> _Code:
  """Lays out the 8-bit code's nonzero levels (127 signed, 255 nonnegative)
  counted down from 1.0 over ``regions`` of ``(octaves, mantissa bits)``, the
  last taking the levels left."""
  top = 127 if signed else 255
  upper_bits, upper_code = _ONE_BITS, top
  layout = []
  for i, (octaves, mantissa) in enumerate(regions):
    shift = 23 - mantissa
    n_levels = upper_code - 1 if i == len(regions) - 1 else octaves << mantissa
    upper_bits, upper_code = upper_bits - (n_levels << shift), upper_code - n_levels
    layout.append((upper_bits, upper_code, shift))
  if upper_code != 1 or upper_bits <= 0x00800000:
    raise ValueError(f"regions {regions} leave no room for {top} levels")
  return _Code(signed, tuple(layout))


# More levels near the block's largest, where most elements of a moment sit;
# 8 per octave below for the range (docs/moment_codes.md).
CODES: dict[Sign, _Code] = {
  "signed": _float_code(True, ((3, 4), (0, 3))),  # 48 + 79 levels, down to 2**-12.68
  "nonnegative": _float_code(False, ((1, 6), (2, 4), (0, 3))),  # 64 + 32 + 159, to 2**-22.68
}


def level_table(sign: Sign, code: _Code | None = None) -> np.ndarray:
  """Returns the float32 level of each of the 256 codes of ``sign`` (or of any
  float-like ``code``) at scale 1, the sign bit applied: what
  :meth:`EightBitCompressed.decompress` computes, as a table (numpy)."""
  if sign not in SIGNS:
    raise ValueError(f"sign must be one of {SIGNS}, got {sign!r}")
  code = CODES[sign] if code is None else code
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


_LEVEL_TABLES = {sign: level_table(sign) for sign in SIGNS}


def _float_level(bits: jax.Array, x: jax.Array, code: _Code, random: jax.Array) -> jax.Array:
  """Returns the int32 level in the float-like ``code`` of each ratio to its
  scale in [0, 1], given as its float32 ``bits``: the level below or above,
  at random by the uint32 ``random`` bits, with probability proportional to
  the distance to the other (unbiased). Below the lowest level: signed, to
  it with probability ``ratio / lowest``, else to 0; nonnegative, to it
  where the value coded, ``x``, is positive (even where its ratio to the
  scale underflowed), never to 0."""
  zero = np.float32(0)
  layout = code.layout
  # In region r, level = base + ((bits - low + noise) >> shift), which is
  # (bits + noise + (base << shift) - low) >> shift: an offset and a shift,
  # each element's those of the first region (from the top) whose ``low`` it
  # reaches. full_like, not full: under explicit sharding it takes bits'.
  columns = []
  for values in ([(c << sh) - low for low, c, sh in layout], [sh for _, _, sh in layout]):
    column = jnp.full_like(bits, values[-1], jnp.int32)
    for (low, _, _), entry in zip(layout[-2::-1], values[-2::-1], strict=True):
      inside = jax.lax.ge(bits, np.int32(low))
      column = jax.lax.select(inside, jnp.full_like(bits, entry, jnp.int32), column)
    columns.append(column)
  offset, shift = columns
  one = np.int32(1)
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
    small = jax.lax.gt(bits, jax.lax.bitcast_convert_type(threshold, jnp.int32))
  else:
    # Never to zero: a positive value below the smallest level takes it, even
    # one whose ratio to the scale underflowed (so test x, not a).
    small = jax.lax.gt(x, zero)
  below = jax.lax.lt(bits, np.int32(layout[-1][0]))
  level = jax.lax.select(below, small.astype(jnp.int32), level)
  return level


def _float_level_bits(magnitude: jax.Array, code: _Code) -> jax.Array:
  """Returns the float32 bits (int32) of the level of each int32 code
  ``magnitude`` (its sign bit cleared) in the float-like ``code``, at scale 1:
  what :func:`_float_level` rounded to (a positive float also for
  ``magnitude`` 0, which the caller zeroes)."""
  layout = code.layout
  # In region r, bits = low + ((k - base) << shift) = (low - (base << shift)) +
  # (k << shift): the offset and shift of the first region (from the top)
  # whose ``base`` the code's magnitude reaches, as in :func:`_float_level`.
  columns = []
  for values in ([low - (c << sh) for low, c, sh in layout], [sh for _, _, sh in layout]):
    column = jnp.full_like(magnitude, values[-1], jnp.int32)
    for (_, c, _), entry in zip(layout[-2::-1], values[-2::-1], strict=True):
      inside = jax.lax.ge(magnitude, np.int32(c))
      column = jax.lax.select(inside, jnp.full_like(magnitude, entry, jnp.int32), column)
    columns.append(column)
  offset, shift = columns
  return jax.lax.add(offset, jax.lax.shift_left(magnitude, shift))


# --- The 4-bit levels and packing ------------------------------------------------

_SIGN_BIT = 8  # the signed 4-bit code's sign, above its 3-bit magnitude


# The signed 4-bit code's magnitudes, index = the code's low 3 bits: ``(j /
# 7) ** 2`` for j = 0 .. 7 (0, 0.020, 0.082, 0.184, 0.327, 0.510, 0.735, 1):
# closer together near the top, where most of a block's elements sit, than
# the paper's dynamic-exponent map's (0.0062, 0.037, 0.087, 0.24, 0.49,
# 0.75, 1), they hold Adam's direction closer to float32's on three of the
# four streams of benchmarks/moment_codes_4bit_error.py (docs/moment_codes.md,
# "4 bits").
SIGNED_LEVELS_4BIT = ((np.arange(8) / 7.0) ** 2).astype(np.float32)

# The nonnegative 4-bit code's levels: 15 spread evenly in the float32 bits
# (a piecewise-linear logarithm) from each block's largest value down to its
# smallest positive one, held at least about 2**-9 of the largest (the floor,
# which a tiny second moment is raised to: never zero, which would make
# Adam's step blow up). Fixed fractions of the largest a quarter to a half
# apart held ``nu`` 20% high; a block of near-equal values (near-Gaussian
# gradients') now gets levels under 1% apart (docs/moment_codes.md, "4
# bits"). Both ends fit the block's float32 word, in the place and bytes of
# the other codes' scale (``Nonnegative4bitMoment.ranges``):
# - its high bits: the top level, the largest value rounded up to 11
#   mantissa bits (``_TOP_BITS``), at least float32's smallest normal; so
#   the word read as a float is within 2**-11 above the block's largest;
# - the low 12 bits: the step between levels in float32 bits, in units of
#   1/4096 octave (``2**_STEP_SHIFT`` bits), rounded up so that the lowest
#   level is at most the smallest positive value, at most ``_MAX_STEP`` (the
#   floor) and so that the lowest level stays a normal float.
# Coding and decoding are integer arithmetic, with no log2 or exp2: in one
# kernel with the moment's computation those tipped XLA:GPU into writing the
# moment out in float32; and with no integer division, which XLA:CPU writes
# out. A coarser step costs fidelity: at 1/8 octave between ends, the levels
# jump as a block's range crosses a step and every element rounds anew.
LEVELS_4BIT = 15
_TOP_BITS = np.int32(0x7FFFF000)
_STEP_BITS = np.int32(0xFFF)
_STEP_SHIFT = 11
_SPAN_UNIT = (LEVELS_4BIT - 1) << _STEP_SHIFT  # the bits from lowest to top per unit of step
_MAX_STEP = (9 << 23) // _SPAN_UNIT  # 2633: the lowest level 2**-8.9996 of the top
_TINY_BITS = np.int32(_TINY.view(np.int32))
_LARGEST_TOP = np.int32(0x7F7FF000)  # the largest finite float with 11 mantissa bits
_INT32_MAX = np.int32(2**31 - 1)


def _complement(value: jax.Array) -> jax.Array:
  """int32 ``2**31 - 1 - bits(value)`` where ``value`` is positive (read from its
  bits, so that a subnormal counts), else 0: the largest of a block's is its
  smallest positive value's, so that one max reduction takes both ends."""
  bits = jax.lax.bitcast_convert_type(value, jnp.int32)
  return jax.lax.select(
    jax.lax.gt(bits, np.int32(0)), jax.lax.sub(_INT32_MAX, bits), jnp.zeros_like(bits)
  )


def range_words(high: jax.Array, complement: jax.Array) -> jax.Array:
  """Returns each block's float32 word (see ``LEVELS_4BIT``) from its largest
  value ``high`` (at least 0) and the largest :func:`_complement` of its
  elements (0: none is positive, and its step is 0)."""
  top = jax.lax.add(jax.lax.bitcast_convert_type(high, jnp.int32), np.int32(0xFFF))
  top = jax.lax.clamp(_TINY_BITS, jax.lax.bitwise_and(top, _TOP_BITS), _LARGEST_TOP)
  low = jax.lax.sub(_INT32_MAX, complement)
  # Rounded up (the lowest level at most the smallest positive value), then
  # clipped: to 0 where none is positive (low is then above top), to the
  # floor, and so that the lowest level stays a normal float. (Divisions of a
  # value per block.)
  unit = np.int32(_SPAN_UNIT)
  step = jax.lax.div(jax.lax.add(jax.lax.sub(top, low), np.int32(_SPAN_UNIT - 1)), unit)
  room = jax.lax.div(jax.lax.sub(top, _TINY_BITS), unit)
  step = jax.lax.clamp(np.int32(0), step, jax.lax.min(room, np.int32(_MAX_STEP)))
  return jax.lax.bitcast_convert_type(jax.lax.bitwise_or(top, step), jnp.float32)


def _range_fields(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns ``(top, step)`` of float32 ``words``: the top level's float32 bits
  and the bits between levels (int32)."""
  bits = jax.lax.bitcast_convert_type(words, jnp.int32)
  step = jax.lax.shift_left(jax.lax.bitwise_and(bits, _STEP_BITS), np.int32(_STEP_SHIFT))
  return jax.lax.bitwise_and(bits, _TOP_BITS), step


def _range_code(body: jax.Array, words: jax.Array, size: int, u: jax.Array) -> jax.Array:
  """Returns the int32 code, 1 to 15, of each element of ``body`` (float32) among
  its block's levels (``words``, one a block of ``size``): the level at or
  below its float32 bits, or the one above with probability proportional to
  the bits' distance to it, for ``u`` uniform in [0, 1) (unbiased in the
  bits, so nearly in the logarithm); 0 where ``body`` is not positive. Below
  the lowest level (a value under the floor) to it, above the top to the top.
  """
  top, step = _range_fields(words)
  base = jax.lax.sub(top, jax.lax.mul(step, np.int32(LEVELS_4BIT - 1)))
  # Levels per bit, per block: a product per element, not a division.
  per_bit = jax.lax.div(np.float32(1), jax.lax.max(step, np.int32(1)).astype(jnp.float32))
  bits = jax.lax.bitcast_convert_type(body, jnp.int32)
  above_base = jax.lax.sub(bits, _spread(base, body.shape, size)).astype(jnp.float32)
  position = jax.lax.add(jax.lax.mul(above_base, _spread(per_bit, body.shape, size)), u)
  position = jax.lax.clamp(np.float32(0), jax.lax.floor(position), np.float32(LEVELS_4BIT - 1))
  code = jax.lax.add(position.astype(jnp.int32), np.int32(1))
  return jax.lax.select(jax.lax.gt(bits, np.int32(0)), code, jnp.zeros_like(code))


class _Layout(NamedTuple):
  """Where a 4-bit leaf puts its elements: the first ``body`` (even) of each row
  in ``blocks`` blocks of ``size`` along the last axis, then ``tail`` (0 or 1)
  last element stored in float32; codes packed ``per`` together: 8, a uint32
  word, where every block's codes fill whole words (so that a shard of the
  last axis on block boundaries holds whole words), else 2, a byte."""

  lead: tuple[int, ...]
  n: int
  body: int
  size: int
  blocks: int
  tail: int
  per: int

  @classmethod
  def of(cls, shape: tuple[int, ...]) -> _Layout:
    """The layout of a float32 leaf of ``shape``; refuses a leaf with no axis or
    no element."""
    if not shape or math.prod(shape) == 0:
      raise ValueError(f"4-bit codes take a leaf of one or more axes and elements, got {shape}")
    *lead, n = shape
    body = n - n % 2
    size, blocks = block_layout((body,), 4)
    per = 8 if size % 8 == 0 and body % 8 == 0 else 2
    return cls(tuple(lead), n, body, size, blocks, n % 2, per)


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
  bits = jax.lax.bitcast_convert_type(a, jnp.int32)
  index = jnp.zeros(a.shape, jnp.int32)
  for low, high in itertools.pairwise(levels):
    threshold = jax.lax.add(jax.lax.mul(u, np.float32(high - low)), np.float32(low))
    reached = jax.lax.ge(bits, jax.lax.bitcast_convert_type(threshold, jnp.int32))
    index = jax.lax.add(index, reached.astype(jnp.int32))
  return index


def _signed(index: jax.Array, negative: jax.Array) -> jax.Array:
  """The signed 4-bit code of a magnitude ``index`` (0 to 7): the sign bit set
  where ``negative`` and the magnitude is not 0."""
  negative = jax.lax.bitwise_and(negative, jax.lax.gt(index, np.int32(0)))
  sign_bit = jax.lax.mul(negative.astype(jnp.int32), np.int32(_SIGN_BIT))
  return jax.lax.bitwise_or(index, sign_bit)


def _select_level(index: jax.Array, table: np.ndarray) -> jax.Array:
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


def _pack_by_bitcast(codes: jax.Array) -> jax.Array:
  """``_pack(codes)`` as a bitcast of uint4 pairs: element ``2i`` in the low
  nibble of byte ``i`` (XLA's order for a bitcast to a wider type)."""
  *lead, n = codes.shape
  pairs = codes.astype(jnp.uint4).reshape((*lead, n // 2, 2))
  return jax.lax.bitcast_convert_type(pairs, jnp.uint8)


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


def _unpack_by_bitcast(codes: jax.Array) -> jax.Array:
  """``_unpack(codes)`` as a bitcast to uint4 pairs (see ``_pack_by_bitcast``)."""
  nibbles = jax.lax.bitcast_convert_type(codes, jnp.uint4)
  return nibbles.reshape((*codes.shape[:-1], 2 * codes.shape[-1])).astype(jnp.int32)


# --- The moment kinds ------------------------------------------------------------


class MomentKind(Protocol):
  """Stores one leaf of the inner state between steps: ``decompress`` before
  the inner rule runs, ``compress`` after it, both inside the skip."""

  @property
  def compressed(self) -> bool:
    """Tells whether what is stored differs from the leaf the inner rule made."""
    ...

  def decompress(self, stored: Any) -> Any:
    """Returns the leaf, as the inner rule made it (float32), from ``stored``."""
    ...

  def compress(self, value: Any, applied_steps: jax.Array) -> Any:
    """Returns the stored form of ``value``; ``applied_steps`` (the count of
    applied steps) draws the random bits."""
    ...


@dataclasses.dataclass(frozen=True)
class Uncompressed:
  """Keeps a leaf of the inner state as the inner rule made it."""

  compressed = False

  def decompress(self, stored: Any) -> Any:
    return stored

  def compress(self, value: Any, applied_steps: jax.Array) -> Any:
    del applied_steps
    return value


UNCOMPRESSED = Uncompressed()


@dataclasses.dataclass(frozen=True)
class Bfloat16Compressed:
  """Stores a float32 leaf as a ``Bfloat16Moment``, rounded stochastically with
  the leaf's ``key``."""

  key: int
  compressed = True

  def decompress(self, stored: Bfloat16Moment) -> jax.Array:
    """Returns the moment in float32 (exact)."""
    return jnp.asarray(stored.values).astype(jnp.float32)

  def compress(self, value: jax.Array, applied_steps: jax.Array, key: Any = None) -> Bfloat16Moment:
    """Rounds ``value`` (float32) to bfloat16, up or down in magnitude at random
    with probability proportional to the distance (unbiased), with ``key``
    (None: the kind's). Magnitudes beyond bfloat16's largest finite value
    saturate at it."""
    x = rounding.canonical(jnp.asarray(value, jnp.float32))
    key = jnp.uint32(self.key) if key is None else key
    key = jax.lax.bitwise_xor(jnp.asarray(key).astype(jnp.uint32), np.uint32(_SALTS["bfloat16"]))
    bits = rounding.random_bits(key, applied_steps, x.shape)
    return Bfloat16Moment(rounding.stochastic_round(x, bits))


@dataclasses.dataclass(frozen=True)
class BlockScaledKind:
  """Stores a float32 leaf in a code of its ``sign`` against a float32 scale per
  block along the last axis, rounded stochastically with the leaf's ``key``:
  the 8- and 4-bit kinds, alike but for their levels and layout. The
  accelerator's step codes them in two passes (``two_pass.first_pass``): the
  new moment's block scales first (:meth:`maxima`, or a joint reduction over
  :meth:`reduced` read by :meth:`scales_of`), then the codes against them
  (:meth:`compress` with ``scales``). docs/design.md, "Compressed moments at
  the byte floor"."""

  key: int
  sign: Sign
  compressed = True
  bits = 0  # the code's width, 8 or 4: what ``block_layout`` lays out

  def block_size(self, shape: tuple[int, ...]) -> int | None:
    """Returns the block size where the blocks tile the last axis exactly (then
    each block's scale is :meth:`scales_of` its :meth:`reduced` maxima), else None."""
    size, blocks = block_layout(shape, self.bits)
    return size if shape and size * blocks == shape[-1] else None

  def maxima(self, value: jax.Array) -> jax.Array:
    """Returns the scales :meth:`compress` would store for ``value``, as
    :meth:`compress` takes them as ``scales``."""
    raise NotImplementedError

  def compress(
    self,
    value: jax.Array,
    applied_steps: jax.Array,
    key: Any = None,
    scales: jax.Array | None = None,
  ) -> Any:
    """Returns the stored form of ``value`` (float32, finite) coded against
    ``scales`` (None: :meth:`maxima`'s, in the same pass); an element above
    its block's scale takes the top level. ``applied_steps`` and ``key``
    (None: the kind's) draw the random bits: the step must change every time
    the leaf is coded anew."""
    raise NotImplementedError

  def decompress(self, stored: Any, by_table: bool = False) -> jax.Array:
    """Returns the float32 leaf that ``stored`` codes: each level times its
    scale. ``by_table``: the same values, bitwise, by a table lookup, a gather
    that XLA:GPU fuses as a cheap producer into a reduction over the moment
    computed from it, where the arithmetic decode's shifts and selects tip
    its cost model into writing that moment out in float32; the gather keeps
    XLA from writing codes in place, so it serves a pass that writes no codes
    (``two_pass.first_pass``; docs/design.md, "Compressed moments at the byte
    floor")."""
    raise NotImplementedError

  def reduced(self, value: jax.Array) -> tuple[jax.Array, ...]:
    """Returns what a block's scale is made from, elementwise: arrays each
    reduced to its largest element per block, at least 0, which
    :meth:`scales_of` takes. Here ``|value|`` (signed) or ``max(value, 0)``
    (nonnegative): the scale is the largest."""
    if self.sign == "signed":
      return (jax.lax.abs(value),)
    return (jax.lax.max(value, jnp.zeros_like(value)),)

  def scales_of(self, maxima: tuple[jax.Array, ...]) -> jax.Array:
    """Returns the blocks' scales from the block maxima of :meth:`reduced`'s
    arrays (for blocks that tile the last axis)."""
    return maxima[0]


@dataclasses.dataclass(frozen=True)
class EightBitCompressed(BlockScaledKind):
  """The 8-bit code (a ``Signed8bitMoment`` or ``Nonnegative8bitMoment``): a
  uint8 level per element, of the float-like code ``CODES[sign]``, and a
  float32 scale per block of :func:`block_layout`."""

  bits = 8

  def maxima(self, value: jax.Array) -> jax.Array:
    """Returns each block's largest magnitude (signed) or largest value, at
    least 0 (nonnegative): float32 ``(*shape[:-1], n_blocks)``."""
    x = jnp.asarray(value, jnp.float32)
    rows = x.reshape((1,)) if x.ndim == 0 else x
    return _block_max(rows, *block_layout(x.shape), self.sign == "signed")

  def compress(
    self,
    value: jax.Array,
    applied_steps: jax.Array,
    key: Any = None,
    scales: jax.Array | None = None,
  ) -> EightBitMoment:
    code = CODES[self.sign]
    x = jnp.asarray(value, jnp.float32)
    shape = x.shape
    given = scales is not None
    if given:
      expected = (*shape[:-1], block_layout(shape)[1]) if x.ndim else (1,)
      scales = jnp.asarray(scales, jnp.float32)
      if scales.shape != expected:
        raise ValueError(f"scales of shape {scales.shape}, expected {expected}")
    key = jnp.uint32(self.key) if key is None else key
    key = jax.lax.bitwise_xor(jnp.asarray(key).astype(jnp.uint32), np.uint32(_SALTS[self.sign]))
    zero = np.float32(0)
    scales = self.maxima(x) if scales is None else scales
    if code.signed:
      magnitude = jax.lax.abs(x)
    else:
      # Negative values (and -0.0, whose int32 bits would wrap below) code as 0.
      magnitude = jax.lax.select(jax.lax.gt(x, zero), x, jnp.zeros_like(x))
    # A true division: the block's largest element becomes exactly 1.0.
    safe = jax.lax.select(scales > zero, scales, jnp.ones_like(scales))
    a = jax.lax.div(magnitude, _spread(safe, shape, block_layout(shape)[0]))
    if given:
      # Scales from another computation of ``x`` (a first pass, which XLA may
      # contract ``a * b + c`` in differently) may sit an ulp below an element:
      # its ratio, above 1, would code past the top level into the sign bit.
      a = jax.lax.min(a, np.float32(1))
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    random = rounding.random_bits(key, applied_steps, shape)
    level = _float_level(bits, x, code, random)
    if code.signed:
      negative = jax.lax.bitwise_and(jax.lax.lt(x, zero), jax.lax.gt(level, np.int32(0)))
      level = jax.lax.bitwise_or(level, jax.lax.shift_left(negative.astype(jnp.int32), np.int32(7)))
    return STORED_TYPES[self.sign](level.astype(jnp.uint8), scales)

  def decompress(self, stored: EightBitMoment, by_table: bool = False) -> jax.Array:
    """Returns the float32 leaf that ``stored`` codes: each level times its
    block's scale; ``by_table``, each level looked up in a table of 256."""
    code = CODES[self.sign]
    codes, scales = jnp.asarray(stored.codes), jnp.asarray(stored.scales)
    shape = codes.shape
    size, blocks = block_layout(shape)
    expected = (*shape[:-1], blocks)
    if scales.shape != expected:
      raise ValueError(
        f"scales of shape {scales.shape} do not match codes of shape {shape}: expected {expected}"
      )
    k = codes.astype(jnp.int32)
    if by_table:
      # A copy per call: JAX lowers one array object used twice as one constant.
      level = lookup(_LEVEL_TABLES[self.sign].copy(), k)
      value = jax.lax.mul(level, _spread(scales, shape, size))
      magnitude = k
      if self.sign == "nonnegative":
        value = jax.lax.max(value, jnp.full_like(value, _TINY))
      else:
        magnitude = jax.lax.bitwise_and(k, np.int32(127))
      return jax.lax.select(jax.lax.eq(magnitude, np.int32(0)), jnp.zeros_like(value), value)
    magnitude = jax.lax.bitwise_and(k, np.int32(127)) if code.signed else k
    bits = _float_level_bits(magnitude, code)
    if code.signed:
      # The sign bit moves to float32's sign bit; the level's bits stay.
      sign = jax.lax.shift_left(jax.lax.shift_right_logical(k, np.int32(7)), np.int32(31))
      bits = jax.lax.bitwise_or(bits, sign)
    level = jax.lax.bitcast_convert_type(bits, jnp.float32)
    value = jax.lax.mul(level, _spread(scales, shape, size))
    if not code.signed:
      # A product below float32's normals would flush to zero: keep it positive.
      value = jax.lax.max(value, jnp.full_like(value, _TINY))
    return jax.lax.select(jax.lax.eq(magnitude, np.int32(0)), jnp.zeros_like(value), value)


@dataclasses.dataclass(frozen=True)
class FourBitCompressed(BlockScaledKind):
  """The 4-bit code (a ``Signed4bitMoment`` or ``Nonnegative4bitMoment``): two
  codes a byte and a float32 word per block of :func:`block_layout` (4 bits),
  then an odd row's last element in float32 (docs/moment_codes.md, "4
  bits"). The word is the signed code's scale, the block's largest
  magnitude, and the nonnegative code's range (``LEVELS_4BIT``). Both round
  stochastically: to nearest, a slow average's steps (Lion's ``mu`` moves 1%
  a step) would fall between the levels and the moment stall."""

  bits = 4

  def reduced(self, value: jax.Array) -> tuple[jax.Array, ...]:
    """As :meth:`BlockScaledKind.reduced`; nonnegative, with
    :func:`_complement`, whose largest is the smallest positive value."""
    parts = super().reduced(value)
    return parts if self.sign == "signed" else (*parts, _complement(value))

  def scales_of(self, maxima: tuple[jax.Array, ...]) -> jax.Array:
    """As :meth:`BlockScaledKind.scales_of`; nonnegative, the words."""
    return super().scales_of(maxima) if self.sign == "signed" else range_words(*maxima)

  def maxima(self, value: jax.Array, block_maxima: jax.Array | None = None) -> jax.Array:
    """Returns float32 ``(*lead, n_blocks + n % 2)``: each row's block words (the
    largest magnitude, signed; the range's word, nonnegative; or the first
    ``n_blocks`` of each row of ``block_maxima``, where given), then for an
    odd row its last element as stored: itself, signed; nonnegative, at least
    the smallest normal if positive (read from the bits, so that a positive
    subnormal counts even where the hardware flushes it to zero), 0 if not
    positive. Along the last axis only: nothing is reduced across rows."""
    x = jnp.asarray(value, jnp.float32)
    layout = _Layout.of(x.shape)
    if block_maxima is None:
      # Blocks of words (8 codes) as they are: a moment decoded from words
      # (``_unpack``) in here reads a word a vector. Else each block as (size /
      # 2) pairs: the reduction's inner loops then run over a pair and over the
      # bytes, which it reads a vector at a time.
      body = x[..., : layout.body]
      pairs = layout.per != 8
      if self.sign == "signed":
        block_maxima = _block_max(body, layout.size, layout.blocks, True, pairs)
      else:
        operands = self.reduced(body)
        blocked = [_blocked(y, layout.size, layout.blocks, pairs) for y in operands]
        zeros = tuple(np.zeros((), y.dtype) for y in operands)
        axes = blocked[0][1]
        maxima = jax.lax.reduce(tuple(b for b, _ in blocked), zeros, tree_lib.elementwise_max, axes)
        block_maxima = self.scales_of(tuple(maxima))
    if not layout.tail:
      return block_maxima
    tail = x[..., layout.body :]
    if self.sign == "nonnegative":
      kept = jax.lax.max(tail, jnp.full_like(tail, _TINY))
      positive = jax.lax.gt(jax.lax.bitcast_convert_type(tail, jnp.int32), np.int32(0))
      tail = jax.lax.select(positive, kept, jnp.zeros_like(tail))
    return jnp.concatenate([block_maxima[..., : layout.blocks], tail], axis=-1)

  def compress(
    self,
    value: jax.Array,
    applied_steps: jax.Array,
    key: Any = None,
    scales: jax.Array | None = None,
    previous: FourBitMoment | None = None,
  ) -> FourBitMoment:
    """As :meth:`BlockScaledKind.compress`; an odd row's last element
    (the last entry of each row of ``scales``) is taken from ``value`` whatever
    is given. The signed code, given the ``previous`` stored moment that
    ``value`` replaces, rounds each element to nearest where that changes its
    code, and stochastically only where nearest would keep the old code (a
    move of less than half a level, which to nearest would stall). The
    nonnegative code rounds stochastically among its block's range levels,
    unbiased in each value's float32 bits (nearly its logarithm) rather than
    in the value; ``scales`` are then its words (:meth:`maxima`'s)."""
    x = jnp.asarray(value, jnp.float32)
    signed = self.sign == "signed"
    layout = _Layout.of(x.shape)
    key = jnp.uint32(self.key) if key is None else key
    salt = np.uint32(_SALTS[f"4bit {self.sign}"])
    key = jax.lax.bitwise_xor(jnp.asarray(key).astype(jnp.uint32), salt)
    if scales is None:
      block_max = self.maxima(x)
    else:
      block_max = jnp.asarray(scales, jnp.float32)
      expected = (*layout.lead, layout.blocks + layout.tail)
      if block_max.shape != expected:
        raise ValueError(f"scales of shape {block_max.shape}, expected {expected}")
      block_max = self.maxima(x, block_max)
    if not layout.body:
      return STORED_TYPES_4BIT[self.sign](jnp.zeros((*layout.lead, 0), jnp.uint8), block_max)
    body = x[..., : layout.body]
    words = block_max[..., : layout.blocks]
    # Each element's random bits, drawn for the whole leaf.
    count = applied_steps
    if not isinstance(count, rounding.StackedCount):
      count = jnp.asarray(count, jnp.int32)
    random = rounding.random_bits(key, count, x.shape)
    if layout.tail:
      random = jax.lax.slice_in_dim(random, 0, layout.body, axis=x.ndim - 1)
    # Their top 24 as a uniform float. Via int32: uint32 to float32 does not
    # vectorize on CPU.
    uniform = jax.lax.shift_right_logical(random, np.uint32(8)).astype(jnp.int32)
    u = jax.lax.mul(uniform.astype(jnp.float32), np.float32(2.0**-24))
    if signed:
      # Each element's code against its block's scale, rounded at random: one
      # loop fusion with the packing. The ratio |body| / scale (a scale of 0
      # divides by 1) may exceed 1 where a given scale sits an ulp below its
      # largest element: each code takes it to the top level, never a wrap. A
      # true division, so that a block's largest element gives exactly 1; the
      # select is per element, after the broadcast, so that XLA does not turn
      # the division by a broadcast into a product by a reciprocal. (Dividing
      # the body itself, XLA:CPU writes it out in float32 instead of fusing its
      # computation, e.g. Adam's new moment, in here.)
      scale = _spread(words, body.shape, layout.size)
      safe = jax.lax.select(jax.lax.gt(scale, np.float32(0)), scale, jnp.ones_like(scale))
      a = jax.lax.div(jax.lax.abs(body), safe)
      negative = jax.lax.lt(body, np.float32(0))
      codes = _signed(_round(a, SIGNED_LEVELS_4BIT, u), negative)
      if previous is not None:
        # Stochastic rounding's noise, which a slow average accumulates, only
        # where to nearest it would stall (docs/moment_codes.md, "4 bits").
        nearest = _signed(_round(a, SIGNED_LEVELS_4BIT, jnp.full_like(u, 0.5)), negative)
        unpack = functools.partial(_unpack, per=layout.per)
        old = tree_lib.by_platform(previous.codes, cpu=unpack, accelerator=_unpack_by_bitcast)
        codes = jax.lax.select(jax.lax.eq(nearest, old), codes, nearest)
    else:
      # Among the block's range levels, unbiased in the float32 bits: each
      # value's logarithm nearly kept on average, not the value, whose noise
      # between levels made Adam's 1 / sqrt(nu) overshoot (docs/moment_codes.md,
      # "4 bits"). Given words (a first pass's, which XLA may compute an ulp
      # apart) an element past either end takes that end's level.
      codes = _range_code(body, words, layout.size, u)
    # On accelerators (the same bytes) by a bitcast of uint4 pairs, the view in
    # which the step reads and keeps the codes, so that XLA:GPU writes them in
    # place (docs/design.md, "Compressed moments at the byte floor").
    pack = functools.partial(_pack, per=layout.per)
    codes = tree_lib.by_platform(codes, cpu=pack, accelerator=_pack_by_bitcast)
    return STORED_TYPES_4BIT[self.sign](codes, block_max)

  def decompress(self, stored: FourBitMoment, by_table: bool = False) -> jax.Array:
    """Returns the float32 leaf that ``stored`` codes, in the shape that was
    coded: signed, each level times its scale; nonnegative, each level among
    its block's range. ``by_table`` looks the signed levels up in a table of
    16, but for an odd last axis; the range levels are a product and a sum
    either way."""
    codes, scales = (jnp.asarray(x) for x in stored)
    scales = scales.astype(jnp.float32)
    # The layout whose codes and scales have these shapes: ``n`` is odd where
    # the scales hold one more entry a row than the blocks.
    *lead, pairs = codes.shape
    signed = self.sign == "signed"
    _, blocks = block_layout((2 * pairs,), 4)
    if tuple(scales.shape[:-1]) != tuple(lead) or scales.shape[-1] not in (blocks, blocks + 1):
      raise ValueError(
        f"scales of shape {scales.shape} do not match codes of shape {codes.shape}: expected "
        f"{(*lead, blocks)} (an even last axis) or {(*lead, blocks + 1)} (an odd one)"
      )
    layout = _Layout.of((*lead, 2 * pairs + scales.shape[-1] - blocks))
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
      words, shape = scales, (*layout.lead, layout.n)
    else:
      # On accelerators by a bitcast to uint4 pairs, the view in which
      # ``two_pass.kept`` selects the new codes: read and written alike, XLA writes
      # the new codes over the old ones in place (read as bytes, it copies).
      unpack = functools.partial(_unpack, per=layout.per)
      k = tree_lib.by_platform(codes, cpu=unpack, accelerator=_unpack_by_bitcast)
      words, shape = scales[..., : layout.blocks], (*layout.lead, layout.body)
    if not signed:
      # The top level less 15 - k steps, from each element's word (XLA computes
      # the step once a block); 0 where the code is 0.
      top, step = _range_fields(_spread(words, shape, layout.size))
      bits = jax.lax.sub(top, jax.lax.mul(jax.lax.sub(np.int32(LEVELS_4BIT), k), step))
      value = jax.lax.bitcast_convert_type(bits, jnp.float32)
      value = jax.lax.select(jax.lax.gt(k, np.int32(0)), value, jnp.zeros_like(value))
    else:
      if by_table and not layout.tail:
        # Index = the code, its low 3 bits the magnitude, the 4th the sign.
        table = np.concatenate([SIGNED_LEVELS_4BIT, -SIGNED_LEVELS_4BIT]).astype(np.float32)
        level = lookup(table, k)
      else:
        magnitude = _select_level(
          jax.lax.bitwise_and(k, np.int32(_SIGN_BIT - 1)), SIGNED_LEVELS_4BIT
        )
        # The code's sign bit moves to float32's: -level, exactly.
        sign = jax.lax.shift_left(jax.lax.bitwise_and(k, np.int32(_SIGN_BIT)), np.int32(28))
        bits = jax.lax.bitwise_or(jax.lax.bitcast_convert_type(magnitude, jnp.int32), sign)
        level = jax.lax.bitcast_convert_type(bits, jnp.float32)
      value = jax.lax.mul(level, _spread(words, shape, layout.size))
    if layout.tail:
      last = value.ndim - 1
      at_tail = jax.lax.eq(
        jax.lax.broadcasted_iota(jnp.int32, value.shape, last), np.int32(layout.body)
      )
      tail = jax.lax.broadcast_in_dim(tail, value.shape, tuple(range(value.ndim)))
      value = jax.lax.select(at_tail, tail, value)
    return value
