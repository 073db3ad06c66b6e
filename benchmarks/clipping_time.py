"""The CPU time of a training step clipped by the global norm, in one pass or two.

The demo-sized transformer (benchmarks/model.py) in bfloat16 under
``mixed_precision(adamw, masters="24bit", moments={"mu": "8bit", "nu":
"4bit"})``, and unclipped with ``skip="leaf"`` beside the default; each
step one jit of gradient, update and ``apply_updates``, params and state
donated. Timed in turns (a round times every step once) on this machine,
each step's median over the rounds relative to the step that clips in the
inner rule (``optax.clip_by_global_norm``), measured in the same run.
``python benchmarks/clipping_time.py [--rounds 30 --batch 8]``.
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
import optax  # noqa: E402

import mpx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.model import ModelSize, init_params, loss_fn, make_batch  # noqa: E402

MAX_NORM = 1.0
MOMENTS = {"mu": "8bit", "nu": "4bit"}
BASELINE = "clip_by_global_norm in the rule"


def _tx(*clip: optax.GradientTransformation, skip: str = "step") -> optax.GradientTransformation:
  inner = optax.chain(*clip, optax.adamw(3e-4))
  return mpx.mixed_precision(inner, masters="24bit", moments=MOMENTS, skip=skip)


def steps() -> dict[str, tuple[optax.GradientTransformation, bool]]:
  """Each step's transformation and whether it takes ``mpx.clipped_grad``'s gradients."""
  return {
    "unclipped": (_tx(), False),
    "unclipped, skip=leaf": (_tx(skip="leaf"), False),
    BASELINE: (_tx(optax.clip_by_global_norm(MAX_NORM)), False),
    "mpx.clipped_grad, skip=leaf": (_tx(skip="leaf"), True),
    "clip_by_block_rms in the rule, skip=leaf": (
      _tx(optax.clip_by_block_rms(MAX_NORM), skip="leaf"),
      False,
    ),
  }


def make_step(size: ModelSize, tx: optax.GradientTransformation, two_pass: bool) -> Callable:
  def loss(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    return loss_fn(size, params, inputs, targets)

  def step(params: Any, state: Any, inputs: jax.Array, targets: jax.Array) -> tuple[Any, Any]:
    if two_pass:
      grads, _ = mpx.clipped_grad(loss, MAX_NORM)(params, inputs, targets)
    else:
      grads = jax.grad(loss)(params, inputs, targets)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def measure(size: ModelSize, rounds: int) -> dict[str, float]:
  """Returns each step's median seconds over ``rounds`` rounds of one call each."""
  params = mpx.cast_tree(init_params(size), jax.numpy.bfloat16)
  inputs, targets = make_batch(size)
  runs = {}
  for name, (tx, two_pass) in steps().items():
    p = jax.tree.map(jax.numpy.copy, params)
    runs[name] = [make_step(size, tx, two_pass), p, tx.init(p)]
  return common.in_turns(runs, rounds, inputs, targets)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--batch", type=int, default=ModelSize().batch, help="sequences per step")
  parser.add_argument("--smoke", action="store_true", help="a tiny model, three rounds")
  args = parser.parse_args(argv)
  size = ModelSize(batch=args.batch)
  if args.smoke:
    size = ModelSize(width=32, depth=1, heads=2, seq=16, batch=2, vocab=64)
  medians = measure(size, 3 if args.smoke else args.rounds)
  print(f"{size}; jax {jax.__version__}, {jax.devices()[0].platform}; median of each step")
  print()
  print(f"| step | ms | relative to {BASELINE} |")
  print("|:--|--:|--:|")
  for name, seconds in medians.items():
    print(f"| {name} | {seconds * 1e3:.2f} | {seconds / medians[BASELINE]:.2f} |")


if __name__ == "__main__":
  main()
