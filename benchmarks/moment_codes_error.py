"""How far compressed Adam moments stray from float32 Adam's, fed the same
gradients.

Two optax Adam states (b1=0.9, b2=0.999) take one gradient stream: one in
float32, the other stored compressed and run as ``mixed_precision`` will run
it: decode to float32, one ``optax.scale_by_adam`` update, encode. Per format
and rounding, and per gradient distribution, it prints

- ``mu``, ``nu``: the relative error of each stored moment per block of 256
  (``|c - f|_2 / |f|_2`` over the block), the median and the max over blocks,
  at the end and, for the median, the largest over the run (does it drift?);
- ``nu bias``: the mean over elements of ``nu_compressed / nu_float32``;
- ``zeros``: how many times, summed over every step, a positive (normal)
  float32 ``nu`` was stored as zero (the 4-bit paper's failure);
- ``update``: the relative error per block of the update Adam emits,
  ``mu_hat / (sqrt(nu_hat) + eps)``, median and max, at the end.

Then the same at checkpoints through one run (the drift of round to
nearest), a slow first moment (b1=0.99), the candidate 8-bit codes one
moment at a time (other splits of the levels, e4m3/e5m3-like codes, power
companding, bitsandbytes' dynamic map, linear absmax), and the cost of encode
+ decode on a 16M-element leaf against a plain float32 read and write.

The gradient streams, shape (64, 1024) (blocks of 256 along the last axis):
Gaussian with per-row scales spread over 1000x; the same with per-column
scales (so within every block); Student t (3 dof) with 1% of columns 100x
larger; sparse (each element on with its own frequency from 1e-3 to 1, 1e-6
noise otherwise); a mean that turns over slowly plus noise.

Measured (jax 0.10.2, CPU, 2000 steps; update error median / max over blocks):

=====================  ===========  ===========  ===========  ===========  ===========
format                 gauss rows   gauss cols   heavy tails  sparse       drifting
=====================  ===========  ===========  ===========  ===========  ===========
bfloat16 nearest       .082 / .095  .084 / .089  .177 / .192  .275 / .329  .102 / .120
bfloat16 stochastic    .020 / .025  .020 / .024  .020 / .027  .019 / .030  .019 / .022
8bit nearest           .036 / .071  .096 / .203  .150 / .508  .389 / .526  .298 / .500
8bit stochastic        .048 / .058  .134 / .175  .137 / .179  .128 / .255  .099 / .123
=====================  ===========  ===========  ===========  ===========  ===========

``nu`` bias (mean ratio to float32) at step 2000: bfloat16 nearest 1.19,
1.19, 1.49, 2.2, 1.07; 8bit nearest 1.04, 0.97, 0.93, 1.1e3, 0.76; both
stochastic formats 1.000 (+-0.0004) except 8bit on sparse (1.1e3: elements
more than 2**22.7 below their block's largest are raised to the smallest
level). No positive ``nu`` was ever stored as zero. Stochastic rounding's
error settles (8bit, Gaussian rows: median ``nu`` error 0.034 at step 200,
0.056 at 1400, 0.059 at 2000); nearest's grows with the bias (bfloat16: 0.012
at 200, 0.19 at 2000).

Run: ``.venv/bin/python benchmarks/moment_codes_error.py [--steps 2000]
[--quick] [--sections main,drift,slow,candidates,cost]``. CPU only; about 50
minutes on a loaded 2-core machine (``--quick``: a few minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import time
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


# --- Gradient streams ------------------------------------------------------


def _log_uniform(key: Array, shape: tuple[int, ...], decades: float) -> Array:
  return 10.0 ** (-decades * jax.random.uniform(key, shape))


def gradients(name: str, shape: tuple[int, int], steps: int) -> Callable[[Array], Array]:
  """The gradient of step ``t`` (int32) for one named distribution."""
  rows, cols = shape
  k = jax.random.split(jax.random.key(7), 4)
  if name == "gauss rows 1000x":
    scale = _log_uniform(k[0], (rows, 1), 3)
  elif name == "gauss cols 1000x":
    # Scales varying along the last axis: within every block.
    scale = _log_uniform(k[0], (1, cols), 3)
  elif name == "heavy tails":
    # Student t (3 degrees of freedom), 1% of columns 100x larger (outlier features).
    scale = 1.0 + 99.0 * (jax.random.uniform(k[0], (1, cols)) < 0.01)
  elif name == "sparse":
    # Each element updated with its own frequency, from 1e-3 to 1 (embedding
    # rows of rare tokens), near zero otherwise.
    frequency = _log_uniform(k[0], (rows, cols), 3)
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


# --- Formats ---------------------------------------------------------------

Encode = Callable[[Array, Array, Array], Any]  # (x, key, count) -> stored
Decode = Callable[[Any], Array]
IDENTITY: tuple[Encode, Decode] = (lambda x, key, count: x, lambda x: x)


@dataclasses.dataclass(frozen=True)
class Format:
  """How one Adam state stores ``mu`` and ``nu``."""

  name: str
  encode_mu: Encode
  decode_mu: Decode
  encode_nu: Encode
  decode_nu: Decode


def _rounding(stochastic: bool) -> str:
  return "stochastic" if stochastic else "nearest"


def bfloat16(mu_stochastic: bool, nu_stochastic: bool | None = None) -> Format:
  nu_stochastic = mu_stochastic if nu_stochastic is None else nu_stochastic
  coder = lambda st: (  # noqa: E731
    lambda x, key, count: mc.encode_bfloat16(x, key, count, st),
    mc.decode_bfloat16,
  )
  return Format(
    _name("bfloat16", mu_stochastic, nu_stochastic), *coder(mu_stochastic), *coder(nu_stochastic)
  )


def eightbit(mu_stochastic: bool, nu_stochastic: bool | None = None) -> Format:
  """mpx's 8-bit codes."""
  nu_stochastic = mu_stochastic if nu_stochastic is None else nu_stochastic
  return Format(
    _name("8bit", mu_stochastic, nu_stochastic),
    *coder(mc.CODES["signed"], "signed", mu_stochastic),
    *coder(mc.CODES["nonnegative"], "nonnegative", nu_stochastic),
  )


