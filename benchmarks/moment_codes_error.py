"""How far compressed Adam moments stray from float32 Adam's, fed the same gradients.

Prints the error of the stored moments and of Adam's update per format, rounding and
gradient distribution; docs/moment_codes.md explains the tables and quotes a run."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import timeit
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import moment_codes as mc
from mpx._src import rounding

B1, B2, EPS = 0.9, 0.999, 1e-8
Array = jax.Array


def gradients(name: str, shape: tuple[int, int], steps: int) -> Callable[[Array], Array]:
  """The gradient of step ``t`` (int32) for one named distribution."""
  rows, cols = shape
  k = jax.random.split(jax.random.key(7), 4)
  log_uniform = lambda s: 10.0 ** (-3 * jax.random.uniform(k[0], s))  # noqa: E731
  if name == "gauss rows 1000x":
    scale = log_uniform((rows, 1))
  elif name == "gauss cols 1000x":
    # Scales varying along the last axis: within every block.
    scale = log_uniform((1, cols))
  elif name == "heavy tails":
    # Student t (3 degrees of freedom), 1% of columns 100x larger (outlier features).
    scale = 1.0 + 99.0 * (jax.random.uniform(k[0], (1, cols)) < 0.01)
  elif name == "sparse":
    # Each element updated with its own frequency, from 1e-3 to 1 (embedding
    # rows of rare tokens), near zero otherwise.
    frequency = log_uniform((rows, cols))
  elif name == "drifting mean":
    amplitude = jax.random.normal(k[0], shape)
    phase = jax.random.uniform(k[1], shape) * 2 * np.pi
  else:
    raise ValueError(name)

  def draw(t: Array) -> Array:
    key = jax.random.fold_in(k[3], t)
    a, b = jax.random.split(key)
    if name == "heavy tails":
      return scale * jax.random.t(a, 3.0, shape)
    noise = jax.random.normal(a, shape)
    if name == "sparse":
      on = jax.random.uniform(b, shape) < frequency
      return jnp.where(on, noise, 1e-6 * noise)
    if name == "drifting mean":
      # The mean turns over once in 2 * steps: nu rises and falls slowly.
      mean = amplitude * jnp.cos(phase + np.pi * t / steps)
      return mean + 0.3 * noise
    return scale * noise

  return draw


DISTRIBUTIONS = ("gauss rows 1000x", "gauss cols 1000x", "heavy tails", "sparse", "drifting mean")

Encode = Callable[[Array, Array, Array], Any]  # (x, key, step) -> stored
Decode = Callable[[Any], Array]
Encoding = tuple[Encode, Decode]
IDENTITY: tuple[Encode, Decode] = (lambda x, key, step: x, lambda x: x)
ROUNDING = {False: "nearest", True: "stochastic"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = ", re.MULTILINE)  # a line of HLO text


@dataclasses.dataclass(frozen=True)
class Format:
  """How one Adam state stores ``mu`` and ``nu``."""

  name: str
  encode_mu: Encode
  decode_mu: Decode
  encode_nu: Encode
  decode_nu: Decode


def mpx_format(name: str, mu_stochastic: bool, nu_stochastic: bool | None = None) -> Format:
  """mpx's ``"bfloat16"`` or ``"8bit"`` format, each moment rounded as told."""
  nu_st = mu_stochastic if nu_stochastic is None else nu_stochastic
  label = f"{name} {ROUNDING[mu_stochastic]}"
  if mu_stochastic != nu_st:
    label = f"{name} mu {ROUNDING[mu_stochastic][:4]}, nu {ROUNDING[nu_st][:4]}"
  if name == "8bit":
    return Format(label, *coder(None, "signed", mu_stochastic), *coder(None, "nonnegative", nu_st))
  decode = lambda values: jnp.asarray(values).astype(jnp.float32)  # noqa: E731 (exact)
  bf16 = lambda st: (functools.partial(encode_bfloat16, stochastic=st), decode)  # noqa: E731
  return Format(label, *bf16(mu_stochastic), *bf16(nu_st))


