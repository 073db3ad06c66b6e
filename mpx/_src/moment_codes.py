"""Compressed optimizer moments: bfloat16, and 8 bits per element with a
float32 scale per block.

Two codes per format, for the two kinds of moment leaf:

- ``"signed"`` (first moments: ``mu``, ``trace``): momentum has any sign.
- ``"nonnegative"`` (second moments: ``nu``): a positive value never decodes
  to zero, so Adam never divides by ``eps`` alone where float32 would not
  (the zero-point failure of "Memory Efficient Optimizers with 4-bit States",
  Li et al. 2023).

**bfloat16** keeps the top 16 bits of each float32 moment, rounded to nearest
(even) or stochastically with :func:`mpx._src.rounding.stochastic_round`.
bfloat16 has float32's exponent range, so a positive normal second moment
stays positive.

**8 bits** stores one ``uint8`` per element, in the leaf's own shape, and a
float32 scale per block: the block's largest magnitude. Blocks run along the
last axis only (:func:`block_layout`), so a block never straddles a device
shard of any other axis, and where the last axis has a suitable divisor the
blocks tile it exactly and a power-of-two shard count of it lands on block
boundaries. A block that does not tile is padded while it is being computed,
never in storage. Each element is coded relative to its block's scale,
``a = |x| / scale`` in [0, 1], as a tiny float with no sign bit of its own:

- ``"signed"``: a sign bit and a 7-bit magnitude: 127 nonzero levels, 16
  per octave in the top three octaves [1/8, 1) and 8 per octave below, down
  to ``2**-12.68`` (1.5e-4) of the block's largest. Below that a value rounds
  to it or to zero.
- ``"nonnegative"``: 255 nonzero levels, 64 in the top octave [1/2, 1), 16
  per octave in the next two, 8 per octave below, down to ``2**-22.68``
  (1.5e-7; the square of the signed code's range, as a second moment is a
  square). Every positive value codes to a nonzero level: one below the
  smallest level is raised to it (an overestimate, so a smaller Adam step,
  never a division by ``eps`` alone), and a decoded value is never below
  float32's smallest normal.

Why these levels (``benchmarks/moment_codes_error.py`` measured them against
other splits, e4m3/e5m3-like codes, power companding, bitsandbytes' dynamic
map and linear absmax, fed the same gradients as float32 Adam): the error of
a stored moment is set by the level spacing where its elements sit, and with
stochastic rounding it grows with the square root of that spacing. A second
moment averaged over ~1000 steps of one gradient scale sits within a factor
of two of its block's largest, so the top octave gets 64 levels (1.6% apart),
which cuts Adam's update error there 4x against 8 per octave throughout;
the octaves below hold most elements of a first moment and of blocks with
mixed scales (a small MLP's layers), so they get 16; 8 per octave below keep
the range for blocks whose gradient scales differ 1000x (columns, outlier
features), where codes with less range (linear, power, bitsandbytes' map,
e3m4, e4m4) raise or zero the small elements: Adam's update error there is
1.5x to 25x that of these codes.

Each region of levels is the set of float32 values with its number of mantissa
bits, so coding is integer arithmetic on the float32 bits: a region's code is
``base + ((bits(a) - bits(its lowest level)) >> shift)`` and decoding shifts
back. Rounding adds, before the shift, half a step (to nearest) or ``shift``
uniform random bits (stochastic). Between two adjacent levels, both in one
octave of float32 (the upper one may be the next power of two), the value is
linear in its bits, so stochastic rounding goes up with probability ``(a -
low) / (high - low)``: the decoded value's expectation is ``x``, up to
float32's rounding of ``x / scale`` and of the decoded product (an ulp or
two). The block's largest element codes to level 1.0 and decodes to its
scale exactly.

Rounding: stochastic for both kinds and both formats. To nearest, a slow
average stalls: an increment smaller than half a step is dropped every time.
``nu`` (b2=0.999) then moves only on the rare large gradient and ratchets up
(bfloat16: +19% after 2000 steps of Gaussian gradients, +49% with heavy
tails; it drifts low, by about 1%, only while ``nu`` rises smoothly), and an
8-bit ``mu`` with b1=0.99 (Lion, Adan) freezes (0.69 of float32's on a
drifting mean). Stochastic rounding is unbiased at every step (``nu`` within
0.1% of float32's on average throughout, but for elements raised to the
smallest level); its noise settles at a level set
by the level spacing instead of accumulating, as the average forgets it with
its old gradients.

Random bits come from :func:`mpx._src.rounding.random_bits` (counter-based,
the same under any sharding) with the caller's uint32 key and int32 count;
each format and kind mixes its own salt into the key, so a first and a second
moment (or a master) drawn with one key and count get independent bits.
Everything here is pure, jit-compiled lax ops, with no host sync.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import rounding

Kind = Literal["signed", "nonnegative"]
KINDS: tuple[str, ...] = ("signed", "nonnegative")

# Blocks hold at most this many elements; ``block_layout`` prefers one in
# (MAX_BLOCK / 2, MAX_BLOCK] and accepts one down to MIN_BLOCK that divides.
MAX_BLOCK = 256
MIN_BLOCK = 32

_ONE_BITS = 0x3F800000  # bits of float32 1.0
_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32
# Salts xored into the caller's key: independent bits per format and kind.
_SALTS = {"bfloat16": 0x6A09E667, "signed": 0xBB67AE85, "nonnegative": 0x3C6EF372}


class QuantizedMoment(NamedTuple):
  """An 8-bit moment leaf: ``codes`` (uint8, the leaf's shape) and ``scales``
  (float32, ``shape[:-1] + (n_blocks,)``; ``(1,)`` for a scalar): the largest
  magnitude of each block along the last axis."""

  codes: jax.Array
  scales: jax.Array


class _Code(NamedTuple):
  """A float-like code of magnitudes in [0, 1]: ``levels`` nonzero levels
  (127 when the code's top bit is the sign, else 255) counted down from 1.0
  in ``regions``, each ``(octaves, mantissa bits)``: the floats with that
  many mantissa bits over that many octaves. The last region's octaves are
  ignored: it takes the levels left, down to the smallest."""

  signed: bool
  regions: tuple[tuple[int, int], ...]

  @property
  def levels(self) -> int:
    return 127 if self.signed else 255

  def layout(self) -> tuple[tuple[int, int, int], ...]:
    """``(low_bits, low_code, shift)`` per region, from the top: its smallest
    level's float32 bits and code, and ``23 - mantissa``. Region ``r`` codes
    ``bits`` in ``[low_bits, next region's low_bits)`` as ``low_code +
    ((bits - low_bits) >> shift)``."""
    upper_bits, upper_code = _ONE_BITS, self.levels
    out = []
    for i, (octaves, mantissa) in enumerate(self.regions):
      shift = 23 - mantissa
      count = upper_code - 1 if i == len(self.regions) - 1 else octaves << mantissa
      upper_bits, upper_code = upper_bits - (count << shift), upper_code - count
      out.append((upper_bits, upper_code, shift))
    if upper_code != 1 or upper_bits <= 0x00800000:
      raise ValueError(f"regions {self.regions} leave no room for {self.levels} levels")
    return tuple(out)


# More levels near the block's largest, where most elements of a moment sit
# (see the module docstring); 8 per octave below for the range.
CODES: dict[str, _Code] = {
  "signed": _Code(True, ((3, 4), (0, 3))),  # 48 + 79 levels, down to 2**-12.68
  "nonnegative": _Code(False, ((1, 6), (2, 4), (0, 3))),  # 64 + 32 + 159, to 2**-22.68
}


def block_layout(shape: tuple[int, ...]) -> tuple[int, int]:
  """``(block_size, n_blocks)`` of a leaf of ``shape``, blocks along its last
  axis (a scalar is one row of one element).

  A last axis of at most ``MAX_BLOCK`` (256) is one block. A longer one takes
  the divisor in (128, 256] (else in [32, 128]) that leaves the block count
  with the most factors of two, then the largest: 4096 gives 16 blocks of
  256, 768 gives 4 of 192, 11008 gives 64 of 172, 32000 gives 128 of 250, so
  sharding the axis 2, 4, 8... ways (up to the block count) splits it on
  block boundaries. With no such divisor (50257, 4097) the axis is cut into
  ``ceil(n / 256)`` blocks of ``ceil(n / n_blocks)``, the last one short.
  """
  n = shape[-1] if shape else 1
  if n <= MAX_BLOCK:
    return n, 1

  def twos(k: int) -> int:
    return (k & -k).bit_length()

  for low, high in ((MAX_BLOCK // 2 + 1, MAX_BLOCK), (MIN_BLOCK, MAX_BLOCK // 2)):
    divisors = [d for d in range(low, high + 1) if n % d == 0]
    if divisors:
      size = max(divisors, key=lambda d: (twos(n // d), d))
      return size, n // size
  blocks = -(-n // MAX_BLOCK)
  return -(-n // blocks), blocks


def _rows(x: jax.Array) -> jax.Array:
  """``x`` with its last axis cut into blocks: ``shape[:-1] + (n_blocks,
  block)``, zero-padded at the end of the last block where they do not tile."""
  x = x.reshape((1,)) if x.ndim == 0 else x
  size, blocks = block_layout(x.shape)
  pad = size * blocks - x.shape[-1]
  if pad:
    config = [(0, 0, 0)] * (x.ndim - 1) + [(0, pad, 0)]
    x = jax.lax.pad(x, np.zeros((), x.dtype), config)
  return x.reshape((*x.shape[:-1], blocks, size))


def _expand(scales: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Each block's scale at each of its elements: ``scales`` broadcast to the
  leaf's ``shape``. The elementwise work runs in the leaf's own shape, so a
  kernel that rewrites the codes reads the old ones at the indices it writes
  (and may write them in place)."""
  size, blocks = block_layout(shape)
  lead = shape[:-1] if shape else ()
  wide = jax.lax.broadcast_in_dim(scales, (*lead, blocks, size), range(len(lead) + 1))
  wide = wide.reshape((*lead, blocks * size))
  n = shape[-1] if shape else 1
  if blocks * size != n:
    wide = jax.lax.slice_in_dim(wide, 0, n, axis=wide.ndim - 1)
  return wide.reshape(shape)


def _salted(key: jax.Array, salt: str) -> jax.Array:
  return jax.lax.bitwise_xor(jnp.asarray(key).astype(jnp.uint32), np.uint32(_SALTS[salt]))


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def encode(
  x: jax.Array,
  kind: Kind,
  key: jax.Array,
  count: jax.Array,
  stochastic: bool,
) -> QuantizedMoment:
  """``x`` (float32) as 8-bit codes and per-block float32 scales.

  Args:
    x: the moment leaf, float32, finite; under ``"nonnegative"``, negative
      values code as zero.
    kind: ``"signed"`` or ``"nonnegative"``.
    key: uint32 scalar, the leaf's key for random bits.
    count: int32 scalar, a counter that changes every time the leaf is
      encoded anew (e.g. the count of applied steps).
    stochastic: round up or down at random (unbiased) instead of to nearest.

  Returns:
    The ``QuantizedMoment``; ``decode`` turns it back into float32.
  """
  _check_kind(kind)
  return _encode(CODES[kind], x, _salted(key, kind), count, stochastic)


def decode(c: QuantizedMoment, kind: Kind) -> jax.Array:
  """The float32 leaf that ``c`` codes: each level times its block's scale."""
  _check_kind(kind)
  return _decode(CODES[kind], c)


def _select(x: jax.Array, bounds: list[int], values: list[int]) -> jax.Array:
  """Per element of ``x`` (int32), ``values[r]`` for the first region ``r``
  whose lower bound ``bounds[r]`` (descending) it reaches, else
  ``values[-1]``."""
  # full_like, not full: under explicit sharding it takes x's sharding.
  out = jnp.full_like(x, values[-1], jnp.int32)
  for bound, value in zip(reversed(bounds), reversed(values[:-1]), strict=True):
    inside = jax.lax.ge(x, np.int32(bound))
    out = jax.lax.select(inside, jnp.full_like(x, value, jnp.int32), out)
  return out


def _block_scales(blocked: jax.Array, signed: bool) -> jax.Array:
  """Each block's largest magnitude (under the nonnegative code, its largest
  value), at least 0, from ``blocked`` (``_rows``) of a moment.

  One reduction with two results: XLA:CPU hands a one-result reduction to a
  library kernel (YNNPACK) that takes its input written out whole, so a new
  moment computed from its old codes would be stored in float32 and read
  back. A two-result reduction XLA emits itself, with the computation of the
  moment fused into it (a 16M-element second moment, measured: 3.5 ms and 5
  bytes an element against 14 ms and 13).

  Signed: the largest value and the smallest, whose negation may be the
  largest magnitude; nonnegative: the largest value, twice. Both start from
  0: an empty block's scale is 0, and under the nonnegative code negative
  values do not count.
  """
  zero = np.float32(0)
  second = jax.lax.min if signed else jax.lax.max

  def reducer(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
  ) -> tuple[jax.Array, jax.Array]:
    return jax.lax.max(a[0], b[0]), second(a[1], b[1])

  largest, other = jax.lax.reduce((blocked, blocked), (zero, zero), reducer, (blocked.ndim - 1,))
  return jax.lax.max(largest, jax.lax.neg(other) if signed else other)


def _encode(
  code: _Code, x: jax.Array, key: jax.Array, count: jax.Array, stochastic: bool
) -> QuantizedMoment:
  x = jnp.asarray(x, jnp.float32)
  shape = x.shape
  zero = np.float32(0)
  scales = _block_scales(_rows(x), code.signed)
  if code.signed:
    magnitude = jax.lax.abs(x)
  else:
    # Negative values (and -0.0, whose int32 bits would wrap below) code as 0.
    magnitude = jax.lax.select(jax.lax.gt(x, zero), x, jnp.zeros_like(x))
  # A true division: the block's largest element becomes exactly 1.0.
  safe = jax.lax.select(scales > zero, scales, jnp.ones_like(scales))
  a = jax.lax.div(magnitude, _expand(safe, shape))
  bits = _bits(a)
  layout = code.layout()
  bounds = [low for low, _, _ in layout[:-1]]
  # In region r, level = base + ((bits - low + noise) >> shift), which is
  # (bits + noise + (base << shift) - low) >> shift: an offset and a shift.
  offset = _select(bits, bounds, [(c << sh) - low for low, c, sh in layout])
  shift = _select(bits, bounds, [sh for _, _, sh in layout])
  one = np.int32(1)
  if stochastic:
    random = rounding.random_bits(key, count, shape)
    mask = jax.lax.sub(jax.lax.shift_left(one, shift), one)
    noise = jax.lax.bitwise_and(random.astype(jnp.int32), mask)
  else:
    noise = jax.lax.shift_left(one, jax.lax.sub(shift, one))
  level = jax.lax.shift_right_arithmetic(jax.lax.add(jax.lax.add(bits, offset), noise), shift)
  lowest = np.array(layout[-1][0], np.int32).view(np.float32)
  if code.signed:
    # Below the smallest level: to it with probability a / lowest, else to 0.
    if stochastic:
      # Via int32 (the value fits 24 bits): uint32 to float32 does not vectorize.
      uniform = jax.lax.shift_right_logical(random, np.uint32(8)).astype(jnp.int32)
      uniform = uniform.astype(jnp.float32)
      threshold = jax.lax.mul(uniform, np.float32(lowest * 2.0**-24))
    else:
      threshold = jnp.full_like(a, lowest / 2)
    # As integers: the bits of non-negative floats order as their values (and
    # then ``a`` is read only as bits, so XLA keeps it in registers).
    small = jax.lax.gt(bits, _bits(threshold))
  else:
    # Never to zero: a positive value below the smallest level takes it, even
    # one whose ratio to the scale underflowed (so test x, not a).
    small = jax.lax.gt(x, zero)
  below = jax.lax.lt(bits, np.int32(layout[-1][0]))
  level = jax.lax.select(below, small.astype(jnp.int32), level)
  if code.signed:
    negative = jax.lax.bitwise_and(jax.lax.lt(x, zero), jax.lax.gt(level, np.int32(0)))
    level = jax.lax.bitwise_or(level, jax.lax.shift_left(negative.astype(jnp.int32), np.int32(7)))
  return QuantizedMoment(level.astype(jnp.uint8), scales)


def _decode(code: _Code, c: QuantizedMoment) -> jax.Array:
  codes, scales = c
  shape = codes.shape
  _, blocks = block_layout(shape)
  expected = (*shape[:-1], blocks)
  if scales.shape != expected:
    raise ValueError(
      f"scales of shape {scales.shape} do not match codes of shape {shape}: expected {expected}"
    )
  k = codes.astype(jnp.int32)
  magnitude = jax.lax.bitwise_and(k, np.int32(127)) if code.signed else k
  layout = code.layout()
  bounds = [c for _, c, _ in layout[:-1]]
  # In region r, bits = low + ((k - base) << shift) = (low - (base << shift)) + (k << shift).
  offset = _select(magnitude, bounds, [low - (c << sh) for low, c, sh in layout])
  shift = _select(magnitude, bounds, [sh for _, _, sh in layout])
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


def encode_bfloat16(x: jax.Array, key: jax.Array, count: jax.Array, stochastic: bool) -> jax.Array:
  """``x`` (float32) as bfloat16: to nearest (ties to even), or up or down in
  magnitude at random with probability proportional to the distance (unbiased).
  Magnitudes beyond bfloat16's largest finite value saturate at it."""
  x = rounding.canonical(jnp.asarray(x, jnp.float32))
  if stochastic:
    bits = rounding.random_bits(_salted(key, "bfloat16"), count, x.shape)
    return rounding.stochastic_round(x, bits)
  return x.astype(jnp.bfloat16)


def decode_bfloat16(x: jax.Array) -> jax.Array:
  """A bfloat16 moment back in float32 (exact)."""
  return jnp.asarray(x).astype(jnp.float32)


def bytes_per_element(shape: tuple[int, ...]) -> float:
  """Bytes the 8-bit form of a leaf of ``shape`` stores per element: one
  code plus its share of the float32 scales."""
  _, blocks = block_layout(shape)
  n = shape[-1] if shape else 1
  return 1 + 4 * blocks / n if n else 1.0
