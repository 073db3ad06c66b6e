"""How far Adam with 4-bit moments strays from float32 Adam, fed heavy-tailed
gradient streams: mpx's 8-bit and 4-bit codes (mpx/_src/moment_codes.py),
per-field mixes, and torchao's ``AdamW4bit`` (docs/moment_codes.md, "4 bits").

Each stream: Student t (``--df`` degrees of freedom, a comma-separated list:
1.5, 2.5, 5 and 30 by default) times a scale per row, log-uniform over 1e-3
.. 1, shape ``--shape`` (512x1024), for ``--steps`` (200) steps, written once
to ``stream.npy`` under ``--workdir``. Every format runs Adam (b1 0.9, b2
0.999, eps 1e-8) on it: optax's ``scale_by_adam`` for float32, and, for a
compressed format, decode, one float32 ``scale_by_adam`` update, encode, as
``mixed_precision`` runs it. torchao's ``AdamW4bit`` (lr 1, no weight decay,
its parameter zeroed before each step, so that it holds minus the update
afterwards) runs in a subprocess of ``--torch-python`` (a Python with torch
and torchao), which reads the same ``stream.npy``; this process needs no
torch. Without that Python its row is left out.

The formats: mpx's 8-bit and 4-bit codes (as ``moments="8bit"`` and
``"4bit"`` store them: 4-bit ``nu`` on levels over each block's range), the
4-bit code with ``mu`` rounded stochastically throughout (as before the
signed code rounded to nearest where that changes its code), with ``nu`` on
fixed levels instead (in the same blocks): the float-like levels of states
saved before the range levels, rounded unbiased, or the paper's linear map
``k / 15``; 8-bit ``mu`` with 4-bit ``nu``, each 4-bit moment alone with the
other in float32, and torchao.

Printed per stream and format, after the last step: the relative error (``|c
- f|_2 / |f|_2``) of the stored ``mu`` and ``nu`` against float32 Adam's;
``nu bias``, the mean of ``nu / float32 nu``; the cosine and the relative
error of Adam's direction from the stored moments, ``mu_hat / (sqrt(nu_hat)
+ eps)``, and of the update the last step emitted; how many positive float32
``nu`` the format stored as zero, at the end and summed over the steps; and
the bytes per element of ``mu`` and ``nu`` together. Then the direction and
update errors as ratios to torchao's and to mpx's 8-bit, and a summary of
every stream.

docs/moment_codes.md's table ("4 bits") is a run: jax 0.10.2, torchao 0.18.0, 2-core CPU.

Run: ``.venv/bin/python benchmarks/moment_codes_4bit_error.py [--df 2.5]
[--steps 200] [--shape 512x1024] [--torch-python /path/to/python]``; about
two minutes a stream on 2 cores, half of it torchao's 200 steps
(torch.compile's first among them). For torchao, make a virtual environment
with ``pip install torch torchao numpy`` (PyPI's torch runs on the CPU) and
pass its Python, or set ``MPX_TORCH_PYTHON``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import moment_codes as mc
from mpx._src import rounding

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is a package of the checkout
  sys.path.insert(0, str(ROOT))

from benchmarks.moment_codes_error import coder as table_coder  # noqa: E402

B1, B2, EPS = 0.9, 0.999, 1e-8
Array = jax.Array
# The fixed nonnegative levels 4-bit states stored before the range levels:
# {1, 3/4} * 2**-e down to 2**-5, then the powers of two down to 2**-9, and 0.
_FIXED_TOPS = [m / 2**e for e in range(5, 0, -1) for m in (1, 1.5)]  # 1/32 to 3/4
FIXED_NU_LEVELS = np.float32([0] + [2.0**-e for e in range(9, 5, -1)] + _FIXED_TOPS + [1])


def write_stream(path: str, shape: tuple[int, int], steps: int, df: float, seed: int = 0) -> None:
  """Writes ``steps`` gradients of ``shape`` (float32) to ``path``: Student t
  with ``df`` degrees of freedom, each row times a scale in 1e-3 .. 1."""
  rng = np.random.default_rng(seed)
  rows = (10.0 ** rng.uniform(-3, 0, (shape[0], 1))).astype(np.float32)
  out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(steps, *shape))
  for t in range(steps):
    out[t] = rows * rng.standard_t(df, shape).astype(np.float32)
  out.flush()
  del out


Encode = Callable[[Array, Array, Array, Any], Any]  # (x, key, step, previous) -> stored
Decode = Callable[[Any], Array]


def code(name: str, sign: mc.Sign, stochastic: bool) -> tuple[Encode, Decode]:
  """Encode and decode of one moment: ``"f32"``, ``"8bit"``, ``"4bit"`` (as
  ``moments="4bit"`` codes it, given the previous stored moment), ``"4bit
  stochastic"`` (not given it), ``"4bit fixed"`` (a saved state's levels,
  each value rounded unbiased) or ``"4bit linear"`` (on k / 15), those two
  by a table (``moment_codes_error.coder``): the module's docstring says
  which is which."""
  if name == "f32":
    return (lambda x, key, step, previous: x), (lambda s: s)
  if name in ("4bit", "4bit stochastic"):
    kind = mc.FourBitCompressed(0, sign)
    given = name == "4bit"
    return (
      lambda x, key, step, previous: kind.compress(
        x, step, key, previous=previous if given else None
      )
    ), kind.decompress
  if name == "8bit":
    encode, decode = table_coder(None, sign, stochastic)
  elif name == "4bit linear" and sign == "nonnegative":
    encode, decode = table_coder(np.arange(16) / np.float32(15), sign, stochastic, True)
  elif name == "4bit fixed" and sign == "nonnegative":
    encode, decode = table_coder(FIXED_NU_LEVELS, sign, stochastic, True)
  else:
    raise ValueError(name)
  return (lambda x, key, step, previous: encode(x, key, step)), decode


def bytes_of(name: str, sign: mc.Sign, shape: tuple[int, ...]) -> float:
  """The bytes a moment stored as ``name`` takes per element: for 8 and 4 bits,
  the codes and float32 scales (an odd row's last element among them)."""
  if name == "f32":
    return 4.0
  kind = mc.EightBitCompressed(0, sign) if name == "8bit" else mc.FourBitCompressed(0, sign)
  like, step = jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
  stored = jax.eval_shape(kind.compress, like, step)
  return sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in stored) / np.prod(shape)


