"""The 4-bit moment codes (``mpx/_src/moment_codes.py``'s ``FourBitCompressed``) against numpy
references written here from their definitions: the signed map ``(j / 7) **
2`` (float64) and the nonnegative range levels, 15 evenly spaced in the
float32 bits between each block's ends (int64 on the bits), in blocks of 128
(no column scales: each row codes on its own); then what the stored form
promises: no positive value to zero, exact block maxima (signed) and ends
(nonnegative), clamping, odd shapes, jit, unbiased stochastic rounding, the
bytes it costs, a state saved before the range levels refused on restore;
and, on XLA:CPU, that nothing per element is written out between passes.
Shapes whose blocks are multiples of 8 (1024, 768, 4097) pack codes a uint32
word at a time, others (1026, 11008, 4098) a byte at a time: both layouts
are tested."""

import functools
from typing import Any, NamedTuple

import cli_output
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization as flax_serialization
from lowering_forms import ACCELERATOR, forced

import mpx
from mpx._src import moment_codes as mc
from mpx._src import moments, states

KEY = jnp.uint32(0x5EED1234)
STEP = jnp.int32(11)
TINY = np.finfo(np.float32).tiny


# The 4-bit code through its kind, the entry points the step uses.


def encode_4bit(x, sign, key, step, scales=None):
  """The stored 4-bit form of ``x`` (against ``scales``: a second pass)."""
  return mc.FourBitCompressed(0, sign).compress(x, step, key, scales)


def kind_of(stored) -> mc.FourBitCompressed:
  """The kind that decompresses ``stored`` (of its type's sign)."""
  return moments.KIND_OF_STORED[type(stored)]


def decode_4bit(stored):
  return kind_of(stored).decompress(stored)


def maxima_4bit(x, sign):
  return mc.FourBitCompressed(0, sign).maxima(x)


def stored_shapes(shape, sign):
  """The stored form's shapes, as the kind's compress makes it."""
  like = jax.ShapeDtypeStruct(shape, jnp.float32)
  step = jax.ShapeDtypeStruct((), jnp.int32)
  return jax.eval_shape(mc.FourBitCompressed(0, sign).compress, like, step)


# --- Independent references ---------------------------------------------------


def signed_map() -> np.ndarray:
  """The signed magnitudes by code's low 3 bits ``j``: ``(j / 7) ** 2``, 0 to 1."""
  return np.array([(j / 7) ** 2 for j in range(8)])


OCTAVE = 2**23  # float32 bits a power of two apart
TINY_BITS = int(np.float32(TINY).view(np.int32))
# The range levels' step between levels: 1/4096 octave units in the word's low
# 12 bits; 14 steps from lowest to top, at most 9 octaves (the floor).
STEP_UNIT = OCTAVE // 4096
MAX_STEPS = 9 * OCTAVE // (14 * STEP_UNIT)


