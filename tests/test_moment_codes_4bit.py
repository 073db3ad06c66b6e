"""The 4-bit moment codes (``mpx/_src/moment_codes.py``'s ``FourBitCompressed``) against numpy
float64 references written here from their definitions: the signed map
``(j / 7) ** 2`` and the nonnegative float-like map without zero, in blocks
of 128 (no column scales: each row codes on its own); then what the
stored form promises: no positive value to zero, exact block maxima, clamping,
odd shapes, jit, unbiased stochastic rounding, the bytes it costs; and, on
XLA:CPU, that nothing per element is written out between passes. Shapes whose
blocks are multiples of 8 (1024, 768, 4097) pack codes a uint32 word at a
time, others (1026, 11008, 4098) a byte at a time: both layouts are tested."""

import functools
import sys

import cli_output
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering_forms import ACCELERATOR, forced

from mpx._src import moment_codes as mc
from mpx._src import moments, states

if str(cli_output.BENCHMARKS.parent) not in sys.path:
  sys.path.insert(0, str(cli_output.BENCHMARKS.parent))

from benchmarks import range_codes

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


def float_map() -> np.ndarray:
  """The nonnegative levels by code: 0 (an input of exactly zero); codes 5 ..
  15 count half-octaves up from ``2**-5``: ``2**-e`` when ``15 - k = 2e``,
  ``3/4 * 2**-e`` when ``15 - k = 2e + 1``; codes 1 .. 4 the octaves
  ``2**-9`` .. ``2**-6``."""
  values = [0.0]
  for k in range(1, 16):
    e, odd = divmod(15 - k, 2)
    values.append(2.0 ** -(10 - k) if k < 5 else 2.0**-e * (0.75 if odd else 1.0))
  return np.asarray(values)


SMALLEST = 2.0**-9  # the nonnegative code's smallest level


def levels_of(sign: str) -> np.ndarray:
  return signed_map() if sign == "signed" else float_map()


