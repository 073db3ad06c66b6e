"""How far each accumulator's window mean is from the exact one, on gradient streams.

``python benchmarks/accumulator_error.py``. Each stream is ``k`` bfloat16
micro-batch gradients of 65,536 elements over 8 windows; the reference is
their mean in float64. Compared: ``mpx.accumulate`` with a float32 and a
bfloat16 (stochastically rounded) accumulator, and ``optax.MultiSteps`` with
``accumulator_dtype=bfloat16`` (a running mean rounded to nearest), each
read as the update of ``optax.sgd(1.0)``. *error*: the mean's RMS error over
the reference's RMS; *bias*: its mean signed error over the reference's mean
magnitude (systematic drift where stochastic errors average out).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Callable

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpx  # noqa: E402

ELEMENTS = 1 << 16
WINDOWS = 8


def stream(name: str, k: int, seed: int) -> np.ndarray:
  """``(WINDOWS, k, ELEMENTS)`` float32 gradients exact in bfloat16.

  *noisy*: heavy-tailed noise (Student's t, 3 degrees of freedom) around a
  mean a tenth its size, magnitudes spread over six decades. *steady*: each
  gradient 1 + j * 2**-7 (j uniform in 0..3, bfloat16's spacing at 1), whose
  later terms move a running mean by less than half that spacing.
  """
  rng = np.random.default_rng(seed)
  shape = (WINDOWS, k, ELEMENTS)
  if name == "noisy":
    scale = 10.0 ** rng.uniform(-6, 0, ELEMENTS)
    grads = scale * (0.1 + rng.standard_t(3, shape))
  else:
    grads = 1 + 2.0**-7 * rng.integers(0, 4, shape)
  return np.asarray(jnp.asarray(grads, jnp.bfloat16).astype(jnp.float32))


def window_means(
  make: Callable[[int], optax.GradientTransformation], grads: np.ndarray
) -> np.ndarray:
  """Each window's mean as ``make(k)`` hands it to ``optax.sgd(1.0)``."""
  k = grads.shape[1]
  tx = make(k)
  params = {"w": jnp.zeros(ELEMENTS)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  means = []
  for window in grads:
    for g in window:
      updates, state = update({"w": jnp.asarray(g)}, state, params)
    means.append(-np.asarray(updates["w"], np.float64))
  return np.stack(means)


ACCUMULATORS: dict[str, Callable[[int], optax.GradientTransformation]] = {
  "mpx float32": lambda k: mpx.accumulate(optax.sgd(1.0), k),
  "mpx bfloat16 (stochastic)": lambda k: mpx.accumulate(optax.sgd(1.0), k, accumulator="bfloat16"),
  "optax.MultiSteps bfloat16 (nearest)": lambda k: optax.MultiSteps(
    optax.sgd(1.0), k, accumulator_dtype=jnp.bfloat16
  ).gradient_transformation(),
}


def errors(name: str, k: int) -> dict[str, tuple[float, float]]:
  """Each accumulator's ``(error, bias)`` on one stream."""
  grads = stream(name, k, seed=k)
  exact = grads.astype(np.float64).mean(axis=1)
  rms, magnitude = np.sqrt(np.mean(exact**2)), np.mean(np.abs(exact))
  found = {}
  for label, make in ACCUMULATORS.items():
    error = window_means(make, grads) - exact
    found[label] = (float(np.sqrt(np.mean(error**2)) / rms), float(np.mean(error) / magnitude))
  return found


def table(ks: tuple[int, ...] = (4, 8, 32)) -> list[str]:
  """Renders the table's lines, printing each as it comes."""
  lines = [
    "| stream | k | accumulator | error | bias |",
    "|:--|--:|:--|--:|--:|",
  ]
  print("\n".join(lines), flush=True)
  for name in ("noisy", "steady"):
    for k in ks:
      for label, (error, bias) in errors(name, k).items():
        lines.append(f"| {name} | {k} | {label} | {error:.2e} | {bias:+.2e} |")
        print(lines[-1], flush=True)
  return lines


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 32])
  table(tuple(parser.parse_args(argv).k))


if __name__ == "__main__":
  main()
