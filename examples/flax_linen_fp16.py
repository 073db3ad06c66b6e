"""Flax linen and ``TrainState`` in float16, with float32 masters and dynamic loss scaling.

A small linen MLP learns a fixed random "teacher" network (a regression on
synthetic data drawn fresh for every step). Its weights and its whole forward
and backward pass are float16; the optimizer is

  ``mpx.loss_scale(mpx.mixed_precision(optax.adamw(...)))``

so the float32 master weights, AdamW's moments and the loss scale live in
``TrainState.opt_state``, and ``TrainState.apply_gradients`` runs unchanged.
The step differentiates ``mpx.scale_loss(loss, state.opt_state)``; mpx
unscales the gradients in float32, skips a step whose gradients hold inf or
NaN (and halves the scale), and grows the scale again after
``--growth-interval`` finite steps.

Halfway through, one corrupt batch (an input beyond float16's maximum of
65504) overflows the forward pass, to show a skipped step: params and masters
stay bitwise unchanged and the scale backs off.

Run from the repository root::

  python examples/flax_linen_fp16.py               # default size: ~10 s on 2 CPU cores
  MPX_SMOKE=1 python examples/flax_linen_fp16.py   # tiny size, mostly compilation
  python examples/flax_linen_fp16.py --steps 2000 --width 256

The script ends with self-checks (the validation loss fell, the float16 params
are the float32 masters rounded to nearest even, the corrupt batch was skipped, the loss scale
and the skip count are sane) and exits with status 1 if one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import mpx

FEATURES = 16  # inputs of the regression
OUTPUTS = 4  # outputs of the regression
SEED = 0
PyTree = Any


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size; the smoke size only has to run and pass the checks quickly."""

  steps: int
  batch: int
  width: int
  log_every: int


DEFAULT_SIZE = Size(steps=800, batch=128, width=128, log_every=100)
SMOKE_SIZE = Size(steps=200, batch=64, width=32, log_every=50)


# --- Data ------------------------------------------------------------------------


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


# --- Model -----------------------------------------------------------------------


class MLP(nn.Module):
  """Two GELU layers and a linear readout, computing in ``dtype``.

  Flax keeps ``param_dtype`` (float32 here) at ``init``; the params are cast
  to float16 afterwards by ``mpx.init_from_full_precision``. ``dtype`` sets
  the compute dtype, so a float32 twin of the model can evaluate the masters.
  """

  width: int
  dtype: Any = jnp.float16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.gelu(nn.Dense(self.width, dtype=self.dtype)(x))
    h = nn.gelu(nn.Dense(self.width, dtype=self.dtype)(h))
    return nn.Dense(OUTPUTS, dtype=self.dtype)(h)


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  # In float32: a float16 mean of squares loses precision and can overflow.
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


# --- Training --------------------------------------------------------------------


def create_state(
  model: MLP, fp32_params: PyTree, steps: int, growth_interval: int
) -> train_state.TrainState:
  """A float16 ``TrainState`` whose masters hold the exact FP32 initialisation.

  ``TrainState.create`` would call ``tx.init`` on params already cast to
  float16, so the masters could only start from rounded values.
  """
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, max(1, steps // 20), steps)
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.adamw(schedule, weight_decay=1e-4)),
    growth_interval=growth_interval,
  )
  # Jitted: one compile instead of one per eager op on each leaf.
  init = jax.jit(lambda p: mpx.init_from_full_precision(tx, p, jnp.float16))
  params, opt_state = init(fp32_params)
  return train_state.TrainState(
    step=0, apply_fn=model.apply, params=params, tx=tx, opt_state=opt_state
  )


@jax.jit
def train_step(
  state: train_state.TrainState, x: jax.Array, y: jax.Array
) -> tuple[train_state.TrainState, dict[str, jax.Array]]:
  def scaled_loss(params: PyTree) -> tuple[jax.Array, jax.Array]:
    loss = mse(state.apply_fn({"params": params}, x), y)
    return mpx.scale_loss(loss, state.opt_state), loss  # unscaled loss for logging

  grads, loss = jax.grad(scaled_loss, has_aux=True)(state.params)  # float16, scaled
  state = state.apply_gradients(grads=grads)  # unscale, check, step or skip
  metrics = {
    "loss": loss,
    "loss_scale": state.opt_state.loss_scale,  # the scale for the next step
    "skipped_steps": state.opt_state.skipped_steps,  # in total
    "applied": state.opt_state.last_step_finite,
  }
  return state, metrics


