"""PyTorch's "Automatic Mixed Precision examples", recipe by recipe, in mpx.

PyTorch's page (https://pytorch.org/docs/stable/notes/amp_examples.html) shows
how to use ``GradScaler`` with gradient clipping, gradient penalties, several
losses and models, several parameter groups and gradient accumulation. In mpx
the scaler is ``mpx.loss_scale``, an optax transformation, and most recipes
become a choice of optax layout; ``docs/recipes.md`` explains each one next to
its PyTorch form. Here each recipe is a function that trains a small float16
MLP on a synthetic regression and checks what the recipe is about:

* ``clipping``: ``optax.clip_by_global_norm`` inside
  ``loss_scale(mixed_precision(chain(...)))`` sees the true, unscaled float32
  gradients (PyTorch needs ``scaler.unscale_`` first).
* ``penalty``: a gradient penalty built from ``mpx.unscale`` of the scaled
  gradients (PyTorch divides by ``scaler.get_scale()``).
* ``losses``: two models, two losses, one ``loss_scale``: each loss is scaled,
  there is one backward pass and one skip decision for both models.
* ``groups``: parameter groups with ``optax.partition``: a frozen first
  layer (no master, no optimizer state), a hidden layer and a head with their
  own AdamW settings, all under one ``loss_scale``.
* ``accumulation``: ``optax.MultiSteps`` inside ``mixed_precision``, so every
  micro-batch is unscaled into a float32 accumulator and the model moves once
  per window.

Run from the repository root::

  python examples/amp_recipes.py                          # all recipes: ~25 s on 2 CPU cores
  python examples/amp_recipes.py --recipe penalty --recipe groups
  MPX_SMOKE=1 python examples/amp_recipes.py              # tiny size, mostly compilation

Each recipe ends with self-checks; the script exits with status 1 if one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx

FEATURES = 16  # inputs of the regression
OUTPUTS = 4  # outputs of the regression
SEED = 0
F16, F32 = jnp.float16, jnp.float32
PyTree = Any


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size of each recipe; the smoke size only has to run and pass the checks."""

  steps: int
  batch: int
  width: int


DEFAULT_SIZE = Size(steps=400, batch=128, width=64)
SMOKE_SIZE = Size(steps=100, batch=64, width=32)


# --- Data and model ------------------------------------------------------------------


def teacher(x: np.ndarray) -> np.ndarray:
  """A fixed random one-hidden-layer network: the function to learn."""
  rng = np.random.default_rng(1234)  # the same teacher for every run
  a = rng.normal(size=(FEATURES, 32)) / np.sqrt(FEATURES)
  b = rng.normal(size=(32, OUTPUTS)) / np.sqrt(32)
  return (np.sin(x @ a) @ b).astype(np.float32)


def batches(batch: int, seed: int = SEED) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless fresh ``(x, y)`` batches, so training loss tracks validation loss."""
  rng = np.random.default_rng(seed)
  while True:
    x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
    yield x, teacher(x)


def init_params(width: int, seed: int = SEED) -> PyTree:
  """Float32 weights of a two-hidden-layer MLP.

  Drawn with numpy: jax's random numbers would cost a compilation per recipe.
  """
  rng = np.random.default_rng(seed)
  sizes = [FEATURES, width, width, OUTPUTS]
  return {
    f"dense{i}": {
      "kernel": jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), F32),
      "bias": jnp.zeros(n_out, F32),
    }
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes))
  }


def apply(params: PyTree, x: jax.Array) -> jax.Array:
  """The MLP, computing in its weights' dtype."""
  h = x.astype(params["dense0"]["kernel"].dtype)
  for i in range(len(params)):
    h = h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"]
    if i < len(params) - 1:
      h = jax.nn.gelu(h)
  return h


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  # In float32: a float16 mean of squares loses precision and can overflow.
  return jnp.mean((pred.astype(F32) - y) ** 2)


def loss_fn(params: PyTree, x: jax.Array, y: jax.Array) -> jax.Array:
  return mse(apply(params, x), y)


def fp16_start(tx: optax.GradientTransformation, fp32_params: PyTree) -> tuple:
  """Float16 params and ``tx``'s state, the masters seeded from ``fp32_params``."""
  # Jitted: one compile instead of one per eager op on each leaf.
  return jax.jit(lambda p: mpx.init_from_full_precision(tx, p, F16))(fp32_params)


X_VAL = np.random.default_rng(SEED + 1).normal(size=(1024, FEATURES)).astype(np.float32)
Y_VAL = teacher(X_VAL)