def ref_range(x: np.ndarray, block: int = 128) -> dict[str, np.ndarray]:
  """The nonnegative code's blocks of a 2-D ``x`` from its definition, on the
  float32 bits (int64), each ``(rows, blocks, 1)``: ``top``, the largest
  value's bits rounded up to a multiple of ``2**12`` (11 mantissa bits), at
  least the smallest normal's; ``step``, the bits between levels, the least
  multiple of ``STEP_UNIT`` whose 14 reach from ``top`` down to the smallest
  positive value, at most ``MAX_STEPS`` of them (the floor, 2**-9 of the
  top) and the lowest level a normal float; ``levels`` (``(..., 15)``) codes
  1 to 15, ``top - (15 - k) * step``; and the word, ``top | step /
  STEP_UNIT``."""
  rows, n = x.shape
  bits = x.astype(np.float32).view(np.int32).astype(np.int64).reshape(rows, n // block, block)
  largest = np.maximum(bits.max(-1, keepdims=True), 0)
  top = np.clip(-(-largest // 2**12) * 2**12, TINY_BITS, 0x7F7FF000)
  smallest = np.where(bits > 0, bits, top).min(-1, keepdims=True)  # none positive: no step
  unit = 14 * STEP_UNIT
  units = np.clip(-(-(top - smallest) // unit), 0, np.minimum(MAX_STEPS, (top - TINY_BITS) // unit))
  levels = top - (15 - np.arange(1, 16)) * units * STEP_UNIT
  word = (top | units).astype(np.uint32)
  return {"top": top, "step": units * STEP_UNIT, "levels": levels, "word": word[..., 0]}


def as_floats(bits: np.ndarray) -> np.ndarray:
  return np.asarray(bits).astype(np.int64).astype(np.int32).view(np.float32)


def range_neighbours(x: np.ndarray, block: int = 128) -> tuple[np.ndarray, ...]:
  """``(codes, values)`` of the range levels at or below and at or above each
  element of a 2-D ``x`` (the lowest level below it, the top above it; code
  0, value 0, where it is not positive), and where float32's position among
  the levels may see the other side of a level (within 16 bits of it, not on
  it)."""
  rows, n = x.shape
  bits = x.view(np.int32).astype(np.int64).reshape(rows, n // block, block)
  levels = np.broadcast_to(ref_range(x, block)["levels"][:, :, None, :], (*bits.shape, 15))
  low = np.clip((levels <= bits[..., None]).sum(-1), 1, 15)
  high = np.clip((levels < bits[..., None]).sum(-1) + 1, 1, 15)
  distance = np.abs(levels - bits[..., None])
  near = ((distance > 0) & (distance <= 16)).any(-1)
  positive = bits > 0
  out = []
  for code in (low, high):
    value = as_floats(np.take_along_axis(levels, code[..., None] - 1, -1)[..., 0])
    value = np.where(positive, value, np.float32(0))
    out += [np.where(positive, code, 0).reshape(rows, n), value.reshape(rows, n)]
  return (*out, near.reshape(rows, n))


def ref_scales(x: np.ndarray, block: int = 128) -> np.ndarray:
  """Each element's scale, float64, for either sign: its block's largest
  magnitude (blocks of ``block`` along the last axis of a 2-D ``x``, which it
  must divide)."""
  x = x.astype(np.float64)
  rows, n = x.shape
  b = np.abs(x).reshape(rows, n // block, block)
  return np.broadcast_to(b.max(-1, keepdims=True), b.shape).reshape(x.shape)


def ref_neighbours(x: np.ndarray, sign: str) -> tuple[np.ndarray, ...]:
  """``(codes, values)`` of the levels below-or-at and above each element of a
  2-D ``x`` (the same where it is a level, or above 1), and where float32 may
  see the other side of a level (signed: within 1e-6 of one, not on it;
  nonnegative: :func:`range_neighbours`)."""
  if sign == "nonnegative":
    return range_neighbours(x)
  scale = ref_scales(x)
  a = np.abs(x) / np.where(scale > 0, scale, 1)
  levels = signed_map()
  high = np.clip(np.searchsorted(levels, a, side="left"), 0, len(levels) - 1)
  low = np.where(levels[high] > a, high - 1, high)
  distance = np.abs(a[..., None] - levels)
  near_level = ((distance > 0) & (distance < 1e-6)).any(-1)
  out = []
  for code in (low, high):
    value = np.sign(x) * levels[code] * scale
    out += [code | np.where((x < 0) & (code > 0), 8, 0), value]
  return (*out, near_level)


def unpack(codes: np.ndarray) -> np.ndarray:
  """Two codes a byte, the low nibble first, back to one a slot."""
  codes = np.asarray(codes).astype(np.int64)
  return np.stack([codes & 15, codes >> 4], -1).reshape(*codes.shape[:-1], -1)


def spacing(a: np.ndarray, levels: np.ndarray) -> np.ndarray:
  """The gap between the levels around each ``a`` in [0, 1] (the larger of the
  two where ``a`` is within 1e-6 of a level, as float32 may see either side)."""
  levels = np.sort(levels)
  gaps = np.diff(levels)

  def gap(v: np.ndarray) -> np.ndarray:
    i = np.clip(np.searchsorted(levels, v, side="right") - 1, 0, len(gaps) - 1)
    return gaps[i]

  return np.maximum(gap(a * (1 - 1e-6)), gap(np.minimum(a * (1 + 1e-6), 1)))


def heavy(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
  """Student t (3 degrees of freedom) with per-row scales over 1e-3 .. 1."""
  rng = np.random.default_rng(seed)
  rows = 10.0 ** rng.uniform(-3, 0, (*shape[:-1], 1))
  return (rows * rng.standard_t(3, shape)).astype(np.float32)


def moment(shape: tuple[int, ...], sign: str, seed: int = 0) -> np.ndarray:
  x = heavy(shape, seed)
  return x if sign == "signed" else np.square(x)


@functools.cache
def coder(sign: str):
  """One jitted round trip per sign, with optional scales."""

  @jax.jit
  def encode(x, key, step, scales=None):
    return encode_4bit(x, sign, key, step, scales=scales)

  return encode, jax.jit(decode_4bit)


def round_trip(x, sign, step=STEP, scales=None):
  encode, decode = coder(sign)
  stored = encode(jnp.asarray(x), KEY, step, scales)
  return stored, np.asarray(decode(stored))


# --- The maps -------------------------------------------------------------------


def test_the_signed_levels_are_the_map():
  np.testing.assert_allclose(mc.SIGNED_LEVELS_4BIT, signed_map(), rtol=1e-7)


@pytest.mark.parametrize("sign", mc.SIGNS)
def test_rounding_picks_a_neighbouring_level_of_the_reference(sign):
  x = moment((16, 1024), sign)
  x[0, :5] = 0.0
  stored, decoded = round_trip(x, sign)
  low, low_value, high, high_value, near_level = ref_neighbours(x, sign)
  ok = ~near_level
  assert ok.mean() > 0.99
  codes = unpack(stored.codes)
  assert np.all(((codes == low) | (codes == high))[ok])
  value = np.where(codes == low, low_value, high_value)
  if sign == "signed":
    scale = ref_scales(x)
    np.testing.assert_allclose(decoded[ok], value[ok], rtol=0, atol=1e-6 * scale.max())
  else:
    # The range levels are float32 bits: exact. The words are the reference's.
    np.testing.assert_array_equal(decoded[ok], value[ok])
    words = np.asarray(stored[1]).view(np.uint32)
    np.testing.assert_array_equal(words, ref_range(x)["word"])


def test_the_signed_error_is_within_the_level_spacing():
  x = moment((16, 1024), "signed", seed=1)
  _, decoded = round_trip(x, "signed")
  scale = ref_scales(x)
  a = np.abs(x) / scale
  bound = spacing(a, signed_map()) * scale
  assert np.all(np.abs(decoded - x) <= bound * (1 + 1e-5) + 1e-7 * scale)


def test_a_second_moment_decodes_within_a_step_of_its_bits_or_at_the_floor():
  # Levels evenly spaced in the bits between each block's ends: a value rounds
  # to within one step of its bits; below the floor (2**-9 of the top, where
  # the heavy tails' blocks reach) to the lowest level, which is at least it.
  x = moment((16, 1024), "nonnegative", seed=1)
  _, decoded = round_trip(x, "nonnegative")
  ref = ref_range(x)
  bits = x.view(np.int32).astype(np.int64).reshape(16, 8, 128)
  got = decoded.view(np.int32).astype(np.int64).reshape(16, 8, 128)
  lowest = ref["levels"][..., :1]
  below = bits < lowest
  assert below.sum() > 10 and (ref["step"] == MAX_STEPS * STEP_UNIT).any()
  np.testing.assert_array_equal(got[below], np.broadcast_to(lowest, bits.shape)[below])
  assert np.all(np.abs(got - bits)[~below] <= np.broadcast_to(ref["step"], bits.shape)[~below])
  # The floor: the lowest level within 9 octaves of the top, and as close to it as the step allows.
  span = ref["top"] - lowest
  assert np.all(span <= 9 * OCTAVE) and np.all(
    (span > 9 * OCTAVE - 14 * STEP_UNIT) | ~below.any(-1, keepdims=True)
  )
  # Near-equal values (a second moment of near-Gaussian gradients) get levels
  # under 1% apart: 0.9 to 1 is 0.2 of the octave [0.5, 1) in the bits, in 14 steps.
  near = np.random.default_rng(2).uniform(0.9, 1.0, (4, 128)).astype(np.float32)
  _, decoded = round_trip(near, "nonnegative")
  assert np.all(ref_range(near)["step"] <= 0.2 * OCTAVE / 14 + STEP_UNIT)
  assert np.abs(decoded / near - 1).max() < 0.01


def test_the_nonnegative_code_keeps_small_values_positive():
  x = np.full((8, 256), 1e3, np.float32)
  x[:, 1] = 1e-30
  x[:, 2] = 1e-38  # a normal just above float32's smallest
  x[:, 3] = np.float32(1e-44)  # subnormal
  x[:, 4] = 0.0
  x[:, 5] = -1.0  # not a second moment's: codes as 0
  x[3] = 1e-30  # a whole row of tiny values next to rows of 1e3
  x[3, 4:6] = 0.0
  flat = x[0].copy()  # a 1-D leaf: blocks
  flat = np.concatenate([flat] * 16 + [flat[:1]])  # 4097 elements, odd
  for leaf in (x, flat):
    _, decoded = round_trip(leaf, "nonnegative")
    positive = leaf > 0
    assert np.all(decoded[positive] >= TINY)
    assert np.all(decoded[~positive] == 0)
  # Here every positive value is a row's largest, of 11 mantissa bits (the
  # top level itself), or below the floor: none decodes below itself.
  x[3] = 2.0**-100
  _, decoded = round_trip(x, "nonnegative")
  assert np.all(decoded[x > 0] >= x[x > 0])


def test_the_signed_code_keeps_signs_and_zeros():
  x = moment((8, 1024), "signed", seed=2)
  x[:, ::7] = 0.0
  x[:, 1::7] = -0.0
  x[:, 2::7] *= 1e-9  # rounds to zero or the smallest level, sign kept
  _, decoded = round_trip(x, "signed")
  assert np.all(decoded[x == 0] == 0)
  nonzero = decoded != 0
  assert np.all(np.sign(decoded[nonzero]) == np.sign(x[nonzero]))
  assert np.all(decoded[:, 2::7] * 0 == 0)  # the tiny ones: zero or a level, no NaN
  kept = np.ones(x.shape, bool)
  kept[:, ::7] = kept[:, 1::7] = kept[:, 2::7] = False
  assert nonzero[kept].mean() > 0.9


def test_each_signed_block_maximum_decodes_exactly():
  x = moment((16, 1024), "signed", seed=3)
  x[::2] *= -1  # rows whose largest magnitude is negative
  _, decoded = round_trip(x, "signed")
  blocks = np.abs(x).reshape(16, 8, 128)
  at = (blocks == blocks.max(-1, keepdims=True)).reshape(x.shape)
  assert at.sum() >= 16 * 8
  np.testing.assert_array_equal(decoded[at], x[at])


# One block of 100 (the division by a broadcast scale must stay a division),
# blocks of 96 and 86, a short last block (4098: 33 of 126), an odd row.
LAYOUTS = [(16, 100), (4, 768), (2, 11008), (3, 4098), (2, 4097)]


@pytest.mark.parametrize("shape", LAYOUTS, ids=str)
@pytest.mark.parametrize("sign", mc.SIGNS)
def test_each_block_s_maximum_or_ends_are_stored_in_every_layout(sign, shape):
  # Signed: each block's largest magnitude decodes exactly. Nonnegative: each
  # block's word holds its ends as the reference reads them, a short last
  # block's too (its padding is no value).
  x = moment(shape, sign, seed=9)
  stored, decoded = round_trip(x, sign)
  body = shape[-1] - shape[-1] % 2
  size, blocks = mc.block_layout((body,), 4)
  padded = np.zeros((*shape[:-1], size * blocks), np.float32)
  padded[..., :body] = np.abs(x[..., :body])
  np.testing.assert_array_equal(decoded[..., body:], x[..., body:])  # an odd row's last
  if sign == "nonnegative":
    words = np.asarray(stored[1])[..., :blocks].view(np.uint32)
    np.testing.assert_array_equal(words, ref_range(padded, size)["word"])
    return
  maxima = padded.reshape(*shape[:-1], blocks, size).max(-1)
  at = padded == np.repeat(maxima, size, axis=-1)
  at = at[..., :body] & (padded[..., :body] > 0)
  assert at.sum() >= np.prod(shape[:-1]) * blocks
  np.testing.assert_array_equal(decoded[..., :body][at], x[..., :body][at])


@pytest.mark.parametrize("n", [1026, 1024])
@pytest.mark.parametrize("sign", mc.SIGNS)
def test_each_row_codes_on_its_own(sign, n):
  # No reduction across rows: a row coded alone stores what it stores among
  # rows a thousand times larger or smaller.
  x = moment((8, n), sign, seed=8)
  x[1::2] *= np.float32(1e3)
  x[2::4] *= np.float32(1e-6)
  matrix, decoded = round_trip(x, sign)
  size, _ = mc.block_layout((n,), 4)
  for i in range(len(x)):
    row, alone = round_trip(x[i], sign)
    np.testing.assert_array_equal(np.asarray(matrix[1])[i], np.asarray(row[1]))
    # Rounded with the random bits of another shape: a neighbouring level at most.
    if sign == "signed":
      scale = np.repeat(np.asarray(row[1]), size)[:n]
      gap = np.diff(signed_map()).max()
      assert np.all(np.abs(decoded[i] - alone) <= gap * scale * (1 + 1e-6))
    else:
      step = (np.asarray(row[1]).view(np.int32) & 0xFFF) * STEP_UNIT
      apart = np.abs(decoded[i].view(np.int32).astype(np.int64) - alone.view(np.int32))
      assert np.all(apart <= np.repeat(step, size)[:n])
  np.testing.assert_array_equal(
    np.asarray(maxima_4bit(jnp.asarray(x), sign)), np.asarray(matrix[1])
  )


def test_scales_smaller_than_a_value_clamp_to_the_top_level():
  x = moment((16, 1024), "signed", seed=4)
  true = np.asarray(maxima_4bit(jnp.asarray(x), "signed"))
  np.testing.assert_array_equal(true, np.abs(x).reshape(16, 8, 128).max(-1))
  for factor in (0.25, 1e-30):
    small = true * np.float32(factor)
    _, decoded = round_trip(x, "signed", scales=jnp.asarray(small))
    given = np.repeat(small, 128, axis=-1)
    over = np.abs(x) >= given
    assert over.mean() > 0.01
    np.testing.assert_array_equal(decoded[over], np.sign(x[over]) * given[over])
    assert np.all(np.abs(decoded) <= given)
    assert np.all(np.isfinite(decoded))


def test_values_outside_given_words_take_their_end_levels():
  # A first pass's words (XLA may compute the moment an ulp apart there): an
  # element above the top takes the top level, one below the lowest the
  # lowest; the words are stored as given.
  x = moment((16, 1024), "nonnegative", seed=4)
  largest = x.reshape(16, 8, 128).max(-1, keepdims=True)
  for high, low, inside in [(0.25, 2.0**-4, True), (1e-30, 1e-31, False)]:
    narrower = np.clip(x.reshape(16, 8, 128), largest * np.float32(low), largest * np.float32(high))
    ref = ref_range(narrower.reshape(16, 1024).astype(np.float32))
    words = ref["word"].view(np.float32)
    stored, decoded = round_trip(x, "nonnegative", scales=jnp.asarray(words))
    np.testing.assert_array_equal(np.asarray(stored[1]), words)
    top, lowest = (np.broadcast_to(ref["levels"][..., i, None], (16, 8, 128)) for i in (-1, 0))
    bits, got = (v.reshape(16, 8, 128).view(np.int32) for v in (x, decoded))
    over, under = bits >= top, bits <= lowest
    assert over.mean() > (0.01 if inside else 0.999)
    assert under.mean() > 0.01 or not inside
    np.testing.assert_array_equal(got[over], top[over])
    np.testing.assert_array_equal(got[under], lowest[under])
    assert np.all(np.isfinite(decoded))


ODD_SHAPES = [(4097,), (50257,), (65, 65), (3, 5, 277), (4096, 1), (2, 2049), (4096, 3)]


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_odd_shapes_round_trip_to_their_own_shape(shape):
  xs = {sign: jnp.asarray(moment(shape, sign, seed=5)) for sign in mc.SIGNS}

  def encode(xs):
    return {sign: encode_4bit(x, sign, KEY, STEP) for sign, x in xs.items()}

  stored = jax.eval_shape(encode, xs)
  decoded = jax.jit(lambda xs: {s: decode_4bit(v) for s, v in encode(xs).items()})(xs)
  for sign in mc.SIGNS:
    like = stored_shapes(shape, sign)
    assert type(stored[sign]) is mc.STORED_TYPES_4BIT[sign]
    assert stored[sign]._fields == ("codes", "scales" if sign == "signed" else "ranges")
    assert [(s.shape, s.dtype) for s in stored[sign]] == [(s.shape, s.dtype) for s in like]
    x, out = np.asarray(xs[sign]), np.asarray(decoded[sign])
    assert out.shape == shape and out.dtype == np.float32
    rows = np.abs(x).max(-1, keepdims=True)
    # Stochastic: within one level gap (at most 0.265 signed; nonnegative,
    # 9 octaves / 14 below the top: 0.36 of it).
    bound = (np.diff(signed_map()).max() if sign == "signed" else 1 - 2 ** (-9 / 14)) * (1 + 1e-3)
    assert np.all(np.abs(out - x) <= bound * rows)
    if shape[-1] % 2:
      np.testing.assert_array_equal(out[..., -1], x[..., -1])  # stored exactly


def test_the_stored_types_are_those_of_states():
  expected = {"signed": states.Signed4bitMoment, "nonnegative": states.Nonnegative4bitMoment}
  assert dict(mc.STORED_TYPES_4BIT) == expected
  for shape in [(4096, 4096), (2**20,), (3, 5, 277)]:
    signed, nonnegative = (stored_shapes(shape, sign) for sign in mc.SIGNS)
    assert type(nonnegative) is states.Nonnegative4bitMoment
    assert list(signed) == list(nonnegative)  # the same layout for both signs
  # The kind that decompresses each stored type has its sign.
  for sign, stored_type in expected.items():
    assert moments.KIND_OF_STORED[stored_type] == mc.FourBitCompressed(0, sign)


def bytes_per_element(shape: tuple[int, ...]) -> float:
  """The bytes the stored form of a leaf of ``shape`` takes per element."""
  stored = stored_shapes(shape, "nonnegative")
  return sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in stored) / np.prod(shape)


def test_bytes_per_element():
  assert bytes_per_element((4096, 4096)) == 0.5 + 4 / 128
  assert bytes_per_element((2**20,)) == 0.5 + 4 / 128
  assert bytes_per_element((4097,)) == (2048 + 4 * 33) / 4097
  assert [mc.block_layout((n,), 4) for n in (4096, 768, 11008, 4098)] == [
    (128, 32),
    (96, 8),
    (86, 128),
    (126, 33),
  ]


def row_bytes_per_element(n: int) -> float:
  """By hand: two codes a byte, a float32 scale per block of the even part of
  the row, and an odd row's last element kept among the scales."""
  even = n - n % 2
  _, blocks = mc.block_layout((even,), 4)
  return (even // 2 + 4 * (blocks + n % 2)) / n


def test_min_row_is_the_shortest_row_from_which_4_bits_beat_bfloat16():
  # The hand count is what the kind stores (a sample: each is a trace of compress).
  for n in (4, 5, mc.MIN_ROW_4BIT - 1, mc.MIN_ROW_4BIT, 127, 128, 129, 255, 1025, 2047):
    assert bytes_per_element((n,)) == row_bytes_per_element(n), n
    assert bytes_per_element((3, 2, n)) == row_bytes_per_element(n), n
  pays = {n: row_bytes_per_element(n) < 2.0 for n in range(1, 2048)}
  assert not pays[mc.MIN_ROW_4BIT - 1]
  assert all(pays[n] for n in range(mc.MIN_ROW_4BIT, 2048))
  assert pays[4] and not pays[5]  # 4 alone would route 5 to a code that costs more


# Rows of 9 blocks of 114 (1026 is no whole number of 128s) in the quick tier;
# blocks of 128 and an odd row in the slow.
@pytest.mark.parametrize(
  "shape",
  [(4, 1026), *(pytest.param(s, marks=pytest.mark.slow) for s in [(4, 1024), (3, 4097)])],
  ids=str,
)
@pytest.mark.parametrize("sign", mc.SIGNS)
def test_jit_equals_eager(sign, shape):
  x = moment(shape, sign, seed=6)
  eager = encode_4bit(jnp.asarray(x), sign, KEY, STEP)
  jitted, decode = coder(sign)
  compiled = jitted(jnp.asarray(x), KEY, STEP)
  for a, b in zip(eager, compiled, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(decode_4bit(eager)), np.asarray(decode(compiled)))


@pytest.mark.parametrize("sign", mc.SIGNS)
def test_stochastic_rounding_keeps_the_mean_signed_the_mean_bits_nonnegative(sign):
  # Signed codes round unbiased in the value; nonnegative ones in the float32
  # bits, a piecewise-linear logarithm (docs/moment_codes.md, "4 bits").
  x = moment((4, 1024), sign, seed=7)
  encode, decode = coder(sign)
  steps = jnp.arange(64, dtype=jnp.int32)
  draws = np.asarray(jax.vmap(lambda t: decode(encode(jnp.asarray(x), KEY, t)))(steps))
  _, low, _, high, near_level = ref_neighbours(x, sign)
  if sign == "signed":
    inside = (x != 0) & (low != high) & ~near_level

    def kept(v: np.ndarray) -> np.ndarray:
      return v.astype(np.float64)
  else:
    inside = (x.view(np.int32) > low.view(np.int32)) & (low != high) & ~near_level

    def kept(v: np.ndarray) -> np.ndarray:
      return v.view(np.int32).astype(np.float64)

  # Each draw is one of the two levels around x: the mean of 64 has a standard
  # deviation of at most 1/16 of their gap, and of all 4096 * 64, 1/1024.
  kept_gap = np.abs(kept(high) - kept(low))[inside]
  deviation = (kept(draws).mean(0) - kept(x))[inside] / kept_gap
  assert np.all(np.abs(deviation) < 0.5)
  assert abs(deviation.mean()) < 0.01
  # Random: an element between two levels takes both over 64 steps.
  off_level = np.minimum(np.abs(kept(x) - kept(low)), np.abs(kept(high) - kept(x))) > 1e-3 * np.abs(
    kept(high) - kept(low)
  )
  between = inside & off_level
  assert between.sum() > 500
  assert (draws.min(0) < draws.max(0))[between].mean() > 0.95
  # Deterministic for a key and step, different across steps and keys.
  first, again = encode(jnp.asarray(x), KEY, STEP), encode(jnp.asarray(x), KEY, STEP)
  np.testing.assert_array_equal(np.asarray(first.codes), np.asarray(again.codes))
  other_step = encode(jnp.asarray(x), KEY, STEP + 1)
  other_key = encode(jnp.asarray(x), KEY + 1, STEP)
  assert np.any(np.asarray(first.codes) != np.asarray(other_step.codes))
  assert np.any(np.asarray(first.codes) != np.asarray(other_key.codes))


@pytest.mark.parametrize("given_previous", [True, False], ids=["as the step codes", "stochastic"])
@pytest.mark.parametrize(("sign", "decay"), [("signed", 0.99), ("nonnegative", 0.999)])
def test_a_slow_average_decays_with_float32_s_and_never_stalls(sign, decay, given_previous):
  # An average moving by 1% (Lion's momentum, b = 0.99) or 0.1% (Adam's nu,
  # b2 = 0.999) a step, stored in 4 bits after every step: each row's first
  # element keeps its input at 1 (it holds the block's scale), the others'
  # stops after 100 steps. To nearest, their steps fall between the levels and
  # they stall; stochastically they decay with float32's, every row on its own
  # draws: as a rule reads them, a first moment's mean, a second moment's
  # mean 1 / sqrt (with each draw's log kept, the mean itself ends twice
  # float32's here, among levels 2x apart; kept unbiased, the mean 1 / sqrt
  # ended 1.47 times float32's).
  rows, n = 64, 64 if sign == "signed" else 128
  inputs = np.full((rows, n), 0.3 if sign == "signed" else 0.5, np.float32)
  inputs[:, 0] = 1.0
  kind = mc.FourBitCompressed(0, sign)

  def step(carry, t):
    stored, exact = carry
    fed = jnp.where(t < 100, jnp.asarray(inputs), jnp.asarray(inputs) * (jnp.arange(n) == 0))
    new = decay * kind.decompress(stored) + (1 - decay) * fed
    exact = decay * exact + (1 - decay) * fed
    return (kind.compress(new, t, KEY, previous=stored if given_previous else None), exact), None

  zeros = jnp.zeros((rows, n), jnp.float32)
  steps = 300 if sign == "signed" else 2000
  (stored, exact), _ = jax.lax.scan(step, (kind.compress(zeros, 0, KEY), zeros), jnp.arange(steps))
  got, exact = np.asarray(kind.decompress(stored))[:, 1:], np.asarray(exact)[:, 1:]
  # Float32's has decayed to a fraction of its peak...
  peak = inputs[0, 1] * (1 - decay**100)
  assert exact.mean() < 0.25 * peak if sign == "signed" else exact.mean() < 0.2 * peak
  # ... and the stored one with it: within 10% on average, far below the peak.
  read = (lambda v: v) if sign == "signed" else (lambda v: 1 / np.sqrt(v))
  assert abs(read(got).mean() / read(exact).mean() - 1) < 0.1, (got.mean(), exact.mean())


def nearest_codes(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """The signed code of the level nearest each element (ties up), float64, and
  where float32 may see the other side of a midpoint (within 1e-6 of one)."""
  scale = ref_scales(x, block)
  a = np.abs(x) / np.where(scale > 0, scale, 1)
  levels = signed_map()
  index = np.abs(a[..., None] - levels).argmin(-1)
  midpoints = (levels[1:] + levels[:-1]) / 2
  near_midpoint = (np.abs(a[..., None] - midpoints) < 1e-6).any(-1)
  return index | np.where((x < 0) & (index > 0), 8, 0), near_midpoint


# Codes packed a word (blocks of 128) and a byte (blocks of 114) at a time.
@pytest.mark.parametrize(("shape", "block"), [((16, 1024), 128), ((16, 1026), 114)], ids=str)
def test_given_the_previous_moment_the_signed_code_rounds_to_nearest_where_its_code_changes(
  shape, block
):
  # Where the nearest level's code differs from the previous one, the code is
  # the nearest; where it is the previous one (a move of less than half a
  # level), the stochastic code, as without a previous moment.
  x = moment(shape, "signed", seed=13)
  rng = np.random.default_rng(14)
  near, near_midpoint = nearest_codes(x, block)
  # A previous moment that agrees with the nearest code on about half the
  # elements and is random elsewhere.
  old = np.where(rng.random(shape) < 0.5, near, rng.integers(0, 16, shape))
  old_codes = (old[..., 0::2] | old[..., 1::2] << 4).astype(np.uint8)
  scales = jnp.ones((shape[0], shape[1] // block), jnp.float32)
  previous = states.Signed4bitMoment(jnp.asarray(old_codes), scales)
  kind = mc.FourBitCompressed(0, "signed")
  given = unpack(jax.jit(kind.compress)(jnp.asarray(x), STEP, KEY, previous=previous).codes)
  stochastic = unpack(encode_4bit(jnp.asarray(x), "signed", KEY, STEP).codes)
  kept = (near == old) & ~near_midpoint
  moved = (near != old) & ~near_midpoint
  assert kept.mean() > 0.4 and moved.mean() > 0.4
  np.testing.assert_array_equal(given[moved], near[moved])
  np.testing.assert_array_equal(given[kept], stochastic[kept])
  # The stochastic code is not the nearest everywhere it is kept.
  assert (stochastic[kept] != near[kept]).mean() > 0.1


def test_a_first_moment_fed_a_constant_converges_to_it_without_stalling():
  # b1 = 0.9 fed constants that sit between levels: rounded to nearest alone
  # the stored moment would stop up to five levels short (a step of a tenth of
  # the distance falls within half a level); as the step codes it, it reaches
  # each constant on average.
  rows, n = 64, 128
  target = np.tile(np.linspace(-0.9, 0.9, n, dtype=np.float32), (rows, 1))
  target[:, 0] = 1.0  # each row's scale
  kind = mc.FourBitCompressed(0, "signed")

  def step(stored, t):
    new = 0.9 * kind.decompress(stored) + 0.1 * jnp.asarray(target)
    stored = kind.compress(new, t, KEY, previous=stored)
    return stored, kind.decompress(stored)[:, 1:].mean(0)

  start = kind.compress(jnp.zeros((rows, n), jnp.float32), 0, KEY)
  _, means = jax.lax.scan(step, start, jnp.arange(1, 600))
  # Over the rows and the last 300 steps: a standard deviation of about 0.005.
  got = np.asarray(means)[-300:].mean(0)
  np.testing.assert_allclose(got, target[0, 1:], atol=0.025)
  assert abs(np.mean(got - target[0, 1:])) < 0.005


def test_the_accelerator_program_codes_the_same_bytes_as_the_cpu_s():
  # XLA:GPU's program packs a byte at a time, XLA:CPU's a uint32 word.
  # Given the previous moment, which each program unpacks in its own way.
  x = jnp.asarray(np.random.default_rng(11).normal(size=(4, 1024)), jnp.float32)
  key, step = jnp.uint32(7), jnp.int32(3)
  kind = mc.FourBitCompressed(0, "signed")
  previous = kind.compress(x[::-1], step - 1, key)
  cpu = jax.jit(kind.compress)(x, step, key, previous=previous)
  with forced(ACCELERATOR):
    # A new callable: jax keeps a trace by the function traced, even through a new jit.
    gpu = jax.jit(functools.partial(kind.compress))(x, step, key, previous=previous)
    without = jax.jit(functools.partial(encode_4bit), static_argnums=1)(x, "signed", key, step)
  np.testing.assert_array_equal(np.asarray(cpu.codes), np.asarray(gpu.codes))
  assert np.any(np.asarray(without.codes) != np.asarray(gpu.codes))
  np.testing.assert_array_equal(
    np.asarray(without.codes), np.asarray(encode_4bit(x, "signed", key, step).codes)
  )


def test_words_and_bytes_pack_the_same_bytes():
  # Element 2i in the low nibble of byte i, 2i + 1 in the high one, whether
  # packed and unpacked a byte or a uint32 word (of four bytes) at a time.
  rng = np.random.default_rng(10)
  codes = rng.integers(0, 16, (3, 5, 64)).astype(np.int32)
  expected = (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8)
  for per in (2, 8):
    packed = np.asarray(jax.jit(mc._pack, static_argnums=1)(jnp.asarray(codes), per))
    np.testing.assert_array_equal(packed, expected)
    unpacked = jax.jit(mc._unpack, static_argnums=1)(jnp.asarray(expected), per)
    np.testing.assert_array_equal(np.asarray(unpacked), codes)
  shapes = [(2, n) for n in (1024, 768, 4097, 1026, 11008, 4098)]
  assert [mc._Layout.of(shape).per for shape in shapes] == [8, 8, 8, 2, 2, 2]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion decisions")
@pytest.mark.parametrize("shape", [(256, 1024), (256, 1026), (64, 4097)], ids=str)
@pytest.mark.parametrize("sign", mc.SIGNS)
def test_no_float32_or_int32_array_is_written_out_on_cpu(sign, shape):
  # Encode, decode, and a moment decoded, updated and encoded again (what an
  # optimizer step does) each fuse into loops that write out nothing per
  # element but the uint32 words of the codes (half a byte an element), where
  # a ratio, an int32 code or a decoded moment written out would take 4.
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  g = jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  def encode(x):
    return encode_4bit(x, sign, KEY, STEP)

  def step(stored, g):
    g = g.astype(jnp.float32)
    new = 0.9 * decode_4bit(stored) + 0.1 * (g * g if sign == "nonnegative" else g)
    return mc.FourBitCompressed(0, sign).compress(new, STEP, KEY, previous=stored)

  stored = jax.eval_shape(encode, x)
  for f, args in [(encode, (x,)), (decode_4bit, (stored,)), (step, (stored, g))]:
    scratch = jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert scratch <= 1.1 * np.prod(shape), (f, scratch / np.prod(shape))


def test_bad_arguments_are_refused():
  x = jnp.ones((8, 512))
  with pytest.raises(ValueError, match="one or more axes"):
    encode_4bit(jnp.ones(()), "signed", KEY, STEP)
  with pytest.raises(ValueError, match="expected"):
    encode_4bit(x, "signed", KEY, STEP, scales=jnp.ones((8, 3)))
  with pytest.raises(ValueError, match="expected"):
    encode_4bit(x, "nonnegative", KEY, STEP, scales=jnp.ones((8, 5)))
  with pytest.raises(ValueError, match="expected"):
    encode_4bit(x, "nonnegative", KEY, STEP, scales=jnp.ones((512,)))
  with pytest.raises(ValueError, match="expected"):
    decode_4bit(states.Signed4bitMoment(jnp.zeros((8, 256), jnp.uint8), jnp.ones((8, 7))))


@pytest.mark.slow
def test_the_error_benchmark_ranks_the_formats_as_the_docs_say(tmp_path):
  """benchmarks/moment_codes_4bit_error.py at a small size (no torchao): the
  per-field pairing (8-bit mu, 4-bit nu) holds Adam's direction closer to
  float32's than 4 bits for both, and 8 bits closer still; 4 bits closer
  with mu rounded to nearest where it moves than stochastically throughout,
  and the direction's mean size closer to float32's; no positive nu is
  stored as zero (docs/moment_codes.md, "4 bits")."""
  script = cli_output.BENCHMARKS / "moment_codes_4bit_error.py"
  args = ["--steps", "60", "--shape", "128x512", "--df", "2.5"]
  result = cli_output.run_script(script, *args, "--workdir", str(tmp_path), "--torch-python", "")
  assert result.returncode == 0, result.stderr[-4000:]
  table = cli_output.markdown_rows(result.stdout)  # the first: per format, after the last step
  (_, header), *formats = table.items()
  rows = {name: dict(zip(header, cells, strict=True)) for name, cells in formats}
  direction = {name: float(row["dir err"]) for name, row in rows.items()}
  assert direction["mpx 8bit"] < direction["mpx 8bit mu + 4bit nu"] < direction["mpx 4bit"]
  assert direction["mpx 4bit"] < 0.9 * direction["mpx 4bit, mu stochastic"]
  size = {name: float(row["dir size"]) for name, row in rows.items()}
  assert abs(size["mpx 4bit"] - 1) < abs(size["mpx 4bit, mu stochastic"] - 1)
  assert all(int(row["zeros sum"]) == 0 for row in rows.values())


def test_the_range_words_of_edge_blocks_are_the_reference_s():
  # Blocks of near-equal values, of one value (of 11 mantissa bits: the top
  # itself, no step), past the floor, of zeros, of zeros but one, subnormal,
  # near float32's largest, and one value between two of 11 mantissa bits.
  rng = np.random.default_rng(3)
  blocks = {
    "near": rng.uniform(0.9, 1.0, 128),
    "one value": np.full(128, 0.75),
    "wide": 2.0 ** rng.uniform(-20, 0, 128),
    "zeros": np.zeros(128),
    "one positive": np.eye(1, 128, 7)[0] * 3.0,
    "subnormal": np.full(128, 1e-40),
    "huge": np.full(128, 3.4e38) * rng.uniform(0.5, 1.0, 128),
    "between": np.full(128, 1.0 + 2.0**-20),
  }
  x = np.stack(list(blocks.values())).astype(np.float32).reshape(2, 4 * 128)
  x[0, :5] = 0.0
  ref = ref_range(x)
  draws = [round_trip(x, "nonnegative", step=jnp.int32(t)) for t in range(64)]
  words = np.asarray(draws[0][0][1]).view(np.uint32)
  np.testing.assert_array_equal(words, ref["word"])
  steps = dict(zip(blocks, ref["step"].reshape(-1), strict=True))
  assert steps["one value"] == 0 and steps["zeros"] == 0 and steps["one positive"] == 0
  assert steps["between"] == STEP_UNIT  # 2**-20 above 1, the top 2**-11 above: one unit
  assert 0 < steps["near"] <= 0.2 * OCTAVE / 14 + STEP_UNIT
  assert steps["wide"] == MAX_STEPS * STEP_UNIT
  assert steps["subnormal"] == 0  # the top held at the smallest normal: no room below it
  _, low_value, _, high_value, near = ref_neighbours(x, "nonnegative")
  decoded = np.stack([d for _, d in draws])
  on_neighbour = (decoded == low_value) | (decoded == high_value)
  assert np.all(on_neighbour[:, ~near])
  np.testing.assert_array_equal(decoded[:, x <= 0], 0)
  assert np.all(decoded[:, x > 0] >= TINY) and np.all(np.isfinite(decoded))
  one_value = x.reshape(8, 128)[1]
  np.testing.assert_array_equal(
    decoded.reshape(64, 8, 128)[:, 1], np.broadcast_to(one_value, (64, 128))
  )


class SavedBefore(NamedTuple):
  """The nonnegative 4-bit moment as states saved before the range levels
  held it: each block's largest value in ``scales``."""

  codes: jax.Array
  scales: jax.Array


def saved_before(state: Any) -> Any:
  """``state`` with each ``Nonnegative4bitMoment`` as such a saved state's."""
  return jax.tree.map(
    lambda x: SavedBefore(*x) if isinstance(x, states.Nonnegative4bitMoment) else x,
    state,
    is_leaf=lambda x: isinstance(x, states.Nonnegative4bitMoment),
  )


def test_a_state_saved_before_the_range_levels_is_refused_on_restore(tmp_path):
  # Its words were block maxima: decoded as ranges they would be wrong, so
  # the field that holds them is named anew, and restoring one fails by name.
  params = {"w": jnp.ones((16, 256), jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.adam(1e-3), moments="4bit")
  state = tx.init(params)
  old = saved_before(state)
  with pytest.raises(ValueError, match="field names"):
    flax_serialization.from_state_dict(state, flax_serialization.to_state_dict(old))
  ocp = pytest.importorskip("orbax.checkpoint")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "old", old)
    checkpointer.wait_until_finished()
    with pytest.raises(ValueError, match="ranges|scales|structure"):
      checkpointer.restore(tmp_path / "old", jax.eval_shape(lambda: state))


@pytest.mark.slow
def test_on_the_demo_s_gradients_4_bit_moments_make_updates_of_float32_s_size():
  """benchmarks/demo_update_size.py at 200 steps: fed FP32 AdamW's gradients
  along its own run of the demo, a 4-bit state's updates are as large as
  FP32's within 3% once the warmup is past (a 4-bit ``nu`` rounded unbiased
  made them 6% to 7% larger, as a larger learning rate would:
  docs/moment_codes.md, "4 bits")."""
  result = cli_output.run_script(cli_output.BENCHMARKS / "demo_update_size.py", "--steps", "200")
  assert result.returncode == 0, result.stderr[-4000:]
  rows = cli_output.markdown_rows(result.stdout)
  names = ("8bit", "4bit", "nu 4bit", "mu 8bit, nu 4bit")
  assert set(names) <= set(rows), result.stdout
  sizes = {name: [float(c) for c in rows[name][1:4]] for name in names}  # the last 3 quarters
  for name, quarters in sizes.items():
    assert all(abs(q - 1) < 0.03 for q in quarters), (name, quarters)


@pytest.mark.parametrize("sign", mc.SIGNS)
@pytest.mark.parametrize("shape", [(3, 1024), (3, 1026), (3, 301), (2, 6)], ids=str)
def test_decode_by_table_is_bitwise_decode(sign, shape):
  # Every code in words and in bytes, an odd row (decoded by decode itself),
  # normal, subnormal-product and zero scales.
  rng = np.random.default_rng(12)
  stored_like = stored_shapes(shape, sign)
  codes = rng.integers(0, 256, stored_like.codes.shape).astype(np.uint8)
  codes[0, : min(128, codes.shape[-1])] = np.arange(min(128, codes.shape[-1]))
  scales = np.float32(3.5) * rng.random(stored_like[1].shape).astype(np.float32)
  scales[1] = np.float32(1e-37)
  scales[-1, 0] = 0.0
  stored = mc.STORED_TYPES_4BIT[sign](jnp.asarray(codes), jnp.asarray(scales))
  decoded = np.asarray(decode_4bit(stored))
  np.testing.assert_array_equal(
    np.asarray(kind_of(stored).decompress(stored, by_table=True)).view(np.uint32),
    decoded.view(np.uint32),
  )
