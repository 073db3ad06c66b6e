"""Quickstart: train one small model in FP32, bf16 and fp16 with mpx, and compare.

The task is next-byte prediction on real text that every Python install ships:
the standard library's own source files. A small MLP reads a window of
``CONTEXT`` bytes and predicts the next one. The model is trained from the same
FP32 initialisation, on the same batches, in four modes (see
:func:`make_optimizer`, the only mode-specific code):

* ``fp32``: plain ``optax.adamw``, the reference.
* ``bf16+mpx``: bf16 params and compute with
  ``mpx.mixed_precision(optax.adamw(...))``: float32 master weights and Adam
  moments live in the optimizer state.
* ``fp16+mpx+scale``: fp16 params and compute with
  ``mpx.loss_scale(mpx.mixed_precision(optax.adamw(...)))``, differentiating
  ``mpx.scale_loss(loss, opt_state)``.
* ``bf16 no masters``: bf16 params with plain ``optax.adamw``, to show what goes
  wrong without masters: every update smaller than half a bf16 ulp of its
  weight (weight decay, the small steps at the end of the schedule) is
  rounded away.

Run from the repository root::

  python examples/quickstart.py               # default size: about 80 s on 2 CPU cores
  MPX_SMOKE=1 python examples/quickstart.py   # tiny size, mostly compilation
  python examples/quickstart.py --steps 3000 --batch 512 --width 512

At the default size (not with ``MPX_SMOKE=1``) the script checks itself: it
exits with status 1 if a mixed mode's validation loss is more than
``--tolerance`` (relative) above FP32's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys
import sysconfig
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx

CONTEXT = 32  # bytes the model sees
VOCAB = 128  # ASCII; the few non-ASCII bytes in the stdlib map to 0
EMBED = 16
SEED = 0
MODES = ("fp32", "bf16+mpx", "fp16+mpx+scale", "bf16 no masters")
CHECKED = ("bf16+mpx", "fp16+mpx+scale")  # must match FP32 within --tolerance


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size; the smoke size only checks that everything runs."""

  steps: int
  batch: int
  width: int
  eval_windows: int


DEFAULT_SIZE = Size(steps=1500, batch=256, width=256, eval_windows=16384)
SMOKE_SIZE = Size(steps=40, batch=32, width=32, eval_windows=1024)


# --- Data ------------------------------------------------------------------------


def load_corpus() -> tuple[np.ndarray, np.ndarray]:
  """Returns (train, validation) byte arrays made of the stdlib's sources.

  Files are read in sorted order and every 8th goes to validation, so the split
  is deterministic and no validation text is seen in training (random windows
  of one stream would overlap).
  """
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  # _sysconfigdata* is generated per machine; leave it out.
  files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_sysconfigdata"))
  train, valid = [], []
  for i, path in enumerate(files):
    (valid if i % 8 == 0 else train).append(path.read_bytes())
  return _ascii(b"\n".join(train)), _ascii(b"\n".join(valid))


def _ascii(text: bytes) -> np.ndarray:
  data = np.frombuffer(text, np.uint8)
  return np.where(data < VOCAB, data, 0).astype(np.uint8)


def windows(corpus: jax.Array, starts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inputs ``corpus[s : s + CONTEXT]`` and targets ``corpus[s + CONTEXT]``."""
  chunk = corpus[starts[:, None] + jnp.arange(CONTEXT + 1)].astype(jnp.int32)
  return chunk[:, :-1], chunk[:, -1]


# --- Model -----------------------------------------------------------------------


class ByteMLP(nn.Module):
  """Embeds a byte window, then two GELU layers and a linear readout.

  No layer sets ``dtype``, so flax computes in the params' dtype: with bf16 or
  fp16 params the whole forward and backward pass runs in 16 bits.
  """

  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.Embed(VOCAB, EMBED)(x).reshape(x.shape[0], CONTEXT * EMBED)
    h = nn.gelu(nn.Dense(self.width)(h))
    h = nn.gelu(nn.Dense(self.width)(h))
    return nn.Dense(VOCAB)(h)


def per_window_loss(
  model: nn.Module, params: Any, x: jax.Array, y: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy of each window, and the logits, both in float32.

  The loss is taken in float32 whatever the compute dtype: a 16-bit log-sum-exp
  over 128 logits would lose most of the loss's precision.
  """
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y), logits


# --- Optimizers: the only mode-specific code ----------------------------------------


