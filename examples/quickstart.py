"""Quickstart: train one small model in FP32, bf16 and fp16 with mpx, and compare.

The task is next-byte prediction on real text that every Python install ships:
the standard library's own source files. A small MLP reads a window of
``CONTEXT`` bytes and predicts the next one. The model is trained from the same
FP32 initialisation, on the same batches, in four modes:

* ``fp32``: plain ``optax.adamw``, the reference.
* ``bf16+mpx``: bf16 params and compute, ``mpx.mixed_precision(optax.adamw(...))``
  (float32 masters and Adam moments in the optimizer state).
* ``fp16+mpx+scale``: fp16 params and compute,
  ``mpx.loss_scale(mpx.mixed_precision(optax.adamw(...)))`` with the gradients
  of ``mpx.scale_loss(loss, opt_state)``.
* ``bf16 no masters``: bf16 params with plain ``optax.adamw``, to show what goes
  wrong without master weights: updates smaller than half a bf16 ulp of a
  weight are rounded away.

Run::

  python examples/quickstart.py                 # default size, about 1-2 min on 2 CPU cores
  MPX_SMOKE=1 python examples/quickstart.py     # tiny size, a few seconds (CI)
  python examples/quickstart.py --steps 3000 --batch 512 --width 512

At the default size the script checks itself: it exits with status 1 if a mixed
mode's validation loss is more than ``--tolerance`` (relative) above FP32's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import sysconfig
import time
from collections.abc import Callable
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


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size; the smoke size only checks that everything runs."""

  steps: int
  batch: int
  width: int
  eval_windows: int


DEFAULT_SIZE = Size(steps=1500, batch=256, width=256, eval_windows=16384)
SMOKE_SIZE = Size(steps=40, batch=32, width=32, eval_windows=1024)


# --- Data ---------------------------------------------------------------------


def load_corpus() -> tuple[np.ndarray, np.ndarray]:
  """Returns (train, validation) byte arrays built from the stdlib's sources.

  Files are read in sorted order and every 8th file goes to validation, so the
  split is deterministic and validation text is never seen in training (random
  windows of one stream would overlap).
  """
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  # _sysconfigdata* is generated per machine; leave it out.
  files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_sysconfigdata"))
  train, valid = [], []
  for i, path in enumerate(files):
    (valid if i % 8 == 0 else train).append(path.read_bytes())
  to_array = lambda chunks: np.frombuffer(b"\n".join(chunks), np.uint8)
  train_bytes, valid_bytes = to_array(train), to_array(valid)
  return np.where(train_bytes < VOCAB, train_bytes, 0), np.where(valid_bytes < VOCAB, valid_bytes, 0)


def windows(corpus: jax.Array, starts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inputs ``corpus[s : s + CONTEXT]`` and targets ``corpus[s + CONTEXT]``."""
  idx = starts[:, None] + jnp.arange(CONTEXT + 1)
  chunk = corpus[idx].astype(jnp.int32)
  return chunk[:, :-1], chunk[:, -1]


# --- Model ---------------------------------------------------------------------


class ByteMLP(nn.Module):
  """Embeds a byte window, then two GELU layers and a linear readout.

  No ``dtype`` is set on the layers, so flax computes in the params' dtype:
  casting the params to bf16 or fp16 runs the whole forward pass in it.
  """

  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.Embed(VOCAB, EMBED)(x).reshape(x.shape[0], CONTEXT * EMBED)
    h = nn.gelu(nn.Dense(self.width)(h))
    h = nn.gelu(nn.Dense(self.width)(h))
    return nn.Dense(VOCAB)(h)


def loss_fn(model: nn.Module, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  # Softmax cross-entropy in float32 whatever the compute dtype: a 16-bit
  # log-sum-exp over 128 logits loses most of the loss's precision.
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --- Training --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mode:
  """One way to train the model.

  Attributes:
    name: label in the table.
    param_dtype: dtype of the params (and hence of the forward/backward pass).
    wrap: builds the optimizer around the shared base rule.
    masters: whether ``wrap`` keeps float32 masters (then the params are made
      with ``mpx.init_from_full_precision``, which seeds the masters with the
      exact FP32 initial weights).
    checked: whether the validation loss must match FP32 within the tolerance.
  """

  name: str
  param_dtype: Any
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation]
  masters: bool
  checked: bool


MODES = (
  Mode("fp32", jnp.float32, lambda tx: tx, masters=False, checked=False),
  Mode("bf16+mpx", jnp.bfloat16, mpx.mixed_precision, masters=True, checked=True),
  Mode(
    "fp16+mpx+scale",
    jnp.float16,
    lambda tx: mpx.loss_scale(mpx.mixed_precision(tx), growth_interval=250),
    masters=True,
    checked=True,
  ),
  Mode("bf16 no masters", jnp.bfloat16, lambda tx: tx, masters=False, checked=False),
)


def base_optimizer(steps: int) -> optax.GradientTransformation:
  """AdamW with warmup and cosine decay; the same rule in every mode."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=3e-3, warmup_steps=max(1, steps // 20), decay_steps=steps
  )
  return optax.adamw(schedule, weight_decay=1e-2)