def _name(format_name: str, mu_stochastic: bool, nu_stochastic: bool) -> str:
  if mu_stochastic == nu_stochastic:
    return f"{format_name} {_rounding(mu_stochastic)}"
  return f"{format_name} mu {_rounding(mu_stochastic)[:4]}, nu {_rounding(nu_stochastic)[:4]}"


def coder(code: Any, kind: str, stochastic: bool) -> tuple[Encode, Decode]:
  """Encode and decode of one moment: an mpx ``_Code`` or a table of levels."""
  if isinstance(code, mc._Code):
    enc = lambda x, key, count: mc._encode(code, x, mc._salted(key, kind), count, stochastic)  # noqa: E731
    return enc, functools.partial(mc._decode, code)
  table = np.asarray(code, np.float32)
  return (
    lambda x, key, count: _table_encode(table, x, key, count, stochastic),
    functools.partial(_table_decode, table),
  )


def float_levels(signed: bool, regions: list[tuple[int, int]]) -> np.ndarray:
  """The levels of a float-like code as a table (127 or 255 nonzero levels
  counted down from 1.0 over ``(octaves, mantissa bits)`` regions, the last
  taking the rest), so candidates need no code of their own."""
  n = 127 if signed else 255
  levels, octave = [1.0], 0
  for i, (octaves, mantissa) in enumerate(regions):
    for _ in range(10**6 if i == len(regions) - 1 else octaves):
      octave -= 1
      for j in reversed(range(2**mantissa)):
        if len(levels) < n:
          levels.append(2.0**octave * (1 + j / 2**mantissa))
    if len(levels) == n:
      break
  v = np.array(levels[::-1])
  return np.concatenate([-v[::-1], [0.0], v]) if signed else np.concatenate([[0.0], v])


def power_levels(signed: bool, p: float) -> np.ndarray:
  """Power companding: levels ``(c / 127)**p`` (signed) or ``(c / 255)**p``."""
  v = (np.arange(128) / 127) ** p if signed else (np.arange(256) / 255) ** p
  return np.concatenate([-v[:0:-1], v]) if signed else v


def dynamic_map(signed: bool) -> np.ndarray:
  """bitsandbytes' dynamic ("dynamic tree") map, from the paper's
  description: decade ``i`` (10**-6 .. 10**0) holds ``2**i`` (signed) or
  ``2**(i+1)`` (unsigned) evenly spaced points in (0.1, 1) of it, plus 0 and 1."""
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