def encode_bfloat16(x: Array, key: Array, step: Array, stochastic: bool) -> Array:
  """mpx's bfloat16 moment (stochastic), or the variant it does not offer: to nearest."""
  nearest = rounding.canonical(jnp.asarray(x, jnp.float32)).astype(jnp.bfloat16)
  return mc.Bfloat16Compressed(0).compress(x, step, key).values if stochastic else nearest


def coder(table: Any, sign: mc.Sign, stochastic: bool, four_bit: bool = False) -> Encoding:
  """One moment's encode and decode: mpx's 8-bit code (``table`` None, stochastic),
  else by a sorted table (None: the 8-bit levels) in the 8- (4-) bit code's blocks,
  absmax scales, rounded as told: variants mpx does not offer (to nearest)."""
  if table is None and stochastic:
    kind = mc.EightBitCompressed(0, sign)
    return (lambda x, key, step: kind.compress(x, step, key)), kind.decompress
  levels = np.unique(mc.level_table(sign)) if table is None else np.asarray(table, np.float32)
  wide = lambda s: jnp.asarray(levels)[_rows(s[0], four_bit)] * s[1][..., None]  # noqa: E731
  return (
    lambda x, key, step: _table_encode(levels, x, key, step, stochastic, four_bit),
    lambda s: wide(s).reshape((*s[0].shape[:-1], -1))[..., : s[0].shape[-1]],
  )


def float_levels(signed: bool, regions: list[tuple[int, int]]) -> np.ndarray:
  """The sorted levels of a float-like code of ``(octaves, mantissa bits)`` regions."""
  sign = "signed" if signed else "nonnegative"
  return np.unique(mc.level_table(sign, mc._float_code(signed, tuple(regions))))


def power_levels(signed: bool, p: float) -> np.ndarray:
  """Power companding: levels ``(c / 127)**p`` (signed) or ``(c / 255)**p``."""
  v = (np.arange(128) / 127) ** p if signed else (np.arange(256) / 255) ** p
  return np.concatenate([-v[:0:-1], v]) if signed else v


def dynamic_map(signed: bool) -> np.ndarray:
  """bitsandbytes' dynamic map as its paper describes it: decade ``i`` (10**-6 ..
  10**0) holds ``2**i`` (signed) or ``2**(i+1)`` points in (0.1, 1) of it, and 0, 1."""
  points = [0.0, 1.0]
  for i in range(7):
    n = 2**i if signed else 2 ** (i + 1)
    edges = np.linspace(0.1, 1.0, n + 1)
    means = 10.0 ** (i - 6) * (edges[:-1] + edges[1:]) / 2
    points += list(means) + (list(-means) if signed else [])
  return np.sort(np.asarray(points, np.float32))


def linear_map(signed: bool) -> np.ndarray:
  """Absmax int8: 255 evenly spaced levels in [-1, 1], or 256 in [0, 1]."""
  return np.linspace(-1, 1, 255) if signed else np.linspace(0, 1, 256)


def _rows(x: Array, four_bit: bool = False) -> Array:
  """``x``'s last axis cut into the blocks of mpx's 8-bit (or 4-bit) code."""
  layout = mc.block_layout(x.shape, 4 if four_bit else 8)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, layout[0] * layout[1] - x.shape[-1])])
  return x.reshape((*x.shape[:-1], layout[1], layout[0]))


def _table_encode(
  table: np.ndarray, x: Array, key: Array, step: Array, stochastic: bool, four_bit: bool
) -> tuple[Array, Array]:
  """Codes as indices into a sorted table of levels and per-block absmax scales;
  as mpx's codes, no positive value to zero in a nonnegative ([0, 1]) table."""
  blocked = _rows(x, four_bit)
  scales = jnp.max(jnp.abs(blocked), axis=-1)
  a = blocked / jnp.where(scales > 0, scales, 1)[..., None]
  levels = jnp.asarray(table)
  high = jnp.clip(jnp.searchsorted(levels, a), 1, len(table) - 1)
  lo, hi = levels[high - 1], levels[high]
  p = (a - lo) / (hi - lo)
  bits = rounding.random_bits(key, step, x.shape) >> 8
  u = _rows(bits, four_bit).astype(jnp.float32) * 2.0**-24 if stochastic else 0.5
  index = jnp.where(p > u, high, high - 1)
  if table[0] == 0:
    index = jnp.where((a > 0) & (index == 0), 1, index)
  flat = index.astype(jnp.uint8).reshape((*index.shape[:-2], -1))  # drop the blocks' padding
  codes = flat[..., : x.shape[-1] if x.shape else 1].reshape(x.shape)
  return codes, scales


