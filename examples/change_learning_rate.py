"""Change the learning rate of a mixed-precision run between steps, with no recompilation.

The rule is built with ``optax.inject_hyperparams`` *inside*
``mpx.mixed_precision``::

  tx = mpx.mixed_precision(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2))

so the learning rate is a float32 array in the optimizer state rather than a
constant baked into the compiled step. A bfloat16 MLP then trains on a
synthetic regression while the script lowers the learning rate twice from
Python, as a hand-made step decay or a reduce-on-plateau rule would:

* at half the steps to 1e-3 with ``mpx.adjust(opt_state, learning_rate=...)``,
  which finds the hyperparameter at any depth of the state and keeps its
  dtype and shape;
* at three quarters to 1e-4 with ``optax.tree.set(opt_state,
  learning_rate=jnp.float32(...))``, which works as well given a float32 array.

The jitted step counts how often jax traces it: once for the whole run. At
each change the script also runs the next step twice from the same state and
batch, with the old and the new learning rate, and compares how far the
float32 masters move: AdamW's step is proportional to the learning rate, so the
ratio must be the ratio of the learning rates. Finally it shows the pitfall
that ``mpx.adjust`` avoids: ``optax.tree.set`` with a Python float stores a
weakly typed value, and the step is traced and compiled again.

Run from the repository root::

  python examples/change_learning_rate.py               # default size: ~15 s on 2 CPU cores
  MPX_SMOKE=1 python examples/change_learning_rate.py   # tiny size, mostly compilation

The script ends with self-checks (one trace, the new learning rates stored in
float32, the step size scaled with them, the validation loss fell) and exits
with status 1 if one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx

FEATURES = 16  # inputs of the regression
OUTPUTS = 4  # outputs of the regression
SEED = 0
# (fraction of the run, learning rate from then on, how it is set)
LR_CHANGES = ((0.5, 1e-3, "mpx.adjust"), (0.75, 1e-4, "optax.tree.set"))
INITIAL_LR = 1e-2
PyTree = Any


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size; the smoke size only has to run and pass the checks quickly."""

  steps: int
  batch: int
  width: int


DEFAULT_SIZE = Size(steps=800, batch=128, width=128)
SMOKE_SIZE = Size(steps=200, batch=64, width=32)


# --- Data and model ------------------------------------------------------------------


def teacher(x: np.ndarray) -> np.ndarray:
  """A fixed random one-hidden-layer network: the function to learn."""
  rng = np.random.default_rng(1234)  # the same teacher for every run
  a = rng.normal(size=(FEATURES, 32)) / np.sqrt(FEATURES)
  b = rng.normal(size=(32, OUTPUTS)) / np.sqrt(32)
  return (np.sin(x @ a) @ b).astype(np.float32)


def batches(batch: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless fresh ``(x, y)`` batches, so training loss tracks validation loss."""
  rng = np.random.default_rng(seed)
  while True:
    x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
    yield x, teacher(x)


def init_params(width: int, seed: int = SEED) -> PyTree:
  """Float32 weights of a two-hidden-layer MLP.

  Drawn with numpy, which needs no compilation, unlike jax's random numbers.
  """
  rng = np.random.default_rng(seed)
  sizes = [FEATURES, width, width, OUTPUTS]
  return {
    f"dense{i}": {
      "kernel": jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
      "bias": jnp.zeros(n_out, jnp.float32),
    }
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes))
  }


def mse(params: PyTree, x: jax.Array, y: jax.Array) -> jax.Array:
  """The MLP computes in its weights' dtype; the loss is taken in float32."""
  h = x.astype(params["dense0"]["kernel"].dtype)
  for i in range(len(params)):
    h = h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"]
    if i < len(params) - 1:
      h = jax.nn.gelu(h)
  return jnp.mean((h.astype(jnp.float32) - y) ** 2)


# --- Training --------------------------------------------------------------------

TX = mpx.mixed_precision(
  optax.inject_hyperparams(optax.adamw)(learning_rate=INITIAL_LR, weight_decay=1e-4)
)
traces: list[int] = []  # one entry per trace of train_step


@jax.jit
def train_step(
  params: PyTree, opt_state: optax.OptState, x: jax.Array, y: jax.Array
) -> tuple[PyTree, optax.OptState, jax.Array]:
  traces.append(1)  # Python side effect: runs only while jax traces the function
  loss, grads = jax.value_and_grad(mse)(params, x, y)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def master_step_norm(params: PyTree, old: optax.OptState, new: optax.OptState) -> float:
  """How far one step moved the float32 masters (global L2 norm)."""
  before, after = mpx.master_params(old, params), mpx.master_params(new, params)
  return float(optax.tree.norm(jax.tree.map(jnp.subtract, after, before)))


def current_lr(opt_state: optax.OptState) -> jax.Array:
  # optax.tree.get finds the injected hyperparameter at any depth of the state.
  return optax.tree.get(opt_state, "learning_rate")


# --- Main ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> Size:
  """Returns the size; ``MPX_SMOKE=1`` picks the tiny preset."""
  smoke = os.environ.get("MPX_SMOKE", "") not in ("", "0")
  preset = SMOKE_SIZE if smoke else DEFAULT_SIZE
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=preset.steps, help="training steps")
  parser.add_argument("--batch", type=int, default=preset.batch, help="examples per step")
  parser.add_argument("--width", type=int, default=preset.width, help="hidden layer width")
  args = parser.parse_args(argv)
  if min(args.batch, args.width) < 1 or args.steps < 8:
    parser.error("--batch and --width must be >= 1, --steps >= 8")
  return Size(steps=args.steps, batch=args.batch, width=args.width)


