"""The CPU time of a scanned model's step, its layers updated after the backward pass or in it.

The residual MLP stack of benchmarks/whole_step.py under ``lax.scan``
(bfloat16 params), each step one jit, params and state donated: the plain
step (``jax.grad``, then ``tx.update`` and ``optax.apply_updates`` on the
stacked params) beside ``mpx.scan_layers(block, tx)``'s (``jax.grad`` with
respect to its layers returns them updated), for optax adamw and two mpx
modes. Timed in turns (a round times every step once) on this machine; each
step's median over the rounds, and ``mpx.scan_layers``' relative to the plain
step with the same rule, measured in the same run.
``python benchmarks/scan_layers_time.py [--rounds 20 --blocks 8 --width 256 --batch 64]``
(``--smoke``: a tiny stack, three rounds).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.whole_step import Model  # noqa: E402


def rules() -> dict[str, Callable[[], optax.GradientTransformation]]:
  def mp(masters: str, moments: str) -> Callable[[], optax.GradientTransformation]:
    return lambda: mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments=moments)

  return {
    "optax adamw": lambda: optax.adamw(1e-3),
    "mpx 24bit + 4bit moments": mp("24bit", "4bit"),
    "mpx stochastic + 4bit moments": mp("stochastic", "4bit"),
  }


def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return x + jax.nn.relu(x @ p["up"]) @ p["down"]


def plain_step(model: Model, tx: optax.GradientTransformation) -> Callable:
  def step(params: Any, state: Any, x: jax.Array) -> tuple[Any, Any]:
    updates, state = tx.update(jax.grad(model.loss)(params, x), state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def layered_step(stack: mpx.ScanLayers) -> Callable:
  def loss(layers: mpx.ScanLayersState, x: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(stack(layers, x).astype(jnp.float32)))

  return jax.jit(lambda layers, state, x: (jax.grad(loss)(layers, x), state), donate_argnums=0)


def measure(model: Model, rounds: int) -> dict[str, float]:
  """Returns each step's median seconds over ``rounds`` rounds of one call each."""
  rng = np.random.default_rng(0)
  params = {
    k: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), jnp.bfloat16)
    for k, s in model.shapes().items()
  }
  x = jnp.asarray(rng.standard_normal((model.batch, model.width)), jnp.bfloat16)
  runs: dict[str, list[Any]] = {}
  for name, make in rules().items():
    tx = make()
    p = jax.tree.map(jnp.copy, params)
    runs[f"{name}, plain scan"] = [plain_step(model, tx), p, tx.init(p)]
    stack = mpx.scan_layers(block, make())
    layers = stack.init(jax.tree.map(jnp.copy, params))
    runs[f"{name}, mpx.scan_layers"] = [layered_step(stack), layers, None]
  return common.in_turns(runs, rounds, x)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--blocks", type=int, default=8)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--smoke", action="store_true", help="a tiny model, three rounds")
  args = parser.parse_args(argv)
  model = Model(args.blocks, args.width, args.batch, scanned=True)
  if args.smoke:
    model = Model(2, 32, 4, scanned=True)
  medians = measure(model, 3 if args.smoke else args.rounds)
  print(
    f"{model.blocks} MLP blocks of width {model.width}, batch {model.batch}, scanned: "
    f"{model.params / 1e6:.1f}M bfloat16 params; jax {jax.__version__}, "
    f"{jax.devices()[0].platform}; median of each step"
  )
  print()
  print("| rule | plain scan ms | mpx.scan_layers ms | relative |")
  print("|:--|--:|--:|--:|")
  for name in rules():
    plain, layered = medians[f"{name}, plain scan"], medians[f"{name}, mpx.scan_layers"]
    print(f"| {name} | {plain * 1e3:.2f} | {layered * 1e3:.2f} | {layered / plain:.2f} |")


if __name__ == "__main__":
  main()