NEAREST, STOCHASTIC = False, True


@dataclasses.dataclass(frozen=True)
class Format:
  """How one Adam state stores ``mu`` and ``nu``: a code and a rounding each."""

  label: str
  mu: tuple[str, bool]
  nu: tuple[str, bool]

  def coders(self) -> tuple[tuple[Encode, Decode], tuple[Encode, Decode]]:
    return code(self.mu[0], "signed", self.mu[1]), code(self.nu[0], "nonnegative", self.nu[1])

  def bytes(self, shape: tuple[int, ...]) -> float:
    return bytes_of(self.mu[0], "signed", shape) + bytes_of(self.nu[0], "nonnegative", shape)


FORMATS = (
  Format("mpx 8bit", ("8bit", STOCHASTIC), ("8bit", STOCHASTIC)),
  Format("mpx 4bit", ("4bit", STOCHASTIC), ("4bit", STOCHASTIC)),
  Format("mpx 4bit, mu stochastic", ("4bit stochastic", STOCHASTIC), ("4bit", STOCHASTIC)),
  Format("mpx 4bit, nu fixed levels", ("4bit", STOCHASTIC), ("4bit fixed", STOCHASTIC)),
  Format("mpx 4bit, nu linear k/15", ("4bit", STOCHASTIC), ("4bit linear", STOCHASTIC)),
  Format("mpx 8bit mu + 4bit nu", ("8bit", STOCHASTIC), ("4bit", STOCHASTIC)),
  Format("mpx 4bit mu, f32 nu", ("4bit", STOCHASTIC), ("f32", NEAREST)),
  Format("mpx f32 mu, 4bit nu", ("f32", NEAREST), ("4bit", STOCHASTIC)),
)
SUMMARY = (*(f.label for f in FORMATS), "torchao AdamW4bit")  # the rows over the streams