def _block_rel(c: Array, f: Array) -> Array:
  """``|c - f|_2 / |f|_2`` per block (0 where a block of f is zero)."""
  num = jnp.sum(jnp.square(_rows(c - f)), -1)
  den = jnp.sum(jnp.square(_rows(f)), -1)
  return jnp.where(den > 0, jnp.sqrt(num / jnp.where(den > 0, den, 1)), 0).ravel()


@functools.partial(jax.jit, static_argnames=("fmt", "dist", "shape", "steps", "checkpoints", "b1"))
def run(
  fmt: Format, dist: str, shape: tuple[int, int], steps: int, checkpoints: int, b1: float = B1
) -> dict:
  """Metrics at ``checkpoints`` evenly spaced steps of one run."""
  adam = optax.scale_by_adam(b1, B2, EPS)
  draw = gradients(dist, shape, steps)
  # One key for both moments: mpx's codes salt it per sign.
  key = jnp.asarray(rounding.leaf_key(0, 0))
  zeros = jnp.zeros(shape, jnp.float32)
  stored0 = (fmt.encode_mu(zeros, key, jnp.int32(0)), fmt.encode_nu(zeros, key, jnp.int32(0)))

  def step(carry, t):
    ref, stored, zero_count, _ = carry
    g = draw(t)
    u_ref, ref = adam.update(g, ref)
    # As mixed_precision runs it: decode, one float32 update, encode.
    mu, nu = fmt.decode_mu(stored[0]), fmt.decode_nu(stored[1])
    u, state = adam.update(g, optax.ScaleByAdamState(ref.count - 1, mu, nu))
    stored = (fmt.encode_mu(state.mu, key, t), fmt.encode_nu(state.nu, key, t))
    nu = fmt.decode_nu(stored[1])
    lost = jnp.sum((ref.nu >= np.finfo(np.float32).tiny) & (nu == 0))
    return (ref, stored, zero_count + lost, (u_ref, u)), None

  def chunk(carry, t0):
    carry, _ = jax.lax.scan(step, carry, t0 + jnp.arange(steps // checkpoints))
    ref, stored, zero_count, (u_ref, u) = carry
    mu, nu = fmt.decode_mu(stored[0]), fmt.decode_nu(stored[1])
    positive = ref.nu > 0
    ratio = jnp.where(positive, nu / jnp.where(positive, ref.nu, 1), 0)
    metrics = {
      "mu": _block_rel(mu, ref.mu),
      "nu": _block_rel(nu, ref.nu),
      "update": _block_rel(u, u_ref),
      # The least-squares slope of stored on float32 mu: 1 when unbiased.
      "mu slope": jnp.sum(mu * ref.mu) / jnp.sum(ref.mu * ref.mu),
      "nu bias": jnp.sum(ratio) / jnp.sum(positive),
      "zeros": zero_count,
    }
    return carry, metrics

  carry = (adam.init(zeros), stored0, jnp.int32(0), (zeros, zeros))
  t0 = jnp.arange(checkpoints, dtype=jnp.int32) * (steps // checkpoints) + 1
  return jax.lax.scan(chunk, carry, t0)[1]


@functools.cache
def measure(fmt: Format, dist: str, shape: tuple[int, int], steps: int, b1: float = B1) -> dict:
  """``run``'s metrics as numpy, each run once."""
  return jax.tree.map(np.asarray, run(fmt, dist, shape, steps, CHECKPOINTS, b1))


CHECKPOINTS = 10


def summary(m: dict) -> dict[str, float]:
  median = lambda name: np.median(m[name], axis=1)  # noqa: E731
  return {
    "mu med": median("mu")[-1],
    "mu max": m["mu"][-1].max(),
    "mu drift": median("mu").max(),
    "nu med": median("nu")[-1],
    "nu max": m["nu"][-1].max(),
    "nu drift": median("nu").max(),
    "nu bias": m["nu bias"][-1],
    "zeros": int(m["zeros"][-1]),
    "upd med": median("update")[-1],
    "upd max": m["update"][-1].max(),
  }


def table(rows: list[tuple[str, str, dict[str, float]]], columns: list[str] | None = None) -> None:
  columns = columns or list(rows[0][2])
  print(f"{'distribution':18} {'format':30}" + "".join(f"{c:>10}" for c in columns))
  for dist, name, s in rows:
    cells = "".join(f"{s[c]:>10d}" if c == "zeros" else f"{s[c]:>10.3g}" for c in columns)
    print(f"{dist:18} {name:30}{cells}")
  print(flush=True)


FORMATS = (
  *(mpx_format(name, stochastic) for name in ("bfloat16", "8bit") for stochastic in (False, True)),
  mpx_format("8bit", False, True),  # nu alone stochastic
)


def main_table(shape: tuple[int, int], steps: int) -> None:
  print(f"## mpx's formats: shape {shape}, {steps} steps, b1={B1}, b2={B2}")
  print("mu, nu, upd: relative error per block at the end (median, max over blocks); drift:")
  print("the largest median over the run; nu bias: mean of nu / float32 nu; zeros: positive")
  print("float32 nu stored as 0, summed over every step")
  rows = []
  for dist in DISTRIBUTIONS:
    for fmt in FORMATS:
      rows.append((dist, fmt.name, summary(measure(fmt, dist, shape, steps))))
  table(rows)


def drift_table(shape: tuple[int, int], steps: int, dist: str) -> None:
  print(f"## Over time ({dist}): median nu error per block and nu bias at checkpoints")
  at = [(i + 1) * (steps // CHECKPOINTS) for i in range(CHECKPOINTS)]
  print(f"{'format':22} {'metric':8}" + "".join(f"{t:>8}" for t in at))
  for fmt in FORMATS[:4]:
    m = measure(fmt, dist, shape, steps)
    nu = np.median(m["nu"], axis=1)
    print(f"{fmt.name:22} {'nu err':8}" + "".join(f"{v:>8.3f}" for v in nu))
    print(f"{fmt.name:22} {'nu bias':8}" + "".join(f"{v:>8.4f}" for v in m["nu bias"]))
  print(flush=True)


def slow_momentum_table(shape: tuple[int, int], steps: int) -> None:
  b1 = 0.99
  print(f"## A slow first moment (b1={b1}, as Lion's momentum or Adan's): mu only")
  rows = []
  for dist in ("gauss rows 1000x", "drifting mean"):
    for fmt in FORMATS[:4]:
      m = measure(fmt, dist, shape, steps, b1)
      rows.append((dist, fmt.name, {**summary(m), "mu slope": m["mu slope"][-1]}))
  table(rows, ["mu med", "mu max", "mu drift", "mu slope"])


MU_CANDIDATES = {
  "[3]m4,m3 (mpx)": None,
  "[1]m4,m3": float_levels(True, [(1, 4), (0, 3)]),
  "e4m3": float_levels(True, [(0, 3)]),
  "e3m4": float_levels(True, [(0, 4)]),
  "[1]m5,[2]m4,m2": float_levels(True, [(1, 5), (2, 4), (0, 2)]),
  "power 2": power_levels(True, 2),
  "bnb dynamic": dynamic_map(True),
  "linear": linear_map(True),
}
NU_CANDIDATES = {
  "[1]m6,[2]m4,m3 (mpx)": None,
  "[1]m6,m3": float_levels(False, [(1, 6), (0, 3)]),
  "e5m3": float_levels(False, [(0, 3)]),
  "e4m4": float_levels(False, [(0, 4)]),
  "[2]m5,[12]m3,m2": float_levels(False, [(2, 5), (12, 3), (0, 2)]),
  "power 4": power_levels(False, 4),
  "bnb dynamic": dynamic_map(False),
  "linear": linear_map(False),
}


def candidates_table(shape: tuple[int, int], steps: int, stochastic: bool = True) -> None:
  print(f"## Candidate 8-bit codes, {ROUNDING[stochastic]}, shape {shape}, {steps} steps: one")
  print("moment compressed, the other float32; upd: the error that moment alone causes")
  print("([k]mN: the top k octaves with N mantissa bits; eXmY: float-like, 127/255 levels)")
  nu_columns = ["nu med", "nu max", "nu bias", "zeros", "upd med", "upd max"]
  for moment, sign, candidates, columns in (
    ("mu", "signed", MU_CANDIDATES, ["mu med", "mu max", "upd med", "upd max"]),
    ("nu", "nonnegative", NU_CANDIDATES, nu_columns),
  ):
    rows = []
    for dist in DISTRIBUTIONS:
      for name, levels in candidates.items():
        coded = coder(levels, sign, stochastic)
        mu, nu = (coded, IDENTITY) if moment == "mu" else (IDENTITY, coded)
        fmt = Format(f"{moment}: {name}", *mu, *nu)
        rows.append((dist, fmt.name, summary(measure(fmt, dist, shape, steps))))
    table(rows, columns)


def cost(n: int, repeats: int = 5) -> None:
  cols = n // 4096
  load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
  print(f"## Cost: one float32 leaf of {n} elements, shape (4096, {cols}), CPU, load {load}")
  x = jax.random.normal(jax.random.key(0), (4096, cols)) ** 2
  key, step = jnp.asarray(rounding.leaf_key(0, 0)), jnp.int32(3)

  def timed(f: Callable, *args: Any) -> float:
    jitted = jax.jit(f)
    call = lambda: jax.block_until_ready(jitted(*args))  # noqa: E731
    call()
    return 1e3 * min(timeit.repeat(call, number=1, repeat=repeats))

  round_trip = lambda kind, x, k, c: kind.decompress(kind.compress(x, c, k))  # noqa: E731
  kinds = {f"8bit {s} stochastic": mc.EightBitCompressed(0, s) for s in mc.SIGNS}
  kinds["bfloat16 stochastic"] = mc.Bfloat16Compressed(0)
  cases: dict[str, Callable] = {"float32 read + write (x + 1)": lambda x, k, c: x + 1.0}
  cases.update({name: functools.partial(round_trip, kind) for name, kind in kinds.items()})
  print(f"{'encode + decode':34} {'ms (min of 5)':>14} {'HLO instructions':>17}")
  for name, f in cases.items():
    text = jax.jit(f).lower(x, key, step).compile().as_text()
    ms, n_instructions = timed(f, x, key, step), len(re.findall(INSTRUCTION, text))
    print(f"{name:34} {ms:>14.1f} {n_instructions:>17d}", flush=True)
  print()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--quick", action="store_true", help="small shapes, 200 steps")
  parser.add_argument("--sections", default="main,drift,slow,candidates,cost")
  args = parser.parse_args()
  steps = 200 if args.quick else args.steps
  shape, small = [(16, 512)] * 2 if args.quick else [(64, 1024), (32, 1024)]
  sections: dict[str, Callable[[], None]] = {
    "main": lambda: main_table(shape, steps),
    "drift": lambda: [drift_table(shape, steps, d) for d in ("gauss rows 1000x", "drifting mean")],
    "slow": lambda: slow_momentum_table(shape, steps),
    "candidates": lambda: candidates_table(small, steps),
    "cost": lambda: cost(2**18 if args.quick else 2**24),
  }
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}\n")
  for name in sections:
    if name in args.sections.split(","):
      sections[name]()


if __name__ == "__main__":
  main()
