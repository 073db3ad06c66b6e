"""Equinox in bfloat16, with float32 master weights.

An ``eqx.nn.MLP`` learns a fixed random "teacher" network. Its weights are
cast to bfloat16; the optimizer is ``mpx.mixed_precision(optax.adamw(...))``,
so the float32 masters and AdamW's moments live in the optimizer state.

The one thing to know with equinox: apply mpx's updates with
``optax.apply_updates``, on the arrays of the model, not with
``eqx.apply_updates``. The updates are float32 (they land each bfloat16
weight exactly on its rounded master), and ``eqx.apply_updates`` adds them
without casting back, which would silently widen the model to float32;
``optax.apply_updates`` keeps every leaf's dtype. The idiom::

  params, static = eqx.partition(model, eqx.is_inexact_array)
  updates, opt_state = tx.update(grads, opt_state, params)
  model = eqx.combine(optax.apply_updates(params, updates), static)

If a widened model reaches the next ``tx.update`` anyway, mpx refuses it with
a message that says so (checked at the end).

Run from the repository root::

  python examples/equinox_bf16.py               # default size: ~20 s on 2 CPU cores
  MPX_SMOKE=1 python examples/equinox_bf16.py   # tiny size, mostly compilation

The script ends with self-checks (the loss fell, every weight is still
bfloat16 and is its float32 master rounded as mpx documents, ties away from
zero, the widened model is refused) and exits with status 1 if one fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx

FEATURES, OUTPUTS = 16, 4
SMOKE = os.environ.get("MPX_SMOKE", "0") not in ("", "0")
STEPS, WIDTH = (200, 32) if SMOKE else (800, 128)


def teacher(x: np.ndarray) -> np.ndarray:
  rng = np.random.default_rng(1234)
  a = rng.normal(size=(FEATURES, 32)) / np.sqrt(FEATURES)
  b = rng.normal(size=(32, OUTPUTS)) / np.sqrt(32)
  return (np.sin(x @ a) @ b).astype(np.float32)


def batch(rng: np.random.Generator, n: int = 128) -> tuple[np.ndarray, np.ndarray]:
  x = rng.normal(size=(n, FEATURES)).astype(np.float32)
  return x, teacher(x)


def to_bfloat16(model: Any) -> Any:
  """The model with every floating array in bfloat16."""
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)


def loss_fn(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  pred = jax.vmap(model)(x.astype(jnp.bfloat16))
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)  # the mean in float32


tx = mpx.mixed_precision(optax.adamw(3e-3, weight_decay=1e-4))


@eqx.filter_jit
def train_step(model: Any, opt_state: Any, x: jax.Array, y: jax.Array):
  loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)  # bfloat16 grads
  params, static = eqx.partition(model, eqx.is_inexact_array)
  updates, opt_state = tx.update(grads, opt_state, params)
  model = eqx.combine(optax.apply_updates(params, updates), static)  # keeps bfloat16
  return model, opt_state, loss


def parse_args(argv: list[str] | None) -> tuple[int, int]:
  """Returns ``(steps, width)``; ``MPX_SMOKE=1`` picks the tiny defaults."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=STEPS, help="training steps")
  parser.add_argument("--width", type=int, default=WIDTH, help="hidden layer width")
  args = parser.parse_args(argv)
  if args.steps < 4 or args.width < 1:
    parser.error("--steps must be >= 4, --width >= 1")
  return args.steps, args.width


def main(argv: list[str] | None = None) -> int:
  steps, width = parse_args(argv)
  model = to_bfloat16(eqx.nn.MLP(FEATURES, OUTPUTS, width, depth=2, key=jax.random.key(0)))
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  rng = np.random.default_rng(0)
  val_x, val_y = batch(np.random.default_rng(99), 1024)
  start = float(loss_fn(model, val_x, val_y))
  print(f"bfloat16 equinox MLP (width {width}), {steps} steps")
  for step in range(1, steps + 1):
    model, opt_state, loss = train_step(model, opt_state, *batch(rng))
    if step % (steps // 4) == 0:
      print(f"  step {step:4d}  train loss {float(loss):.4f}")
  end = float(loss_fn(model, val_x, val_y))
  print(f"validation loss {start:.4f} -> {end:.4f}")

  params = eqx.filter(model, eqx.is_inexact_array)
  masters = mpx.master_params(opt_state, params)
  low = [x for x in jax.tree.leaves(params)]
  high = [x for x in jax.tree.leaves(masters)]
  checks = {
    "the validation loss fell below a fifth": end < start / 5,
    "every weight is still bfloat16": all(x.dtype == jnp.bfloat16 for x in low),
    "the weights are their float32 masters, rounded (ties away from zero)": all(
      np.array_equal(np.asarray(p).view(np.uint16), rounded_ties_away(m).view(np.uint16))
      for m, p in zip(high, low, strict=True)
    ),
    "the masters are float32 and hold bits bfloat16 cannot": all(
      m.dtype == jnp.float32 for m in high
    )
    and any(bool(jnp.any(m != p.astype(jnp.float32))) for m, p in zip(high, low, strict=True)),
    "eqx.apply_updates' widened model is refused with a clear error": _widening_is_refused(
      model, opt_state, val_x[:8], val_y[:8]
    ),
  }
  for name, ok in checks.items():
    print(f"{'ok  ' if ok else 'FAIL'}  {name}")
  if all(checks.values()):
    print("OK: all checks passed")
    return 0
  print("FAIL: some checks failed")
  return 1


def rounded_ties_away(master: jax.Array) -> np.ndarray:
  """The bfloat16 param mpx documents for a float32 ``master``, computed here in numpy.

  Nearest, ties *away from zero* (docs/concepts_masters.md): the top half of
  ``master_bits + 0x8000``. ``astype(jnp.bfloat16)`` rounds ties to even and
  differs on exact ties. Masters beyond bfloat16's range saturate at the
  largest float32 whose rounding is finite, 0x7f7f7fff.
  """
  limit = np.array(0x7F7F7FFF, np.uint32).view(np.float32)
  bits = np.clip(np.asarray(master, np.float32), -limit, limit).view(np.uint32)
  return ((bits + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16).view(jnp.bfloat16)


def _widening_is_refused(model: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> bool:
  grads = eqx.filter_grad(loss_fn)(model, x, y)
  params = eqx.filter(model, eqx.is_inexact_array)
  updates, new_state = tx.update(grads, opt_state, params)
  widened = eqx.apply_updates(model, updates)  # p + u: float32 now
  try:
    tx.update(grads, new_state, eqx.filter(widened, eqx.is_inexact_array))
  except ValueError as error:
    print(f"  eqx.apply_updates, then tx.update: {str(error)[:96]}...")
    return "widened" in str(error)
  return False


if __name__ == "__main__":
  sys.exit(main())