def main(argv: list[str] | None = None) -> int:
  size = parse_args(argv)
  x_val = np.random.default_rng(SEED + 1).normal(size=(2048, FEATURES)).astype(np.float32)
  y_val = teacher(x_val)
  val_loss = jax.jit(mse)

  fp32_params = init_params(size.width)
  params, opt_state = jax.jit(
    lambda p: mpx.init_from_full_precision(TX, p, jnp.bfloat16)  # jitted: one compile
  )(fp32_params)
  initial_val = float(val_loss(params, x_val, y_val))
  print(
    f"bfloat16 MLP (width {size.width}) on a synthetic regression, {size.steps} steps x "
    f"{size.batch} examples; learning rate {INITIAL_LR:g}; validation loss {initial_val:.4f}"
  )

  changes = {int(fraction * size.steps): (lr, how) for fraction, lr, how in LR_CHANGES}
  log_every = max(1, size.steps // 8)
  checks: dict[str, bool] = {}
  data = batches(size.batch, SEED)
  for i in range(size.steps):
    x, y = next(data)
    old_state = opt_state
    if i in changes:
      lr, how = changes[i]
      if how == "mpx.adjust":
        # A Python float is fine: adjust converts it to the stored dtype and shape.
        opt_state = mpx.adjust(opt_state, learning_rate=lr)
      else:
        # A strongly typed float32 array, so the step's input types stay the same.
        opt_state = optax.tree.set(opt_state, learning_rate=jnp.float32(lr))
      # The step this batch would have taken at the old rate, for comparison.
      _, state_at_old_lr, _ = train_step(params, old_state, x, y)
    new_params, new_state, loss = train_step(params, opt_state, x, y)
    if i in changes:
      stored = current_lr(opt_state)
      expected = lr / float(current_lr(old_state))
      ratio = master_step_norm(params, opt_state, new_state) / master_step_norm(
        params, old_state, state_at_old_lr
      )
      print(
        f"step {i:>4}: {how} -> learning rate {float(stored):g} ({stored.dtype}); the step "
        f"moved the masters {ratio:.5f}x as far as at the old rate (expected {expected:g}x)"
      )
      checks[f"{how}: learning rate stored as float32 {lr:g}"] = (
        stored.dtype == jnp.float32 and float(stored) == float(np.float32(lr))
      )
      # AdamW's step is lr times a direction that does not depend on lr; the
      # rest is float32 rounding of the masters.
      checks[f"{how}: step size scaled by {expected:g}"] = abs(ratio / expected - 1) < 1e-2
    params, opt_state = new_params, new_state
    if i % log_every == 0 or i == size.steps - 1:
      print(f"step {i:>4}  loss {float(loss):.4f}  lr {float(current_lr(opt_state)):g}")

  final_val = float(val_loss(params, x_val, y_val))
  print(f"validation loss {initial_val:.4f} -> {final_val:.4f}; train_step traced {len(traces)}x")
  checks["train_step traced (and compiled) once for the whole run"] = len(traces) == 1
  checks["validation loss fell by more than half"] = final_val < 0.5 * initial_val

  # The pitfall: a Python float through optax.tree.set is stored as is, a weakly
  # typed value that jit treats as a new input type, so it compiles again.
  before = len(traces)
  train_step(params, optax.tree.set(opt_state, learning_rate=1e-4), x, y)
  print(
    f"for comparison, optax.tree.set(opt_state, learning_rate=1e-4) with a Python float: "
    f"train_step traced {len(traces) - before} more time(s)"
  )
  return report(checks)


def report(checks: dict[str, bool]) -> int:
  """Prints each check; returns the exit status (1 if any failed)."""
  for name, ok in checks.items():
    print(f"{'ok  ' if ok else 'FAIL'}  {name}")
  if all(checks.values()):
    print("OK: all checks passed")
    return 0
  print("FAIL: some checks failed")
  return 1


if __name__ == "__main__":
  sys.exit(main())
