"""Flax nnx and ``nnx.Optimizer`` in bfloat16, with float32 master weights.

A small nnx MLP learns a fixed random "teacher" network (a regression on
synthetic data drawn fresh for every step). Its parameters are created in
bfloat16 (``param_dtype``) and its forward and backward pass run in bfloat16;
the optimizer is

  ``nnx.Optimizer(model, mpx.mixed_precision(optax.adamw(...), masters="remainder",
  moments="8bit"), wrt=nnx.Param)``

so the float32 masters (as the 16 bits bfloat16 lacks) and AdamW's moments
(8 bits an element with a scale per block; AdamW itself runs in float32) live
in ``optimizer.opt_state``: 4 bytes of state per parameter instead of 12, the
same training as ``masters="full"`` for the masters. ``optimizer.update(model,
grads)`` writes the rounded masters back into the bfloat16 model. bfloat16 has float32's exponent
range, so no loss scaling is needed (for float16, wrap the rule in
``mpx.loss_scale`` and return ``mpx.scale_loss(loss, optimizer.opt_state)``
from the loss function; see ``examples/flax_linen_fp16.py``).

At the end the float32 masters are read out with ``nnx.as_pure`` and
``mpx.master_params`` and merged into a float32 copy of the model, the one to
evaluate or export. ``nnx.Optimizer`` initialises the rule on the bfloat16
params, so the masters start from rounded values; that makes no difference for
a random initialisation (to start from FP32 weights losing no bit, see
``examples/finetune_from_fp32_checkpoint.py``).

Run from the repository root::

  python examples/flax_nnx_bf16.py               # default size: ~15 s on 2 CPU cores
  MPX_SMOKE=1 python examples/flax_nnx_bf16.py   # tiny size, mostly compilation
  python examples/flax_nnx_bf16.py --steps 2000 --width 256
  python examples/flax_nnx_bf16.py --masters full --moments full   # 12 B/param

The script ends with self-checks (the validation loss fell, the bfloat16
params are the masters rounded as mpx documents, ties away from zero, the
masters hold bits that bfloat16 cannot, AdamW's large moments are stored as
``--moments`` says and ``mpx.inner_state`` gives them back in float32) and
exits with status 1 if one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mpx

FEATURES = 16  # inputs of the regression
OUTPUTS = 4  # outputs of the regression
SEED = 0
PyTree = Any
# How each --moments stores a first moment as large as the hidden layer's
# kernel (nnx keeps these types through every optimizer.update).
STORED_MOMENT = {"full": jax.Array, "bfloat16": mpx.Bfloat16Moment, "8bit": mpx.Signed8bitMoment}


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size; the smoke size only has to run and pass the checks quickly."""

  steps: int
  batch: int
  width: int
  log_every: int
  masters: str = "remainder"
  moments: str = "8bit"


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