def bitwise_equal(a: PyTree, b: PyTree) -> bool:
  """Same structure, dtypes, shapes and bits at every leaf (-0.0 differs from 0.0)."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape:
      return False
    bits = np.dtype(f"u{x.dtype.itemsize}")
    if not np.array_equal(x.view(bits), y.view(bits)):
      return False
  return True


def rounded_to_nearest_even(masters: PyTree) -> PyTree:
  """The float16 params mpx documents for float32 ``masters``, computed here in numpy.

  Nearest, ties to even (numpy's float32 to float16 conversion), saturating at
  float16's largest finite value, 65504, where a plain cast would give inf.
  """
  largest = np.finfo(np.float16).max
  return jax.tree.map(
    lambda m: np.clip(np.asarray(m, np.float32), -largest, largest).astype(np.float16), masters
  )


# --- Main ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[Size, int]:
  """Returns ``(size, growth_interval)``; ``MPX_SMOKE=1`` picks the tiny preset."""
  smoke = os.environ.get("MPX_SMOKE", "") not in ("", "0")
  preset = SMOKE_SIZE if smoke else DEFAULT_SIZE
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=preset.steps, help="training steps")
  parser.add_argument("--batch", type=int, default=preset.batch, help="examples per step")
  parser.add_argument("--width", type=int, default=preset.width, help="hidden layer width")
  parser.add_argument(
    "--growth-interval",
    type=int,
    default=100,
    help="finite steps before the loss scale doubles (PyTorch's default is 2000; "
    "100 lets a short run show the scale move)",
  )
  args = parser.parse_args(argv)
  if min(args.steps, args.batch, args.width, args.growth_interval) < 1:
    parser.error("--steps, --batch, --width and --growth-interval must be >= 1")
  if args.steps < 4:
    parser.error("--steps must be >= 4 (the corrupt batch comes halfway)")
  log_every = min(preset.log_every, args.steps)
  size = Size(steps=args.steps, batch=args.batch, width=args.width, log_every=log_every)
  return size, args.growth_interval


def main(argv: list[str] | None = None) -> int:
  size, growth_interval = parse_args(argv)
  model = MLP(size.width)
  x_val = np.random.default_rng(SEED + 1).normal(size=(2048, FEATURES)).astype(np.float32)
  y_val = teacher(x_val)
  # Jitted init: one compile is quicker than flax's op-by-op initialisation.
  fp32_params = jax.jit(model.init)(jax.random.key(SEED), x_val[:1])["params"]
  state = create_state(model, fp32_params, size.steps, growth_interval)

  @functools.partial(jax.jit, static_argnums=1)
  def val_loss(params: PyTree, dtype: Any) -> jax.Array:
    return mse(MLP(size.width, dtype).apply({"params": params}, x_val), y_val)

  initial_val = float(val_loss(state.params, jnp.float16))
  print(
    f"float16 linen MLP (width {size.width}) on a synthetic regression: "
    f"{size.steps} steps x {size.batch} examples; validation loss {initial_val:.4f} at step 0"
  )
  print(f"{'step':>6}{'loss':>10}{'loss scale':>12}{'skipped':>9}  note")

  corrupt_step = size.steps // 2
  corrupt: dict[str, Any] = {}
  data = batches(size.batch, SEED)
  for i in range(size.steps):
    x, y = next(data)
    note = ""
    if i == corrupt_step:
      # An input beyond float16's range: inf in the forward pass, so every
      # gradient is inf or NaN. mpx must skip this step.
      x = x.copy()
      x[0, 0] = 1e5
      corrupt["before"] = state
      note = "corrupt batch (inf in the fp16 forward pass)"
    state, metrics = train_step(state, x, y)
    if i == corrupt_step:
      corrupt["after"], corrupt["metrics"] = state, jax.device_get(metrics)
    if i % size.log_every == 0 or i == size.steps - 1 or note:
      m = jax.device_get(metrics)  # waits for the device: only at log points
      note = note or ("" if m["applied"] else "overflow: step skipped, scale halved")
      print(
        f"{i:>6}{m['loss']:>10.4f}{m['loss_scale']:>12.0f}{m['skipped_steps']:>9}  {note}".rstrip()
      )

  masters = mpx.master_params(state.opt_state, state.params)
  final_val = float(val_loss(state.params, jnp.float16))
  masters_val = float(val_loss(masters, jnp.float32))
  skipped = int(state.opt_state.skipped_steps)
  scale = float(state.opt_state.loss_scale)
  print(
    f"validation loss: {initial_val:.4f} -> {final_val:.4f} (float16 model), "
    f"{masters_val:.4f} (float32 masters in a float32 model)"
  )
  print(f"TrainState.step {int(state.step)}; mpx skipped {skipped}; final loss scale {scale:.0f}")

  before, after, m = corrupt["before"], corrupt["after"], corrupt["metrics"]
  checks = {
    "validation loss fell by more than half": final_val < 0.5 * initial_val,
    "params are float16, masters float32": (
      {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(jnp.float16)}
      and {x.dtype for x in jax.tree.leaves(masters)} == {np.dtype(jnp.float32)}
    ),
    "params are exactly the rounded masters": bitwise_equal(
      state.params, rounded_to_nearest_even(masters)
    ),
    "corrupt batch skipped: params and masters bitwise unchanged, scale halved": (
      not m["applied"]
      and bitwise_equal(after.params, before.params)
      and bitwise_equal(
        mpx.master_params(after.opt_state, after.params),
        mpx.master_params(before.opt_state, before.params),
      )
      and float(after.opt_state.loss_scale) == float(before.opt_state.loss_scale) / 2
    ),
    "TrainState.step counts every step, skipped ones too": int(state.step) == size.steps,
    # Overflows are rare events that tune the scale; skipping a large share of
    # steps would mean the model itself produces inf or NaN.
    "few steps skipped (<= 10%), loss scale finite and in [1, 2**24]": (
      1 <= skipped <= max(2, size.steps // 10) and 1.0 <= scale <= 2.0**24
    ),
  }
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