@dataclasses.dataclass
class Result:
  name: str
  param_dtype: str
  train_loss: float
  val_loss: float
  val_acc: float
  state_bytes_per_param: float
  skipped_steps: int | None
  loss_scale: float | None
  seconds: float
  checked: bool


def tree_bytes(tree: Any) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def train(mode: Mode, size: Size, data: dict[str, Any], init_params: Any) -> Result:
  """Trains ``ByteMLP`` in ``mode`` from ``init_params`` (FP32) and evaluates it."""
  model = ByteMLP(size.width)
  tx = mode.wrap(base_optimizer(size.steps))
  # Fresh copies: the train step donates its inputs, and every mode starts
  # from the same FP32 weights.
  init_params = jax.tree.map(jnp.copy, init_params)
  if mode.masters:
    params, opt_state = mpx.init_from_full_precision(tx, init_params, mode.param_dtype)
  else:
    params = mpx.cast_tree(init_params, mode.param_dtype)
    opt_state = tx.init(params)

  train_corpus = data["train"]
  n_starts = train_corpus.shape[0] - CONTEXT - 1

  @jax.jit
  def sample(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    starts = jax.random.randint(key, (size.batch,), 0, n_starts)
    return windows(train_corpus, starts)

  def step(params, opt_state, x, y):
    # scale_loss multiplies by the loss scale held in opt_state, or by 1 when
    # there is none, so one step function serves every mode.
    def scaled_loss(p):
      loss = loss_fn(model, p, x, y)
      return mpx.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # Donating params and opt_state lets XLA update them in place.
  step = jax.jit(step, donate_argnums=(0, 1))

  key = jax.random.key(SEED)
  losses = []
  start = time.perf_counter()
  for i in range(size.steps):
    x, y = sample(jax.random.fold_in(key, i))
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(loss)  # stays on device: no host sync per step
  losses = np.asarray(jnp.stack(losses))
  seconds = time.perf_counter() - start

  val_loss, val_acc = evaluate(model, params, data["valid"], size.eval_windows)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  skipped = optax.tree.get(opt_state, "skipped_steps")
  scale = optax.tree.get(opt_state, "loss_scale")
  tail = max(1, size.steps // 10)
  return Result(
    name=mode.name,
    param_dtype=jnp.dtype(mode.param_dtype).name,
    train_loss=float(losses[-tail:].mean()),
    val_loss=val_loss,
    val_acc=val_acc,
    state_bytes_per_param=tree_bytes(opt_state) / n_params,
    skipped_steps=None if skipped is None else int(skipped),
    loss_scale=None if scale is None else float(scale),
    seconds=seconds,
    checked=mode.checked,
  )


def evaluate(model: nn.Module, params: Any, corpus: jax.Array, n: int) -> tuple[float, float]:
  """Mean loss and accuracy over ``n`` evenly spaced validation windows.

  The model is evaluated as trained (in the params' dtype): that is the model
  a mixed-precision run delivers.
  """
  starts = jnp.linspace(0, corpus.shape[0] - CONTEXT - 2, n).astype(jnp.int32)

  @jax.jit
  def batch_metrics(starts):
    x, y = windows(corpus, starts)
    logits = model.apply({"params": params}, x).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return loss.sum(), (logits.argmax(-1) == y).sum()

  total_loss, total_correct = 0.0, 0
  for chunk in jnp.array_split(starts, max(1, n // 4096)):
    loss, correct = batch_metrics(chunk)
    total_loss += float(loss)
    total_correct += int(correct)
  return total_loss / n, total_correct / n


# --- Report -----------------------------------------------------------------------


def print_table(results: list[Result], reference: Result) -> None:
  header = (
    f"{'mode':<16} {'params':>8} {'train loss':>10} {'val loss':>9} {'val acc':>8} "
    f"{'vs fp32':>8} {'state B/param':>13} {'skipped':>7} {'loss scale':>10} {'time s':>7}"
  )
  print(header)
  print("-" * len(header))
  for r in results:
    gap = (r.val_loss - reference.val_loss) / reference.val_loss
    skipped = "-" if r.skipped_steps is None else str(r.skipped_steps)
    scale = "-" if r.loss_scale is None else f"{r.loss_scale:g}"
    print(
      f"{r.name:<16} {r.param_dtype:>8} {r.train_loss:>10.4f} {r.val_loss:>9.4f} "
      f"{r.val_acc:>8.2%} {gap:>+8.2%} {r.state_bytes_per_param:>13.2f} {skipped:>7} "
      f"{scale:>10} {r.seconds:>7.1f}"
    )


def parse_args(argv: list[str] | None) -> tuple[Size, float, bool]:
  smoke = os.environ.get("MPX_SMOKE", "") not in ("", "0")
  preset = SMOKE_SIZE if smoke else DEFAULT_SIZE
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=preset.steps, help="training steps")
  parser.add_argument("--batch", type=int, default=preset.batch, help="windows per step")
  parser.add_argument("--width", type=int, default=preset.width, help="hidden layer width")
  parser.add_argument(
    "--tolerance",
    type=float,
    default=0.02,
    help="largest relative validation-loss gap of a mixed mode to FP32 (default size only)",
  )
  args = parser.parse_args(argv)
  size = dataclasses.replace(preset, steps=args.steps, batch=args.batch, width=args.width)
  return size, args.tolerance, smoke


def main(argv: list[str] | None = None) -> int:
  size, tolerance, smoke = parse_args(argv)
  train_bytes, valid_bytes = load_corpus()
  data = {"train": jnp.asarray(train_bytes), "valid": jnp.asarray(valid_bytes)}
  print(
    f"next-byte prediction on {len(train_bytes):,} train / {len(valid_bytes):,} validation "
    f"bytes of stdlib source; {size.steps} steps x {size.batch} windows, width {size.width}"
  )
  x0 = jnp.zeros((1, CONTEXT), jnp.int32)
  init_params = ByteMLP(size.width).init(jax.random.key(SEED), x0)["params"]

  results = []
  for mode in MODES:
    results.append(train(mode, size, data, init_params))
  reference = results[0]
  print_table(results, reference)

  if smoke:
    return 0
  failed = [
    r.name
    for r in results
    if r.checked and (r.val_loss - reference.val_loss) / reference.val_loss > tolerance
  ]
  if failed:
    print(f"FAIL: validation loss of {', '.join(failed)} is over {tolerance:.0%} above FP32's")
    return 1
  print(f"OK: every mixed mode's validation loss is within {tolerance:.0%} of FP32's")
  return 0


if __name__ == "__main__":
  sys.exit(main())