def _table_encode(
  table: np.ndarray, x: Array, key: Array, count: Array, stochastic: bool
) -> mc.QuantizedMoment:
  """Codes as indices into a sorted table of levels in [-1, 1] (in [0, 1]
  for nonnegative tables), per-block absmax scales. Exact stochastic
  rounding between the two neighbouring levels, and, as mpx's codes, no
  positive value to zero in a nonnegative table."""
  blocked = mc._rows(x)
  scales = jnp.max(jnp.abs(blocked), axis=-1)
  a = blocked / jnp.where(scales > 0, scales, 1)[..., None]
  levels = jnp.asarray(table)
  high = jnp.clip(jnp.searchsorted(levels, a), 1, len(table) - 1)
  lo, hi = levels[high - 1], levels[high]
  p = (a - lo) / (hi - lo)
  if stochastic:
    u = mc._rows(rounding.random_bits(key, count, x.shape) >> 8).astype(jnp.float32) * 2.0**-24
  else:
    u = 0.5
  index = jnp.where(p > u, high, high - 1)
  if table[0] == 0:
    index = jnp.where((a > 0) & (index == 0), 1, index)
  flat = index.astype(jnp.uint8).reshape((*index.shape[:-2], -1))  # drop the blocks' padding
  codes = flat[..., : x.shape[-1] if x.shape else 1].reshape(x.shape)
  return mc.QuantizedMoment(codes, scales)


def _table_decode(table: np.ndarray, c: mc.QuantizedMoment) -> Array:
  levels = jnp.asarray(table)[c.codes.astype(jnp.int32)]
  return levels * mc._expand(c.scales, c.codes.shape)


# --- One run ---------------------------------------------------------------


def _block_rel(c: Array, f: Array) -> Array:
  """``|c - f|_2 / |f|_2`` per block (0 where a block of f is zero)."""
  num = jnp.sum(jnp.square(mc._rows(c - f)), -1)
  den = jnp.sum(jnp.square(mc._rows(f)), -1)
  return jnp.where(den > 0, jnp.sqrt(num / jnp.where(den > 0, den, 1)), 0).ravel()


@functools.partial(jax.jit, static_argnames=("fmt", "dist", "shape", "steps", "checkpoints", "b1"))
def run(
  fmt: Format, dist: str, shape: tuple[int, int], steps: int, checkpoints: int, b1: float = B1
) -> dict:
  """Metrics at ``checkpoints`` evenly spaced steps of one run."""
  adam = optax.scale_by_adam(b1, B2, EPS)
  draw = gradients(dist, shape, steps)
  # One key for both moments: mpx's codes salt it per kind.
  key = jnp.asarray(rounding.leaf_key(0, 0))
  zeros = jnp.zeros(shape, jnp.float32)
  stored0 = (fmt.encode_mu(zeros, key, jnp.int32(0)), fmt.encode_nu(zeros, key, jnp.int32(0)))

  def step(carry, t):
    ref, stored, zero_count, _ = carry
    g = draw(t)
    u_ref, ref = adam.update(g, ref)
    # As mixed_precision runs it: decode, one float32 update, encode.
    state = optax.ScaleByAdamState(
      ref.count - 1, fmt.decode_mu(stored[0]), fmt.decode_nu(stored[1])
    )
    u, state = adam.update(g, state)
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


_CACHE: dict[tuple, dict] = {}


def measure(fmt: Format, dist: str, shape: tuple[int, int], steps: int, b1: float = B1) -> dict:
  """``run``'s metrics as numpy, each run once per (format name, ...)."""
  key = (fmt.name, dist, shape, steps, b1)
  if key not in _CACHE:
    _CACHE[key] = jax.tree.map(np.asarray, run(fmt, dist, shape, steps, CHECKPOINTS, b1))
  return _CACHE[key]


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


# --- Sections --------------------------------------------------------------