def run_jax(stream: np.ndarray, formats: tuple[Format, ...]) -> dict[str, dict[str, Any]]:
  """Runs float32 Adam and each format on ``stream``; returns, per label, the
  stored ``mu``, ``nu`` (decoded), the last update and the zero counts."""
  steps, *shape = stream.shape
  adam = optax.scale_by_adam(B1, B2, EPS)
  key = jnp.asarray(rounding.leaf_key(0, 0))
  coders = [f.coders() for f in formats]
  zeros = jnp.zeros(shape, jnp.float32)

  def init() -> Any:
    stored = [
      (mu[0](zeros, key, jnp.int32(0), None), nu[0](zeros, key, jnp.int32(0), None))
      for mu, nu in coders
    ]
    return adam.init(zeros), stored, [jnp.int32(0)] * len(formats)

  @jax.jit
  def step(carry: Any, g: Array, t: Array) -> tuple[Any, Any]:
    ref, stored, counts = carry
    u_ref, ref = adam.update(g, ref)
    new_stored, new_counts, updates, lost_now = [], [], [], []
    for (mu_c, nu_c), (s_mu, s_nu), count in zip(coders, stored, counts, strict=True):
      mu, nu = mu_c[1](s_mu).reshape(shape), nu_c[1](s_nu).reshape(shape)
      u, state = adam.update(g, optax.ScaleByAdamState(ref.count - 1, mu, nu))
      s_mu, s_nu = mu_c[0](state.mu, key, t, s_mu), nu_c[0](state.nu, key, t, s_nu)
      nu_stored = nu_c[1](s_nu).reshape(shape)
      lost = jnp.sum((ref.nu > 0) & (nu_stored == 0)).astype(jnp.int32)
      new_stored.append((s_mu, s_nu))
      new_counts.append(count + lost)
      updates.append(u)
      lost_now.append(lost)
    return (ref, new_stored, new_counts), (u_ref, updates, lost_now)

  carry = init()
  for t in range(steps):
    carry, (u_ref, updates, lost_now) = step(carry, jnp.asarray(stream[t]), jnp.int32(t + 1))
  ref, stored, counts = carry
  out = {"float32": {"mu": ref.mu, "nu": ref.nu, "update": u_ref, "zeros": 0, "zeros_end": 0}}
  for f, (mu_c, nu_c), (s_mu, s_nu), count, u, lost in zip(
    formats, coders, stored, counts, updates, lost_now, strict=True
  ):
    out[f.label] = {
      "mu": mu_c[1](s_mu).reshape(shape),
      "nu": nu_c[1](s_nu).reshape(shape),
      "update": u,
      "zeros": count,
      "zeros_end": lost,
    }
  return jax.tree.map(np.asarray, out)


TORCH_SCRIPT = textwrap.dedent(
  """
  import sys, time
  import numpy as np
  import torch
  from torchao.optim import AdamW4bit

  torch.set_num_threads(2)
  stream_path, out_path, b1, b2, eps = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:6])
  stream = np.load(stream_path, mmap_mode="r")
  p = torch.nn.Parameter(torch.zeros(stream.shape[1:], dtype=torch.float32))
  opt = AdamW4bit([p], lr=1.0, betas=(b1, b2), eps=eps, weight_decay=0.0)
  seen = torch.zeros(stream.shape[1:], dtype=torch.bool)
  zeros = 0
  start = time.time()
  for t in range(stream.shape[0]):
      g = torch.from_numpy(np.array(stream[t]))
      seen |= g != 0
      with torch.no_grad():
          p.zero_()
      p.grad = g
      opt.step()
      nu = opt.state[p]["exp_avg_sq"].dequantize()
      lost = int(((nu == 0) & seen).sum())
      zeros += lost
  state = opt.state[p]
  print(f"torchao {type(state['exp_avg']).__name__} x2, {stream.shape[0]} steps in "
        f"{time.time() - start:.0f} s", file=sys.stderr)
  np.savez(
      out_path,
      mu=state["exp_avg"].dequantize().numpy(),
      nu=state["exp_avg_sq"].dequantize().numpy(),
      update=-p.detach().numpy(),
      zeros=zeros,
      zeros_end=lost,
      block_size=opt.block_size,
  )
  """
)