@jax.jit
def val_loss(params: PyTree) -> jax.Array:
  return loss_fn(params, X_VAL, Y_VAL)


def bitwise_equal(a: PyTree, b: PyTree) -> bool:
  """Same structure, dtypes and bits at every leaf."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(
    x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def dtypes(tree: PyTree) -> set[str]:
  return {x.dtype.name for x in jax.tree.leaves(tree)}


def log(i: int, steps: int, **values: Any) -> None:
  """Prints ``values`` at five points of the run (fetching them waits for the device)."""
  if i in {0, steps // 4, steps // 2, 3 * steps // 4, steps - 1}:
    text = "  ".join(f"{k} {number(v)}" for k, v in values.items())
    print(f"  step {i:>4}  {text}")


def number(v: float | int | bool) -> str:
  """Integral values (loss scales, counts) in full, others to 4 digits."""
  return str(int(v)) if float(v).is_integer() and abs(v) >= 1 else f"{v:.4g}"


def fetch(metrics: dict[str, jax.Array]) -> dict[str, Any]:
  """Device values to Python floats and ints, for printing."""
  return {k: v.item() for k, v in jax.device_get(metrics).items()}


# --- Gradient clipping ----------------------------------------------------------------

MAX_NORM = 0.25  # small enough for this problem that clipping is active early on


class SeenNorm(NamedTuple):
  norm: jax.Array


def record_global_norm() -> optax.GradientTransformation:
  """An identity transformation that keeps the global norm of what it was given."""

  def init_fn(params: PyTree) -> SeenNorm:
    del params
    return SeenNorm(jnp.zeros((), F32))

  def update_fn(updates, state, params=None):
    del state, params
    return updates, SeenNorm(optax.tree.norm(updates).astype(F32))

  return optax.GradientTransformation(init_fn, update_fn)


def clipping(size: Size) -> dict[str, bool]:
  """``clip_by_global_norm`` in the chain clips the unscaled gradients.

  PyTorch: ``scaler.unscale_(opt)``, ``clip_grad_norm_(...)``,
  ``scaler.step(opt)``. In mpx everything inside ``loss_scale`` receives
  unscaled float32 gradients, so the clipping threshold means what it says.
  """
  tx = mpx.loss_scale(
    mpx.mixed_precision(
      optax.chain(record_global_norm(), optax.clip_by_global_norm(MAX_NORM), optax.adamw(3e-3))
    )
  )
  params, opt_state = fp16_start(tx, init_params(size.width))

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x, y), opt_state))(params)
    # For logging only: the gradients' norm as the loss scale leaves them, and
    # unscaled (mpx.unscale divides in float32 by the scale the loss used).
    scaled_norm = optax.tree.norm(mpx.cast_tree(grads, F32))
    true_norm = optax.tree.norm(mpx.unscale(grads, opt_state))
    updates, opt_state = tx.update(grads, opt_state, params)
    seen = optax.tree.get(opt_state, "norm")  # what the chain's first link was given
    applied = opt_state.last_step_finite
    metrics = {
      "true_norm": true_norm,
      "scaled_norm": scaled_norm,
      "seen_norm": seen,
      "seen_error": jnp.where(applied, jnp.abs(seen - true_norm) / true_norm, 0.0),
      "clipped": applied & (true_norm > MAX_NORM),
      "applied": applied,
    }
    return optax.apply_updates(params, updates), opt_state, metrics

  initial = float(val_loss(params))
  worst_error, clipped, applied = 0.0, 0, 0
  for i, (x, y) in zip(range(size.steps), batches(size.batch), strict=False):
    params, opt_state, metrics = step(params, opt_state, x, y)
    m = fetch(metrics)
    worst_error = max(worst_error, m["seen_error"])
    clipped += m["clipped"]
    applied += m["applied"]
    log(
      i, size.steps, grad_norm=m["true_norm"], scaled=m["scaled_norm"], seen_by_chain=m["seen_norm"]
    )
  final = float(val_loss(params))
  print(
    f"  clipped {clipped} of {applied} applied steps at max_norm {MAX_NORM}; validation loss "
    f"{initial:.4f} -> {final:.4f}; the chain saw the unscaled norm to {worst_error:.1e} relative"
  )
  return {
    "the chain saw unscaled gradient norms (to 1e-5 relative)": worst_error < 1e-5,
    "clipping was active in some steps, not all": 0 < clipped < applied,
    "validation loss fell by more than half": final < 0.5 * initial,
  }


# --- Gradient penalty ---------------------------------------------------------------

PENALTY = 0.1  # weight of the gradient-norm penalty


def penalised_loss(
  params: PyTree, x: jax.Array, y: jax.Array, opt_state: optax.OptState | None
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """``loss + PENALTY * ||d loss / d params||``, scaled by ``opt_state``'s loss scale.

  The inner gradients come from the scaled loss, so in float16 they do not
  underflow; ``mpx.unscale`` divides them in float32 by the scale the loss
  used. With ``opt_state=None`` (a float32 reference) nothing is scaled.
  """
  if opt_state is None:
    grads = jax.grad(loss_fn)(params, x, y)
  else:
    scaled = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x, y), opt_state))(params)
    grads = mpx.unscale(scaled, opt_state)
  penalty = optax.tree.norm(grads)
  loss = loss_fn(params, x, y) + PENALTY * penalty
  scaled_loss = loss if opt_state is None else mpx.scale_loss(loss, opt_state)
  return scaled_loss, (loss, penalty)


def penalty(size: Size) -> dict[str, bool]:
  """A gradient penalty built from ``mpx.unscale`` of the scaled gradients.

  PyTorch: ``torch.autograd.grad(scaler.scale(loss), ..., create_graph=True)``,
  times ``1 / scaler.get_scale()``, penalty added to the loss, then the usual
  ``scaler.scale(loss).backward()``.
  """
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adamw(3e-3)))
  params, opt_state = fp16_start(tx, init_params(size.width))

  @jax.jit
  def step(params, opt_state, x, y):
    grads, (loss, penalty) = jax.grad(penalised_loss, has_aux=True)(params, x, y, opt_state)
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics = {
      "loss": loss,
      "penalty": penalty,
      "scale": opt_state.loss_scale,
      "skipped": opt_state.skipped_steps,
    }
    return optax.apply_updates(params, updates), opt_state, metrics

  for i, (x, y) in zip(range(size.steps), batches(size.batch), strict=False):
    before = params
    params, opt_state, metrics = step(params, opt_state, x, y)
    m = fetch(metrics)
    if i == 0:
      first = m
    if math.isfinite(m["penalty"]):  # not an overflowing step
      probe = (before, x, y, m["penalty"])
    log(i, size.steps, **m)

  # The last finite penalty again, from the same float16 weights and batch, but
  # all in float32 and unscaled.
  before, x, y, fp16_penalty = probe
  _, (_, reference) = jax.jit(penalised_loss)(mpx.cast_tree(before, F32), x, y, None)
  gap = abs(fp16_penalty / float(reference) - 1)
  print(
    f"  penalty from unscaled float16 gradients {fp16_penalty:.5f}, float32 reference "
    f"{float(reference):.5f} (relative gap {gap:.1e}); skipped {m['skipped']} steps"
  )
  return {
    # The float16 forward and backward passes round to 11 bits (~5e-4 relative).
    "penalty matches the float32 reference (within 1%)": gap < 1e-2,
    "penalised loss fell by more than half": m["loss"] < 0.5 * first["loss"],
    "few steps skipped (<= 10%)": m["skipped"] <= max(2, size.steps // 10),
  }


# --- Several losses and several models ---------------------------------------------------


def two_losses(params: PyTree, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """PyTorch's example: both losses depend on both models' outputs."""
  out0, out1 = apply(params["model0"], x), apply(params["model1"], x)
  return mse(2 * out0 + 3 * out1, y), mse(3 * out0 - 5 * out1, y)


def losses(size: Size) -> dict[str, bool]:
  """Two models and two losses under one ``loss_scale``.

  PyTorch: ``scaler.scale(loss0).backward()``, ``scaler.scale(loss1).backward()``,
  one ``scaler.step`` per optimizer, one ``scaler.update()``. In mpx both
  models are one params tree: one backward pass, one skip decision. Halfway,
  an inf is put into model1's gradients only; the step is skipped for both.
  """
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adamw(3e-3)))
  both = {"model0": init_params(size.width, SEED), "model1": init_params(size.width, SEED + 1)}
  params, opt_state = fp16_start(tx, both)

  @jax.jit
  def step(params, opt_state, x, y, poison):
    def scaled_total(p):
      loss0, loss1 = two_losses(p, x, y)
      scaled = mpx.scale_loss(loss0, opt_state) + mpx.scale_loss(loss1, opt_state)
      return scaled, (loss0, loss1)

    grads, (loss0, loss1) = jax.grad(scaled_total, has_aux=True)(params)
    # As if model1's backward pass alone had overflowed float16.
    grads["model1"] = jax.tree.map(
      lambda g: jnp.where(poison, jnp.full_like(g, jnp.inf), g), grads["model1"]
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics = {"loss0": loss0, "loss1": loss1, "skipped": opt_state.skipped_steps}
    return optax.apply_updates(params, updates), opt_state, metrics

  poison_step = size.steps // 2
  for i, (x, y) in zip(range(size.steps), batches(size.batch), strict=False):
    poisoned = i == poison_step
    new_params, opt_state, metrics = step(params, opt_state, x, y, poisoned)
    if poisoned:
      unchanged = bitwise_equal(new_params, params)
      print(f"  step {i:>4}  inf in model1's gradients: both models unchanged: {unchanged}")
    if i == 0:
      first = fetch(metrics)
    params = new_params
    log(i, size.steps, **fetch(metrics))
  last = fetch(metrics)
  # The count may exceed the one deliberate inf: at the initial scale (2**15)
  # the first float16 gradients can overflow, and those steps are skipped
  # while the scale backs off, as with torch's GradScaler.
  print(
    f"  skipped {last['skipped']} steps: the deliberate inf, plus any early overflow "
    "while the loss scale backed off from its initial 2**15"
  )
  return {
    "both losses fell by more than half": (
      last["loss0"] < 0.5 * first["loss0"] and last["loss1"] < 0.5 * first["loss1"]
    ),
    "an inf in model1's gradients skipped the step for both models": unchanged,
    "few steps skipped (<= 10%)": 1 <= last["skipped"] <= max(2, size.steps // 10),
  }


# --- Several parameter groups -------------------------------------------------------


def group_of(params: PyTree) -> PyTree:
  """The parameter-group label of every leaf, for ``optax.partition``."""
  group = {"dense0": "frozen", "dense1": "hidden", "dense2": "head"}
  return {layer: {name: group[layer] for name in leaves} for layer, leaves in params.items()}


def groups(size: Size) -> dict[str, bool]:
  """Per-group rules with ``optax.partition``, under one ``loss_scale``.

  PyTorch: optimizer param groups. Here the first layer is frozen (random
  features), the hidden layer uses AdamW with weight decay and the head AdamW
  with a larger rate and no decay. ``mixed_precision`` wraps each trained
  group's rule; the frozen group gets none, so it costs no master and no
  optimizer state. (``mixed_precision`` around the whole partition works too,
  but gives the frozen layer a master as well.)
  """
  tx = mpx.loss_scale(
    optax.partition(
      {
        "frozen": optax.set_to_zero(),
        "hidden": mpx.mixed_precision(optax.adamw(3e-3, weight_decay=1e-2)),
        "head": mpx.mixed_precision(optax.adamw(1e-2, weight_decay=0.0)),
      },
      group_of,
    )
  )
  # init_from_full_precision would refuse: the frozen float16 layer has no
  # master to keep its float32 bits. For a random init the rounding is harmless.
  params = mpx.cast_tree(init_params(size.width), F16)
  opt_state = tx.init(params)
  start = params

  @jax.jit
  def step(params, opt_state, x, y):
    def scaled_loss(p):
      loss = loss_fn(p, x, y)
      # get_loss_scale finds the one loss scale around the partition.
      return mpx.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  initial = float(val_loss(params))
  for i, (x, y) in zip(range(size.steps), batches(size.batch), strict=False):
    params, opt_state, metrics = step(params, opt_state, x, y)
    log(i, size.steps, **fetch(metrics))
  final = float(val_loss(params))
  masters = mpx.master_params(opt_state, params)  # from every group's mixed_precision
  n_masters = sum(x.size for x in jax.tree.leaves(masters) if x.dtype == F32)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(
    f"  validation loss {initial:.4f} -> {final:.4f}; float32 masters for {n_masters:,} of "
    f"{n_params:,} params (the frozen layer has none)"
  )
  return {
    "frozen layer bitwise unchanged, the others trained": (
      bitwise_equal(params["dense0"], start["dense0"])
      and not bitwise_equal(params["dense1"], start["dense1"])
      and not bitwise_equal(params["dense2"], start["dense2"])
    ),
    "masters: float32 for trained groups, none for the frozen one": (
      dtypes(masters["dense0"]) == {"float16"}
      and dtypes((masters["dense1"], masters["dense2"])) == {"float32"}
    ),
    "validation loss fell by more than half": final < 0.5 * initial,
  }


# --- Gradient accumulation ------------------------------------------------------------

MICRO_STEPS = 4  # micro-batches per optimizer step


def accumulation(size: Size) -> dict[str, bool]:
  """``optax.MultiSteps`` inside ``mixed_precision``, inside ``loss_scale``.

  PyTorch: divide the loss by the number of micro-batches, and call
  ``scaler.step`` and ``scaler.update`` only at the end of each window. In mpx
  each micro-gradient is unscaled and cast to float32 before ``MultiSteps``
  accumulates it, so the float32 accumulator never sees a scale and the scale
  may change inside a window; an overflowing micro-batch is dropped alone.
  (``optax.MultiSteps(mpx.mixed_precision(...))`` would hand the inner rule
  a mean rounded to float16; see docs/recipes.md.)
  """
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.MultiSteps(optax.adamw(3e-3), every_k_schedule=MICRO_STEPS))
  )
  params, opt_state = fp16_start(tx, init_params(size.width))

  @jax.jit
  def step(params, opt_state, x, y):
    def scaled_loss(p):
      loss = loss_fn(p, x, y)
      return mpx.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)  # the usual step, every call
    new_params = optax.apply_updates(params, updates)
    moved = jnp.any(
      jnp.stack(
        [jnp.any(a != b) for a, b in zip(*map(jax.tree.leaves, (params, new_params)), strict=True)]
      )
    )
    metrics = {
      "loss": loss,
      "moved": moved,
      "window_closed": opt_state.last_step_finite & (optax.tree.get(opt_state, "mini_step") == 0),
      "optimizer_steps": optax.tree.get(opt_state, "gradient_step"),
    }
    return new_params, opt_state, metrics

  initial = float(val_loss(params))
  micro = size.steps // MICRO_STEPS * MICRO_STEPS  # whole windows only
  moved_mid_window = windows = 0
  for i, (x, y) in zip(range(micro), batches(size.batch // MICRO_STEPS), strict=False):
    params, opt_state, metrics = step(params, opt_state, x, y)
    m = fetch(metrics)
    moved_mid_window += m["moved"] and not m["window_closed"]
    windows += m["window_closed"]
    log(i, micro, loss=m["loss"], optimizer_steps=m["optimizer_steps"])
  final = float(val_loss(params))
  acc = optax.tree.get(opt_state, "acc_grads")
  print(
    f"  {micro} micro-batches of {size.batch // MICRO_STEPS}, {windows} optimizer steps; "
    f"validation loss {initial:.4f} -> {final:.4f}; accumulator dtypes {sorted(dtypes(acc))}"
  )
  return {
    "the model moved only at the end of a window": moved_mid_window == 0,
    # A window with an overflowing micro-batch closes one micro-batch later.
    "one optimizer step per window": (
      m["optimizer_steps"] == windows and windows >= micro // MICRO_STEPS - 2
    ),
    "float32 accumulator": dtypes(acc) == {"float32"},
    "validation loss fell by more than half": final < 0.5 * initial,
  }


# --- Main ------------------------------------------------------------------------

RECIPES: dict[str, Callable[[Size], dict[str, bool]]] = {
  "clipping": clipping,
  "penalty": penalty,
  "losses": losses,
  "groups": groups,
  "accumulation": accumulation,
}


def parse_args(argv: list[str] | None) -> tuple[Size, list[str]]:
  """Returns ``(size, recipes)``; ``MPX_SMOKE=1`` picks the tiny preset."""
  smoke = os.environ.get("MPX_SMOKE", "") not in ("", "0")
  preset = SMOKE_SIZE if smoke else DEFAULT_SIZE
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--recipe",
    action="append",
    choices=list(RECIPES),
    help="recipe to run (repeat for several; default: all)",
  )
  parser.add_argument("--steps", type=int, default=preset.steps, help="training steps per recipe")
  parser.add_argument("--batch", type=int, default=preset.batch, help="examples per step")
  parser.add_argument("--width", type=int, default=preset.width, help="hidden layer width")
  args = parser.parse_args(argv)
  if args.steps < 8 or args.batch < MICRO_STEPS or args.width < 1:
    parser.error(f"--steps must be >= 8, --batch >= {MICRO_STEPS}, --width >= 1")
  recipes = list(dict.fromkeys(args.recipe or RECIPES))  # in the order given, once each
  return Size(steps=args.steps, batch=args.batch, width=args.width), recipes


def main(argv: list[str] | None = None) -> int:
  size, recipes = parse_args(argv)
  print(
    f"float16 MLPs (width {size.width}) on a synthetic regression, {size.steps} steps x "
    f"{size.batch} examples per recipe"
  )
  checks: dict[str, bool] = {}
  for name in recipes:
    summary = RECIPES[name].__doc__.splitlines()[0].replace("``", "")
    print(f"\n== {name}: {summary}")
    for check, ok in RECIPES[name](size).items():
      checks[f"{name}: {check}"] = ok
  print()
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