def base_optimizer(steps: int) -> optax.GradientTransformation:
  """AdamW with warmup and cosine decay: the same rule in every mode."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=3e-3, warmup_steps=max(1, steps // 20), decay_steps=steps
  )
  return optax.adamw(schedule, weight_decay=1e-2)


def make_optimizer(
  mode: str, fp32_params: Any, steps: int
) -> tuple[optax.GradientTransformation, Any, optax.OptState]:
  """Returns ``(tx, params, opt_state)`` for ``mode``, starting from FP32 weights."""
  adamw = base_optimizer(steps)
  if mode == "fp32":
    return adamw, fp32_params, adamw.init(fp32_params)
  if mode == "bf16+mpx":
    tx = mpx.mixed_precision(adamw)
    # Casts the params to bf16 and seeds the float32 masters with the exact
    # FP32 weights (tx.init on bf16 params could only recover rounded ones).
    params, opt_state = mpx.init_from_full_precision(tx, fp32_params, jnp.bfloat16)
    return tx, params, opt_state
  if mode == "fp16+mpx+scale":
    # Loss scaling goes outside mixed_precision. PyTorch's growth_interval of
    # 2000 suits long runs; with 250 this short run sees the scale grow, hit
    # an fp16 overflow (that step is skipped) and back off.
    tx = mpx.loss_scale(mpx.mixed_precision(adamw), growth_interval=250)
    params, opt_state = mpx.init_from_full_precision(tx, fp32_params, jnp.float16)
    return tx, params, opt_state
  if mode == "bf16 no masters":
    params = mpx.cast_tree(fp32_params, jnp.bfloat16)
    return adamw, params, adamw.init(params)
  raise ValueError(f"unknown mode {mode!r}")


# --- Training --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
  """What the table reports about one mode."""

  mode: str
  param_dtype: str
  train_loss: float
  val_loss: float
  val_acc: float
  state_bytes_per_param: float
  skipped_steps: int | None
  loss_scale: float | None
  ms_per_step: float


def train(mode: str, size: Size, data: dict[str, jax.Array], fp32_params: Any) -> Result:
  """Trains ``ByteMLP`` in ``mode`` from ``fp32_params`` and evaluates it."""
  model = ByteMLP(size.width)
  # A fresh copy per mode: the step donates its inputs, which deletes them.
  fp32_params = jax.tree.map(jnp.copy, fp32_params)
  tx, params, opt_state = make_optimizer(mode, fp32_params, size.steps)

  @jax.jit
  def sample(corpus: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    starts = jax.random.randint(key, (size.batch,), 0, corpus.shape[0] - CONTEXT - 1)
    return windows(corpus, starts)

  # Donating params and opt_state lets XLA update them in place.
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, x, y):
    def scaled_loss(p):
      loss = per_window_loss(model, p, x, y)[0].mean()
      # Times the loss scale held in opt_state, or times 1 when it holds none,
      # so this one step serves every mode.
      return mpx.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    # mpx unscales the gradients itself, skips steps with inf/NaN gradients,
    # and returns float32 updates that land each 16-bit param on its master.
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  key = jax.random.key(SEED)  # the same batches in every mode
  losses = []
  for i in range(size.steps):
    if i == 1:  # time from the second step on: the first one compiles
      jax.block_until_ready(losses)
      start = time.perf_counter()
    x, y = sample(data["train"], jax.random.fold_in(key, i))
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(loss)  # kept on device: no host sync per step
  losses = np.asarray(jnp.stack(losses))
  seconds = time.perf_counter() - start if size.steps > 1 else float("nan")

  val_loss, val_acc = evaluate(model, params, data["valid"], size.eval_windows)
  # optax.tree.get finds mpx's state fields by name at any depth (None if absent).
  skipped = optax.tree.get(opt_state, "skipped_steps")
  scale = optax.tree.get(opt_state, "loss_scale")
  n_params = sum(x.size for x in jax.tree.leaves(params))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state))
  return Result(
    mode=mode,
    param_dtype=jax.tree.leaves(params)[0].dtype.name,
    train_loss=float(losses[-max(1, size.steps // 10) :].mean()),
    val_loss=val_loss,
    val_acc=val_acc,
    state_bytes_per_param=state_bytes / n_params,
    skipped_steps=None if skipped is None else int(skipped),
    loss_scale=None if scale is None else float(scale),
    ms_per_step=1e3 * seconds / max(1, size.steps - 1),
  )


def evaluate(model: nn.Module, params: Any, corpus: jax.Array, n: int) -> tuple[float, float]:
  """Mean loss and accuracy over ``n`` evenly spaced validation windows.

  The model is evaluated as trained, in the params' dtype: that is the model a
  mixed-precision run delivers. (``mpx.master_params(opt_state, params)`` gives
  the float32 masters instead.)
  """

  @jax.jit
  def batch_metrics(params, corpus, starts):
    x, y = windows(corpus, starts)
    loss, logits = per_window_loss(model, params, x, y)
    return loss.sum(), (logits.argmax(-1) == y).sum()

  starts = np.linspace(0, corpus.shape[0] - CONTEXT - 2, n).astype(np.int32)
  total_loss, total_correct = 0.0, 0
  for chunk in np.array_split(starts, max(1, n // 4096)):
    loss, correct = batch_metrics(params, corpus, chunk)
    total_loss += float(loss)
    total_correct += int(correct)
  return total_loss / n, total_correct / n


# --- Report ----------------------------------------------------------------------


def relative_gap(result: Result, reference: Result) -> float:
  return (result.val_loss - reference.val_loss) / reference.val_loss


def print_table(results: list[Result], tolerance: float | None) -> None:
  """One row per mode; ``tolerance`` None leaves the check column empty."""
  reference = results[0]
  header = (
    f"{'mode':<16}{'params':>9}{'train loss':>11}{'val loss':>9}{'val acc':>8}"
    f"{'vs fp32':>9}{'state B/param':>14}{'skipped':>8}{'loss scale':>11}"
    f"{'ms/step':>8}  check"
  )
  print(header)
  print("-" * len(header))
  for r in results:
    gap = relative_gap(r, reference)
    check = ""
    if tolerance is not None and r is reference:
      check = "reference"
    elif tolerance is not None and r.mode in CHECKED:
      check = "ok" if gap <= tolerance else "FAIL"
    print(
      f"{r.mode:<16}{r.param_dtype:>9}{r.train_loss:>11.4f}{r.val_loss:>9.4f}"
      f"{r.val_acc:>8.1%}{gap:>+9.3%}{r.state_bytes_per_param:>14.2f}"
      f"{'-' if r.skipped_steps is None else r.skipped_steps:>8}"
      f"{'-' if r.loss_scale is None else f'{r.loss_scale:g}':>11}"
      f"{r.ms_per_step:>8.1f}  {check}"
    )
  print(
    "train loss: mean of the last 10% of steps; vs fp32: relative validation-loss gap; "
    "state B/param: optimizer-state bytes per parameter.\n"
    "ms/step: CPUs have no fast 16-bit matmuls, so 16-bit modes speed up on GPUs and TPUs only."
  )


def parse_args(argv: list[str] | None) -> tuple[Size, float, bool]:
  """Returns ``(size, tolerance, smoke)``; ``MPX_SMOKE=1`` picks the tiny preset."""
  smoke = os.environ.get("MPX_SMOKE", "") not in ("", "0")
  preset = SMOKE_SIZE if smoke else DEFAULT_SIZE
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=preset.steps, help="training steps")
  parser.add_argument("--batch", type=int, default=preset.batch, help="windows per step")
  parser.add_argument("--width", type=int, default=preset.width, help="hidden layer width")
  parser.add_argument(
    "--tolerance",
    type=float,
    default=0.01,
    help="largest relative validation-loss gap of a mixed mode to FP32 (default: 0.01)",
  )
  args = parser.parse_args(argv)
  if min(args.steps, args.batch, args.width) < 1:
    parser.error("--steps, --batch and --width must be >= 1")
  size = dataclasses.replace(preset, steps=args.steps, batch=args.batch, width=args.width)
  return size, args.tolerance, smoke


def main(argv: list[str] | None = None) -> int:
  size, tolerance, smoke = parse_args(argv)
  train_bytes, valid_bytes = load_corpus()
  data = {"train": jnp.asarray(train_bytes), "valid": jnp.asarray(valid_bytes)}
  print(
    f"next-byte prediction on {train_bytes.size:,} train / {valid_bytes.size:,} validation "
    f"bytes of stdlib source; {size.steps} steps x {size.batch} windows, width {size.width}"
  )
  dummy = jnp.zeros((1, CONTEXT), jnp.int32)
  # Jitted init: one compile is quicker than flax's op-by-op initialisation.
  fp32_params = jax.jit(ByteMLP(size.width).init)(jax.random.key(SEED), dummy)["params"]

  results = [train(mode, size, data, fp32_params) for mode in MODES]
  # The smoke size is too small for the comparison to mean anything.
  print_table(results, None if smoke else tolerance)
  if smoke:
    return 0
  failed = [
    r.mode for r in results if r.mode in CHECKED and relative_gap(r, results[0]) > tolerance
  ]
  if failed:
    print(f"FAIL: validation loss of {', '.join(failed)} is over {tolerance:.1%} above FP32's")
    return 1
  print(f"OK: each mixed mode's validation loss is within {tolerance:.1%} of FP32's")
  return 0


if __name__ == "__main__":
  sys.exit(main())
