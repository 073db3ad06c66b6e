"""How large the update each compressed-moment format computes is, on the demo's own gradients.

FP32 AdamW trains the demo's transformer (``examples/demo.py``'s defaults:
its model, data, batches and schedule); at every step each format's
``mpx.mixed_precision(adamw, moments=...)`` is fed the same gradient and
float32 params and updates its own stored state beside it, never the params.
So every format follows FP32's trajectory, and what differs is only what its
stored moments make of the same gradients. Printed per format and quarter of
the run: the update's size, ``sum |u| / sum |u_fp32|`` over the compressed
leaves (4,096 elements or more), and its relative error, ``|u - u_fp32|_2 /
|u_fp32|_2``. A size above 1 trains as a larger learning rate would
(docs/moment_codes.md, "4 bits"). The first quarter starts at the warmup's
zero learning rate, where both are 0: its figures are from step 2 on.

Run: ``python benchmarks/demo_update_size.py [--steps 800]`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402
import lm  # noqa: E402

import mpx  # noqa: E402

FORMATS: dict[str, Any] = {
  "8bit": "8bit",
  "4bit": "4bit",
  "mu 4bit": {"mu": "4bit"},
  "nu 4bit": {"nu": "4bit"},
  "mu 8bit, nu 4bit": {"mu": "8bit", "nu": "4bit"},
}


def measure(steps: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Returns per format an array ``(steps, 2)``: each step's update size and
  relative error against FP32's."""
  settings, _ = demo.parse_args(["--steps", str(steps), "--seed", str(seed)])
  train_bytes, _ = lm.load_corpus()
  corpus = jnp.asarray(train_bytes)
  model = lm.TransformerLM(settings.model)
  params = lm.init_params(model, settings.seed)
  fp32 = lm.adamw(settings.opt)
  shadows = {
    name: mpx.mixed_precision(lm.adamw(settings.opt), moments=moments, seed=settings.seed)
    for name, moments in FORMATS.items()
  }
  state = fp32.init(params)
  shadow_states = {name: tx.init(params) for name, tx in shadows.items()}
  key = jax.random.key(settings.seed)

  def compressed(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if x.size >= 4096]

  @jax.jit
  def step(params, state, shadow_states, step_id):
    tokens = lm.sample_batch(
      corpus, jax.random.fold_in(key, step_id), settings.batch, settings.model.context
    )
    grads = jax.grad(lambda p: lm.token_losses(model, p, tokens).mean())(params)
    updates, state = fp32.update(grads, state, params)
    reference = compressed(updates)
    reference_l1 = sum(jnp.abs(b).sum() for b in reference)
    reference_l2 = sum(jnp.square(b).sum() for b in reference)
    figures, new_states = {}, {}
    for name, tx in shadows.items():
      shadow, new_states[name] = tx.update(grads, shadow_states[name], params)
      mine = compressed(shadow)
      size = sum(jnp.abs(a).sum() for a in mine) / reference_l1
      error = sum(jnp.square(a - b).sum() for a, b in zip(mine, reference, strict=True))
      figures[name] = jnp.stack([size, jnp.sqrt(error / reference_l2)])
    return optax.apply_updates(params, updates), state, new_states, figures

  history: dict[str, list[np.ndarray]] = {name: [] for name in FORMATS}
  for t in range(steps):
    params, state, shadow_states, figures = step(params, state, shadow_states, t)
    for name, value in figures.items():
      history[name].append(np.asarray(value))
  return {name: np.stack(rows) for name, rows in history.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=800)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  history = measure(args.steps, args.seed)
  quarters = [range(max(1, i * args.steps // 4), (i + 1) * args.steps // 4) for i in range(4)]
  print(f"jax {jax.__version__}, the demo's defaults, {args.steps} steps, seed {args.seed}")
  head = " | ".join(f"q{i + 1}" for i in range(4))
  print(f"\n| format | update size {head} | relative error {head} |")
  print("|:--|" + "--:|" * 8)
  for name, rows in history.items():
    size = [f"{rows[list(q), 0].mean():.3f}" for q in quarters]
    error = [f"{rows[list(q), 1].mean():.3f}" for q in quarters]
    print(f"| {name} | " + " | ".join(size) + " | " + " | ".join(error) + " |")


if __name__ == "__main__":
  main()