FORMATS = (
  bfloat16(False),
  bfloat16(True),
  eightbit(False),
  eightbit(True),
  eightbit(False, True),
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
    for fmt in (bfloat16(False), bfloat16(True), eightbit(False), eightbit(True)):
      m = measure(fmt, dist, shape, steps, b1)
      rows.append((dist, fmt.name, {**summary(m), "mu slope": m["mu slope"][-1]}))
  table(rows, ["mu med", "mu max", "mu drift", "mu slope"])


MU_CANDIDATES = {
  "[3]m4,m3 (mpx)": mc.CODES["signed"],
  "[1]m4,m3": float_levels(True, [(1, 4), (0, 3)]),
  "e4m3": float_levels(True, [(0, 3)]),
  "e3m4": float_levels(True, [(0, 4)]),
  "[1]m5,[2]m4,m2": float_levels(True, [(1, 5), (2, 4), (0, 2)]),
  "power 2": power_levels(True, 2),
  "bnb dynamic": dynamic_map(True),
  "linear": linear_map(True),
}
NU_CANDIDATES = {
  "[1]m6,[2]m4,m3 (mpx)": mc.CODES["nonnegative"],
  "[1]m6,m3": float_levels(False, [(1, 6), (0, 3)]),
  "e5m3": float_levels(False, [(0, 3)]),
  "e4m4": float_levels(False, [(0, 4)]),
  "[2]m5,[12]m3,m2": float_levels(False, [(2, 5), (12, 3), (0, 2)]),
  "power 4": power_levels(False, 4),
  "bnb dynamic": dynamic_map(False),
  "linear": linear_map(False),
}


def candidates_table(shape: tuple[int, int], steps: int, stochastic: bool = True) -> None:
  print(f"## Candidate 8-bit codes, {_rounding(stochastic)}, shape {shape}, {steps} steps: one")
  print("moment compressed, the other float32; upd: the error that moment alone causes")
  print("([k]mN: the top k octaves with N mantissa bits; eXmY: float-like, 127/255 levels)")
  rows = []
  for dist in DISTRIBUTIONS:
    for name, code in MU_CANDIDATES.items():
      fmt = Format(f"mu: {name}", *coder(code, "signed", stochastic), *IDENTITY)
      rows.append((dist, fmt.name, summary(measure(fmt, dist, shape, steps))))
  table(rows, ["mu med", "mu max", "upd med", "upd max"])
  rows = []
  for dist in DISTRIBUTIONS:
    for name, code in NU_CANDIDATES.items():
      fmt = Format(f"nu: {name}", *IDENTITY, *coder(code, "nonnegative", stochastic))
      rows.append((dist, fmt.name, summary(measure(fmt, dist, shape, steps))))
  table(rows, ["nu med", "nu max", "nu bias", "zeros", "upd med", "upd max"])


def cost(n: int, repeats: int = 5) -> None:
  cols = n // 4096
  load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
  print(f"## Cost: one float32 leaf of {n} elements, shape (4096, {cols}), CPU, load {load}")
  x = jax.random.normal(jax.random.key(0), (4096, cols)) ** 2
  key, count = jnp.asarray(rounding.leaf_key(0, 0)), jnp.int32(3)

  def timed(f: Callable, *args: Any) -> float:
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(f(*args))
      times.append(time.perf_counter() - start)
    return 1e3 * min(times)

  def instructions(f: Callable, *args: Any) -> int:
    text = jax.jit(f).lower(*args).compile().as_text()
    return sum(1 for line in text.splitlines() if re.match(r"\s*(ROOT )?%?[\w.-]+ = ", line))

  cases: dict[str, Callable] = {"float32 read + write (x + 1)": lambda x, k, c: x + 1.0}
  for kind in mc.KINDS:
    for st in (False, True):
      cases[f"8bit {kind} {_rounding(st)}"] = functools.partial(
        lambda x, k, c, kind, st: mc.decode(mc.encode(x, kind, k, c, st), kind), kind=kind, st=st
      )
  for st in (False, True):
    cases[f"bfloat16 {_rounding(st)}"] = functools.partial(
      lambda x, k, c, st: mc.decode_bfloat16(mc.encode_bfloat16(x, k, c, st)), st=st
    )
  print(f"{'encode + decode':34} {'ms (min of 5)':>14} {'HLO instructions':>17}")
  for name, f in cases.items():
    ms, count_ = timed(f, x, key, count), instructions(f, x, key, count)
    print(f"{name:34} {ms:>14.1f} {count_:>17d}", flush=True)
  print()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--quick", action="store_true", help="small shapes, 200 steps")
  parser.add_argument("--sections", default="main,drift,slow,candidates,cost")
  args = parser.parse_args()
  steps = 200 if args.quick else args.steps
  shape = (16, 512) if args.quick else (64, 1024)
  small = (16, 512) if args.quick else (32, 1024)
  sections = args.sections.split(",")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}\n")
  if "main" in sections:
    main_table(shape, steps)
  if "drift" in sections:
    drift_table(shape, steps, "gauss rows 1000x")
    drift_table(shape, steps, "drifting mean")
  if "slow" in sections:
    slow_momentum_table(shape, steps)
  if "candidates" in sections:
    candidates_table(small, steps)
  if "cost" in sections:
    cost(2**18 if args.quick else 2**24)


if __name__ == "__main__":
  main()