class MLP(nnx.Module):
  """Two GELU layers and a linear readout.

  The layers set no compute ``dtype``, so they compute in the dtype of their
  weights: bfloat16 here, float32 once the masters are merged in.
  """

  def __init__(self, width: int, param_dtype: Any, rngs: nnx.Rngs):
    self.dense1 = nnx.Linear(FEATURES, width, param_dtype=param_dtype, rngs=rngs)
    self.dense2 = nnx.Linear(width, width, param_dtype=param_dtype, rngs=rngs)
    self.out = nnx.Linear(width, OUTPUTS, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    # Cast the input too: float32 inputs would promote the first layer to float32.
    h = nnx.gelu(self.dense1(x.astype(self.dense1.kernel.dtype)))
    h = nnx.gelu(self.dense2(h))
    return self.out(h)


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  # In float32: a bfloat16 mean keeps only 8 significant bits.
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


# --- Training --------------------------------------------------------------------


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
  def loss_fn(model: MLP) -> jax.Array:
    return mse(model(x), y)

  loss, grads = nnx.value_and_grad(loss_fn)(model)  # bfloat16 grads
  optimizer.update(model, grads)  # passes the params to tx.update, as mpx needs
  return loss


@nnx.jit
def val_loss(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return mse(model(x), y)


def float32_model(model: MLP, optimizer: nnx.Optimizer) -> tuple[MLP, PyTree, PyTree]:
  """A float32 copy of ``model`` with the masters as weights; also the two param trees.

  ``nnx.as_pure`` turns nnx's variable wrappers into plain arrays, the form
  mpx's helpers take.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.as_pure(params)
  masters = mpx.master_params(nnx.as_pure(optimizer.opt_state), params)
  return nnx.merge(graphdef, masters, rest), params, masters


def snapshot(model: MLP, optimizer: nnx.Optimizer) -> tuple[list, list]:
  """Host copies of the bfloat16 params and the float32 masters, leaf by leaf."""
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  masters = mpx.master_params(nnx.as_pure(optimizer.opt_state), params)
  return [np.asarray(p) for p in jax.tree.leaves(params)], [
    np.asarray(m) for m in jax.tree.leaves(masters)
  ]


def share_lost_without_masters(before: tuple[list, list], after: tuple[list, list]) -> float:
  """Share of one step's nonzero master updates that a bfloat16 weight would not take.

  Without masters, ``optax.apply_updates`` adds the update to the bfloat16
  weight and rounds the sum back to bfloat16, which gives the old weight again
  whenever the update is below half a bfloat16 ulp of it.
  """
  lost = moved = 0
  for p, m0, m1 in zip(*before, after[1], strict=True):
    update = m1 - m0
    stays = (p.astype(np.float32) + update).astype(p.dtype) == p
    lost += int(np.sum((update != 0) & stays))
    moved += int(np.sum(update != 0))
  return lost / max(1, moved)


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


def rounded_ties_away(masters: PyTree) -> PyTree:
  """The bfloat16 params mpx documents for float32 ``masters``, computed here in numpy.

  Nearest, ties *away from zero* (docs/concepts_masters.md): the top half of
  ``master_bits + 0x8000``. ``astype`` (and ``mpx.cast_tree``) round ties to
  even and differ on exact ties. Masters beyond bfloat16's range saturate at
  the largest float32 whose rounding is finite, 0x7f7f7fff.
  """
  limit = np.array(0x7F7F7FFF, np.uint32).view(np.float32)

  def round_leaf(master: jax.Array) -> np.ndarray:
    bits = np.clip(np.asarray(master, np.float32), -limit, limit).view(np.uint32)
    return ((bits + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16).view(jnp.bfloat16)

  return jax.tree.map(round_leaf, masters)


def dtypes(tree: PyTree) -> set[str]:
  return {x.dtype.name for x in jax.tree.leaves(tree)}


# --- Main ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> Size:
  """Returns the size; ``MPX_SMOKE=1`` picks the tiny preset."""
  smoke = os.environ.get("MPX_SMOKE", "") not in ("", "0")
  preset = SMOKE_SIZE if smoke else DEFAULT_SIZE
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=preset.steps, help="training steps")
  parser.add_argument("--batch", type=int, default=preset.batch, help="examples per step")
  parser.add_argument("--width", type=int, default=preset.width, help="hidden layer width")
  parser.add_argument(
    "--masters", choices=("full", "remainder"), default="remainder", help="master storage"
  )
  parser.add_argument(
    "--moments", choices=("full", "bfloat16", "8bit"), default="8bit", help="moment storage"
  )
  args = parser.parse_args(argv)
  if min(args.steps, args.batch, args.width) < 1:
    parser.error("--steps, --batch and --width must be >= 1")
  log_every = min(preset.log_every, args.steps)
  return Size(args.steps, args.batch, args.width, log_every, args.masters, args.moments)


def main(argv: list[str] | None = None) -> int:
  size = parse_args(argv)
  x_val = np.random.default_rng(SEED + 1).normal(size=(2048, FEATURES)).astype(np.float32)
  y_val = teacher(x_val)

  model = MLP(size.width, jnp.bfloat16, nnx.Rngs(SEED))
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, max(1, size.steps // 20), size.steps)
  adamw = optax.adamw(schedule, weight_decay=1e-4)
  tx = mpx.mixed_precision(adamw, masters=size.masters, moments=size.moments)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  initial_val = float(val_loss(model, x_val, y_val))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.as_pure(optimizer.opt_state)))
  print(
    f"bfloat16 nnx MLP (width {size.width}) on a synthetic regression: "
    f"{size.steps} steps x {size.batch} examples; validation loss {initial_val:.4f} at step 0"
  )
  print(
    f'masters="{size.masters}", moments="{size.moments}": '
    f"{state_bytes / n_params:.2f} bytes of optimizer state per parameter"
  )
  print(f"{'step':>6}{'loss':>10}")
  data = batches(size.batch, SEED)
  probe_step = size.steps // 2
  for i in range(size.steps):
    if i == probe_step:
      before = snapshot(model, optimizer)
    loss = train_step(model, optimizer, *next(data))
    if i == probe_step:
      lost_share = share_lost_without_masters(before, snapshot(model, optimizer))
    if i % size.log_every == 0 or i == size.steps - 1:
      print(f"{i:>6}{float(loss):>10.4f}")  # float() waits for the device

  final_val = float(val_loss(model, x_val, y_val))
  model32, params, masters = float32_model(model, optimizer)
  masters_val = float(val_loss(model32, x_val, y_val))
  print(
    f"validation loss: {initial_val:.4f} -> {final_val:.4f} (bfloat16 model), "
    f"{masters_val:.4f} (float32 masters)"
  )
  print(
    f"step {probe_step}: {lost_share:.1%} of the weight updates were below half a bfloat16 ulp "
    "of their weight:\n  kept by the float32 masters, rounded away with plain bfloat16 weights"
  )
  state = nnx.as_pure(optimizer.opt_state)
  stored = state.inner_state[0]  # adamw = chain(adam, decay, lr)
  adam = mpx.inner_state(state)[0]  # the moments decompressed, as optax.adamw holds them

  checks = {
    "validation loss fell by more than half": final_val < 0.5 * initial_val,
    "params are bfloat16, masters and the float32 model float32": (
      dtypes(params) == {"bfloat16"}
      and dtypes(masters) == {"float32"}
      and dtypes(nnx.state(model32, nnx.Param)) == {"float32"}
    ),
    "params are exactly the rounded masters": bitwise_equal(params, rounded_ties_away(masters)),
    "the masters kept updates that bfloat16 weights would have lost": lost_share > 0,
    f"AdamW's moments are stored as moments={size.moments!r}, read back in float32": (
      isinstance(adam, optax.ScaleByAdamState)
      and dtypes((adam.mu, adam.nu)) == {"float32"}
      and isinstance(stored.mu["dense2"]["kernel"], STORED_MOMENT[size.moments])
    ),
    "optimizer.step counts every step": int(optimizer.step[...]) == size.steps,
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