def run_torchao(python: str, stream_path: str, workdir: str) -> dict[str, np.ndarray] | None:
  """Runs torchao's AdamW4bit in a subprocess of ``python`` on the stream."""
  script, out = os.path.join(workdir, "torchao_adamw4bit.py"), os.path.join(workdir, "torchao.npz")
  with open(script, "w") as f:
    f.write(TORCH_SCRIPT)
  args = [python, script, stream_path, out, str(B1), str(B2), str(EPS)]
  done = subprocess.run(args, capture_output=True, text=True, check=False)
  if done.returncode:
    print(f"torchao run failed ({done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
    return None
  print(done.stderr.strip().splitlines()[-1], file=sys.stderr)
  with np.load(out) as data:
    return {k: data[k] for k in data.files}


def direction(mu: np.ndarray, nu: np.ndarray, steps: int) -> np.ndarray:
  """Adam's direction from stored moments, in float64."""
  mu_hat = mu.astype(np.float64) / (1 - B1**steps)
  nu_hat = nu.astype(np.float64) / (1 - B2**steps)
  return mu_hat / (np.sqrt(np.maximum(nu_hat, 0)) + EPS)


def rel(c: np.ndarray, f: np.ndarray) -> float:
  c, f = c.astype(np.float64), f.astype(np.float64)
  return float(np.linalg.norm(c - f) / np.linalg.norm(f))


def cosine(c: np.ndarray, f: np.ndarray) -> float:
  c, f = c.astype(np.float64).ravel(), f.astype(np.float64).ravel()
  return float(c @ f / (np.linalg.norm(c) * np.linalg.norm(f)))


def metrics(run: dict[str, Any], ref: dict[str, Any], steps: int) -> dict[str, float]:
  d, d_ref = direction(run["mu"], run["nu"], steps), direction(ref["mu"], ref["nu"], steps)
  positive = ref["nu"] > 0
  return {
    "mu err": rel(run["mu"], ref["mu"]),
    "nu err": rel(run["nu"], ref["nu"]),
    "nu bias": float(np.mean(run["nu"][positive] / ref["nu"][positive])),
    "dir cos": cosine(d, d_ref),
    "dir err": rel(d, d_ref),
    # Jensen: noise in either moment makes |mu / sqrt(nu)| larger on average.
    "dir size": float(np.mean(np.abs(d)) / np.mean(np.abs(d_ref))),
    "upd cos": cosine(run["update"], ref["update"]),
    "upd err": rel(run["update"], ref["update"]),
    "zeros end": int(run["zeros_end"]),
    "zeros sum": int(run["zeros"]),
  }


def one_stream(args: argparse.Namespace, df: float) -> dict[str, tuple[float, dict[str, float]]]:
  """Runs every format (and torchao) on the stream of ``df`` degrees of freedom;
  prints its tables and returns its rows."""
  shape = tuple(int(s) for s in args.shape.split("x"))
  assert len(shape) == 2
  workdir = os.path.join(args.workdir, f"df{df:g}")
  os.makedirs(workdir, exist_ok=True)
  stream_path = os.path.join(workdir, "stream.npy")
  start = time.time()
  write_stream(stream_path, (shape[0], shape[1]), args.steps, df)
  print(
    f"\n# Stream: {shape} x {args.steps} steps, Student t ({df:g} dof), row scales "
    f"1e-3 .. 1 ({time.time() - start:.0f} s)"
  )
  stream = np.load(stream_path, mmap_mode="r")

  torch_result: dict[str, Any] | None = None
  if args.torch_python and os.path.exists(args.torch_python):
    start = time.time()
    torch_result = run_torchao(args.torch_python, stream_path, workdir)
    print(f"torchao subprocess: {time.time() - start:.0f} s", file=sys.stderr)

  start = time.time()
  runs = run_jax(stream, FORMATS)
  print(f"jax formats: {time.time() - start:.0f} s", file=sys.stderr)
  rows = {
    f.label: (f.bytes(shape), metrics(runs[f.label], runs["float32"], args.steps)) for f in FORMATS
  }
  if torch_result is not None:
    ao_bytes = 2 * (0.5 + 4 / int(torch_result["block_size"]))
    rows["torchao AdamW4bit"] = (ao_bytes, metrics(torch_result, runs["float32"], args.steps))

  columns = list(next(iter(rows.values()))[1])
  print(f"\n## After {args.steps} steps: stored moments and Adam's direction vs float32 Adam")
  print("mu/nu err: |c - f| / |f|; nu bias: mean nu / f32 nu; dir: mu_hat / (sqrt(nu_hat) + eps)")
  print("from the stored moments; upd: the update the last step emitted; zeros: positive f32 nu")
  print("stored as 0 (at the end; summed over steps); B/el: bytes per element of mu + nu\n")
  print(f"| {'format':31} | {'B/el':>6} | " + " | ".join(f"{c:>9}" for c in columns) + " |")
  print(f"|:{'-' * 31}-|{'-' * 7}:|" + "|".join("-" * 10 + ":" for _ in columns) + "|")
  for label, (nbytes, m) in rows.items():
    cells = [f"{m[c]:>9d}" if c.startswith("zeros") else f"{m[c]:>9.4f}" for c in columns]
    print(f"| {label:31} | {nbytes:>6.3f} | " + " | ".join(cells) + " |")

  print("\n## Ratios: direction and update error over torchao AdamW4bit's and over mpx 8bit's\n")
  bases = [b for b in ("torchao AdamW4bit", "mpx 8bit") if b in rows]
  head = [f"{what} / {b.removesuffix(' AdamW4bit')}" for b in bases for what in ("dir", "upd")]
  print(f"| {'format':31} | {'bytes / f32':>11} | " + " | ".join(f"{h:>17}" for h in head) + " |")
  print(f"|:{'-' * 31}-|{'-' * 12}:|" + "|".join("-" * 18 + ":" for _ in head) + "|")
  for label, (nbytes, m) in rows.items():
    ratios = [m[what] / rows[b][1][what] for b in bases for what in ("dir err", "upd err")]
    cells = " | ".join(f"{r:>17.3f}" for r in ratios)
    print(f"| {label:31} | {nbytes / 8:>11.3f} | {cells} |")
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--shape", default="512x1024")
  parser.add_argument("--df", default="1.5,2.5,5,30", help="the streams' degrees of freedom")
  parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mpx_4bit_error"))
  parser.add_argument(
    "--torch-python",
    default=os.environ.get("MPX_TORCH_PYTHON", ""),
    help="a Python with torch and torchao (default: $MPX_TORCH_PYTHON); none: no torchao",
  )
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
  if not (args.torch_python and os.path.exists(args.torch_python)):
    print(f"no Python at {args.torch_python!r}: torchao's AdamW4bit left out", file=sys.stderr)
  streams = [float(df) for df in args.df.split(",")]
  results = {df: one_stream(args, df) for df in streams}

  print("\n## Every stream: Adam's direction error (nu mean ratio) after the last step\n")
  head = [f"t({df:g})" for df in streams]
  print(f"| {'format':31} | {'B/el':>6} | " + " | ".join(f"{h:>15}" for h in head) + " |")
  print(f"|:{'-' * 31}-|{'-' * 7}:|" + "|".join("-" * 16 + ":" for _ in head) + "|")
  for label in SUMMARY:
    if label not in results[streams[0]]:
      continue
    cells = [
      f"{results[df][label][1]['dir err']:.3f} ({results[df][label][1]['nu bias']:.3f})"
      for df in streams
    ]
    nbytes = results[streams[0]][label][0]
    print(f"| {label:31} | {nbytes:>6.3f} | " + " | ".join(f"{c:>15}" for c in cells) + " |")


if __name__ == "__main__":
  main()