def ref_scales(x: np.ndarray, block: int = 128) -> np.ndarray:
  """Each element's scale, float64, for either sign: its block's largest
  magnitude (blocks of ``block`` along the last axis of a 2-D ``x``, which it
  must divide)."""
  x = x.astype(np.float64)
  rows, n = x.shape
  b = np.abs(x).reshape(rows, n // block, block)
  return np.broadcast_to(b.max(-1, keepdims=True), b.shape).reshape(x.shape)


def ref_neighbours(x: np.ndarray, sign: str) -> tuple[np.ndarray, ...]:
  """``(codes, values)`` of the levels below-or-at and above each element (the
  same where it is a level, or above 1), and where float32 may see the other
  side of a level (within 1e-6 of one, not on it)."""
  scale = ref_scales(x)
  a = np.abs(x) / np.where(scale > 0, scale, 1)
  levels = levels_of(sign)
  high = np.clip(np.searchsorted(levels, a, side="left"), 0, len(levels) - 1)
  low = np.where(levels[high] > a, high - 1, high)
  if sign == "nonnegative":
    low, high = np.maximum(low, 1), np.maximum(high, 1)  # only an exact zero takes code 0
  distance = np.abs(a[..., None] - levels)
  near_level = ((distance > 0) & (distance < 1e-6)).any(-1)
  out = []
  for code in (low, high):
    value = levels[code] * scale
    if sign == "signed":
      value = np.sign(x) * value
      code = code | np.where((x < 0) & (code > 0), 8, 0)
    else:
      code = np.where(x > 0, code, 0)
      value = np.where(x > 0, value, 0.0)
    out += [code, value]
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


def test_the_levels_are_the_maps():
  np.testing.assert_allclose(mc.SIGNED_LEVELS_4BIT, signed_map(), rtol=1e-7)
  np.testing.assert_allclose(mc.NONNEGATIVE_LEVELS_4BIT, float_map(), rtol=1e-7)
  # The nonnegative levels are floats with one mantissa bit, decoded from the
  # code's bits: each code decodes to exactly its level at scale 1.
  codes = jnp.asarray(np.arange(16, dtype=np.uint8).reshape(8, 2) @ np.array([1, 16], np.uint8))
  decoded = decode_4bit(states.Nonnegative4bitMoment(codes, jnp.ones((1,), jnp.float32)))
  np.testing.assert_array_equal(np.asarray(decoded), float_map().astype(np.float32))


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
  scale = ref_scales(x)
  value = np.where(codes == low, low_value, high_value)
  np.testing.assert_allclose(decoded[ok], value[ok], rtol=0, atol=1e-6 * scale.max())


@pytest.mark.parametrize("sign", mc.SIGNS)
def test_the_error_is_within_the_level_spacing(sign):
  x = moment((16, 1024), sign, seed=1)
  _, decoded = round_trip(x, sign)
  scale = ref_scales(x)
  a = np.abs(x) / scale
  levels = signed_map() if sign == "signed" else float_map()[1:]
  bound = spacing(np.maximum(a, levels[0]), levels) * scale
  error = np.abs(decoded - x)
  if sign == "nonnegative":
    # Below the smallest level, a value is raised to it.
    below = a < SMALLEST
    assert below.sum() > 10
    np.testing.assert_allclose(decoded[below], scale[below] * SMALLEST, rtol=1e-6)
    bound = np.where(below, (SMALLEST - a) * scale, bound)
  assert np.all(error <= bound * (1 + 1e-5) + 1e-7 * scale)


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
  # Here every positive value is its block's maximum or below the smallest level: none
  # decodes below itself.
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


@pytest.mark.parametrize("sign", mc.SIGNS)
def test_each_block_maximum_decodes_exactly(sign):
  x = moment((16, 1024), sign, seed=3)
  if sign == "signed":
    x[::2] *= -1  # rows whose largest magnitude is negative
  _, decoded = round_trip(x, sign)
  blocks = np.abs(x).reshape(16, 8, 128)
  at = (blocks == blocks.max(-1, keepdims=True)).reshape(x.shape)
  assert at.sum() >= 16 * 8
  np.testing.assert_array_equal(decoded[at], x[at])


# One block of 100 (the division by a broadcast scale must stay a division),
# blocks of 96 and 86, a short last block (4098: 33 of 126), an odd row.
LAYOUTS = [(16, 100), (4, 768), (2, 11008), (3, 4098), (2, 4097)]


@pytest.mark.parametrize("shape", LAYOUTS, ids=str)
@pytest.mark.parametrize("sign", mc.SIGNS)
def test_each_block_maximum_decodes_exactly_in_every_layout(sign, shape):
  x = moment(shape, sign, seed=9)
  _, decoded = round_trip(x, sign)
  body = shape[-1] - shape[-1] % 2
  size, blocks = mc.block_layout((body,), 4)
  padded = np.zeros((*shape[:-1], size * blocks), np.float32)
  padded[..., :body] = np.abs(x[..., :body])
  maxima = padded.reshape(*shape[:-1], blocks, size).max(-1)
  at = padded == np.repeat(maxima, size, axis=-1)
  at = at[..., :body] & (padded[..., :body] > 0)
  assert at.sum() >= np.prod(shape[:-1]) * blocks
  np.testing.assert_array_equal(decoded[..., :body][at], x[..., :body][at])
  np.testing.assert_array_equal(decoded[..., body:], x[..., body:])  # an odd row's last


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
  gap = np.diff(levels_of(sign)).max()
  for i in range(len(x)):
    row, alone = round_trip(x[i], sign)
    np.testing.assert_array_equal(np.asarray(matrix.scales)[i], np.asarray(row.scales))
    # Rounded with the random bits of another shape: a neighbouring level at most.
    scale = np.repeat(np.asarray(row.scales), size)[:n]
    assert np.all(np.abs(decoded[i] - alone) <= gap * scale * (1 + 1e-6))
  np.testing.assert_array_equal(
    np.asarray(maxima_4bit(jnp.asarray(x), sign)), np.asarray(matrix.scales)
  )


@pytest.mark.parametrize("sign", mc.SIGNS)
def test_scales_smaller_than_a_value_clamp_to_the_top_level(sign):
  x = moment((16, 1024), sign, seed=4)
  true = np.asarray(maxima_4bit(jnp.asarray(x), sign))
  np.testing.assert_array_equal(true, np.abs(x).reshape(16, 8, 128).max(-1))
  for factor in (0.25, 1e-30):
    small = true * np.float32(factor)
    _, decoded = round_trip(x, sign, scales=jnp.asarray(small))
    given = np.repeat(small, 128, axis=-1)
    over = np.abs(x) >= given
    assert over.mean() > 0.01
    expected = np.sign(x[over]) * given[over]
    if sign == "nonnegative":
      expected = np.maximum(expected, TINY)
    np.testing.assert_array_equal(decoded[over], expected)
    assert np.all(np.abs(decoded) <= np.maximum(given, TINY))
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
    assert stored[sign]._fields == ("codes", "scales")
    assert [(s.shape, s.dtype) for s in stored[sign]] == [(s.shape, s.dtype) for s in like]
    x, out = np.asarray(xs[sign]), np.asarray(decoded[sign])
    assert out.shape == shape and out.dtype == np.float32
    rows = np.abs(x).max(-1, keepdims=True)
    # Stochastic: within one level gap (at most 0.265 signed, 0.25 nonnegative).
    bound = np.diff(levels_of(sign)).max() * (1 + 1e-6)
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
def test_stochastic_rounding_keeps_the_mean_signed_the_mean_log_nonnegative(sign):
  # Signed codes round unbiased; nonnegative ones keep each value's log on
  # average (docs/moment_codes.md, "4 bits"), which the value's own mean
  # would not: rounded unbiased, the mean log falls 5% of a gap short.
  x = moment((4, 1024), sign, seed=7)
  encode, decode = coder(sign)
  steps = jnp.arange(64, dtype=jnp.int32)
  draws = np.asarray(jax.vmap(lambda t: decode(encode(jnp.asarray(x), KEY, t)))(steps))
  _, low, _, high, near_level = ref_neighbours(x, sign)
  scale = ref_scales(x)
  a = np.abs(x) / scale
  inside = (a > 0 if sign == "signed" else a >= SMALLEST) & (low != high) & ~near_level
  kept = (lambda v: v) if sign == "signed" else (lambda v: np.log(np.where(v > 0, v, 1.0)))
  # Each draw is one of the two levels around x: the mean of 64 has a standard
  # deviation of at most 1/16 of their gap, and of all 4096 * 64, 1/1024.
  kept_gap = np.abs(kept(high) - kept(low))[inside]
  deviation = (kept(draws).mean(0) - kept(x))[inside] / kept_gap
  assert np.all(np.abs(deviation) < 0.5)
  assert abs(deviation.mean()) < 0.01
  levels = signed_map() if sign == "signed" else float_map()[1:]
  gap = spacing(np.maximum(a, levels[0]), levels) * scale
  # Random: an element between two levels takes both over 64 steps.
  off_level = np.abs(a[..., None] - levels).min(-1) * scale > 1e-3 * gap
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


def test_the_benchmark_s_range_levels_code_as_their_docstring_says():
  """benchmarks/range_codes.py, the second-moment code the 4-bit benchmark
  measures beside mpx's, against a reference written from its docstring on
  the float32 bits: each block's word holds its largest value rounded up to
  11 mantissa bits and the bits down to its smallest positive value (at most
  9 octaves) rounded up to 1/256 octave, with the sign bit set; a value
  rounds only to one of the two levels beside it, even in the bits between
  those ends, unbiased in the bits; zero stays zero; a positive value is
  never zero; a zero block codes to zeros."""
  rng = np.random.default_rng(3)
  near = rng.uniform(0.9, 1.0, (4, 128))  # a second moment of near-Gaussian gradients
  wide = 2.0 ** rng.uniform(-20, 0, (4, 128))  # of heavy tails: past the floor
  steady = rng.uniform(0.999, 1.0, (4, 128))
  x = np.concatenate([near, wide, np.zeros((4, 128)), steady], axis=1).astype(np.float32)
  x[0, :5] = 0.0
  draws = 400
  runs = [range_codes.encode(jnp.asarray(x), KEY, jnp.int32(t)) for t in range(draws)]
  decoded = np.stack([np.asarray(range_codes.decode(run)) for run in runs]).reshape(
    draws, 4, 4, 128
  )
  blocks = x.reshape(4, 4, 128)
  bits = blocks.view(np.int32).astype(np.int64)
  word = np.asarray(runs[0][1]).view(np.uint32).astype(np.int64)
  assert np.all(word >> 31 == 1)
  top = (word & 0x7FFFF000)[..., None]
  largest = bits.max(-1, keepdims=True)
  assert np.all((top >= largest) & (top < largest + 2**12))
  positive = blocks > 0
  smallest = np.where(positive, bits, 2**31).min(-1, keepdims=True)
  octave = 2**23
  span = np.where(largest > 0, np.minimum(top - smallest, 9 * octave), 0)
  stored = (word & 0xFFF)[..., None] * 2**15
  assert np.all((stored >= span) & (stored < span + 2**15))
  # 0.9 to 1 is 0.2 of the octave [0.5, 1) in the bits: levels 0.1 / 14 apart, under 0.8%
  assert stored[:, 0].max() < 0.2 * octave + 2 * 2**15
  step = stored / 14
  base = top - stored
  position = np.clip((bits - base) / np.where(step > 0, step, 1), 0, 14)
  below = base + np.round(np.floor(position) * step)
  above = base + np.round(np.minimum(np.floor(position) + 1, 14) * step)
  got = decoded.view(np.int32).astype(np.int64)
  off = np.minimum(np.abs(got - below), np.abs(got - above))
  assert np.all((off <= 1 + step * 2.0**-18) | ~positive)  # float32's (k - 1) * step
  assert np.all((decoded > 0) == positive)
  inside = positive & (bits > base)
  mean_bits = got.mean(0)
  spread = np.broadcast_to(step * np.sqrt(0.25 / draws), bits.shape)  # a draw's sd <= half a step
  assert np.all(np.abs(mean_bits - bits)[inside] < 5 * spread[inside] + 1)
  assert range_codes.bytes_per_element((8, 256)) == 0.5 + 4 / 128


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
  scales = np.float32(3.5) * rng.random(stored_like.scales.shape).astype(np.float32)
  scales[1] = np.float32(1e-37)
  scales[-1, 0] = 0.0
  stored = mc.STORED_TYPES_4BIT[sign](jnp.asarray(codes), jnp.asarray(scales))
  decoded = np.asarray(decode_4bit(stored))
  np.testing.assert_array_equal(
    np.asarray(kind_of(stored).decompress(stored, by_table=True)).view(np.uint32),
    decoded.view(np.uint32),
  )
