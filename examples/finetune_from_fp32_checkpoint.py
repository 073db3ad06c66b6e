"""Fine-tune an FP32 orbax checkpoint in bfloat16 (or float16) without losing a bit of it.

The usual life of a mixed-precision fine-tuning run, end to end:

1. *Pretrain* a small MLP in plain FP32 on one regression task and save its
   float32 weights with orbax (``orbax.checkpoint.StandardCheckpointer``).
2. *Restore* them from disk, with an abstract target built by
   ``jax.eval_shape`` (shapes and dtypes only, as a fresh process would).
3. Start low-precision training with ``mpx.init_from_full_precision``: it
   casts the weights to bfloat16 but seeds every float32 master from the
   checkpoint itself, so the masters equal the checkpoint bit for bit
   (checked here). ``tx.init`` on the cast weights could only recover their
   rounded values; the script prints how many weights that would change.
4. *Fine-tune* the bfloat16 model on a related task (same inputs, a changed
   readout), with ``mpx.mixed_precision(optax.adamw(...))``; with
   ``--dtype float16`` also ``mpx.loss_scale`` and ``mpx.scale_loss``.
5. *Export* the full-precision result, ``mpx.master_params(opt_state,
   params)``, with orbax again, read it back and check that it equals the
   masters bit for bit.

Checkpoints go to a temporary directory, removed at the end, unless ``--dir``
names one (it is created if needed and kept; its ``pretrained_fp32`` and
``finetuned_fp32`` subdirectories are overwritten).

Run from the repository root::

  python examples/finetune_from_fp32_checkpoint.py                 # ~10 s on 2 CPU cores
  MPX_SMOKE=1 python examples/finetune_from_fp32_checkpoint.py     # tiny size (CI)
  python examples/finetune_from_fp32_checkpoint.py --dtype float16 --dir /tmp/ckpts

The script ends with self-checks (the restored checkpoint and the initial
masters equal the saved weights bitwise, the fine-tuning loss fell, the
low-precision params are the masters rounded as mpx documents, bfloat16 ties
away from zero, the exported checkpoint equals the masters bitwise) and exits
with status 1 if one fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import mpx

FEATURES = 16  # inputs of the regression
OUTPUTS = 4  # outputs of the regression
SEED = 0
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
PyTree = Any


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size; the smoke size only has to run and pass the checks quickly."""

  pretrain_steps: int
  finetune_steps: int
  batch: int
  width: int


DEFAULT_SIZE = Size(pretrain_steps=600, finetune_steps=600, batch=128, width=128)
SMOKE_SIZE = Size(pretrain_steps=150, finetune_steps=150, batch=64, width=32)


# --- Data: two related tasks ----------------------------------------------------------


def make_task(readout_seed: int) -> Callable[[np.ndarray], np.ndarray]:
  """``x -> sin(x @ a) @ b``: ``a`` is shared by both tasks, ``b`` depends on the task.

  The features ``sin(x @ a)`` the pretrained model has learnt are of use for
  the second task; its readout has to change.
  """
  rng = np.random.default_rng(1234)
  a = rng.normal(size=(FEATURES, 32)) / np.sqrt(FEATURES)
  b = np.random.default_rng(readout_seed).normal(size=(32, OUTPUTS)) / np.sqrt(32)
  return lambda x: (np.sin(x @ a) @ b).astype(np.float32)


def batches(task: Callable, batch: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless fresh ``(x, y)`` batches of ``task``."""
  rng = np.random.default_rng(seed)
  while True:
    x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
    yield x, task(x)


# --- Model: a plain pytree MLP, computing in its weights' dtype ----------------------


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


def apply(params: PyTree, x: jax.Array) -> jax.Array:
  h = x.astype(params["dense0"]["kernel"].dtype)
  for i in range(len(params)):
    layer = params[f"dense{i}"]
    h = h @ layer["kernel"] + layer["bias"]
    if i < len(params) - 1:
      h = jax.nn.gelu(h)
  return h


def mse(params: PyTree, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((apply(params, x).astype(jnp.float32) - y) ** 2)  # the loss in float32


# --- Training --------------------------------------------------------------------


def make_step(tx: optax.GradientTransformation) -> Callable:
  """A jitted training step for ``tx``, with or without a loss scale."""

  @jax.jit
  def step(params: PyTree, opt_state: optax.OptState, x: jax.Array, y: jax.Array):
    def scaled_loss(p: PyTree) -> tuple[jax.Array, jax.Array]:
      loss = mse(p, x, y)
      # Times the loss scale in opt_state, or times 1 if it holds none: this
      # one step serves FP32, bfloat16 and float16.
      return mpx.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def train(
  name: str, step: Callable, params: PyTree, opt_state: optax.OptState, data: Iterator, steps: int
) -> tuple[PyTree, optax.OptState]:
  logged = {0, steps // 4, steps // 2, 3 * steps // 4, steps - 1}
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, *next(data))
    if i in logged:
      print(f"  {name} step {i:>4}  loss {float(loss):.4f}")  # float() waits for the device
  return params, opt_state


def adamw(peak_lr: float, steps: int) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, max(1, steps // 20), steps)
  return optax.adamw(schedule, weight_decay=1e-4)


# --- Checks ----------------------------------------------------------------------


def same_bits(a: PyTree, b: PyTree) -> bool:
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


def rounded_as_mpx_documents(masters: PyTree, dtype: Any) -> PyTree:
  """The params mpx documents for float32 ``masters``, computed here in numpy.

  A bfloat16 param is its master rounded to nearest with ties *away from zero*
  (docs/concepts_masters.md), the top half of ``master_bits + 0x8000``;
  ``astype`` (and ``mpx.cast_tree``) would round ties to even. A float16
  param is its master rounded to nearest even, as ``astype``. Both saturate at
  the dtype's largest finite value.
  """

  def round_leaf(master: jax.Array) -> np.ndarray:
    master = np.asarray(master, np.float32)
    if np.dtype(dtype) == np.dtype(jnp.bfloat16):
      # The largest float32 whose bfloat16 rounding is finite, 0x7f7f7fff.
      limit = np.array(0x7F7F7FFF, np.uint32).view(np.float32)
      bits = np.clip(master, -limit, limit).view(np.uint32)
      return ((bits + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16).view(jnp.bfloat16)
    largest = np.finfo(dtype).max
    return np.clip(master, -largest, largest).astype(dtype)

  return jax.tree.map(round_leaf, masters)


def share_changed(a: PyTree, b: PyTree) -> float:
  """Share of the values of ``a`` that differ from ``b``'s, over the whole tree."""
  changed = sum(
    int(np.sum(np.asarray(x) != np.asarray(y)))
    for x, y in zip(*map(jax.tree.leaves, (a, b)), strict=True)
  )
  return changed / sum(x.size for x in jax.tree.leaves(a))


def report(checks: dict[str, bool]) -> int:
  """Prints each check; returns the exit status (1 if any failed)."""
  for name, ok in checks.items():
    print(f"{'ok  ' if ok else 'FAIL'}  {name}")
  if all(checks.values()):
    print("OK: all checks passed")
    return 0
  print("FAIL: some checks failed")
  return 1


# --- Main ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[Size, Any, pathlib.Path | None]:
  """Returns ``(size, dtype, directory)``; ``MPX_SMOKE=1`` picks the tiny preset."""
  smoke = os.environ.get("MPX_SMOKE", "") not in ("", "0")
  preset = SMOKE_SIZE if smoke else DEFAULT_SIZE
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", type=pathlib.Path, help="checkpoint directory (default: a temp dir)")
  parser.add_argument(
    "--dtype", choices=sorted(DTYPES), default="bfloat16", help="fine-tuning param dtype"
  )
  parser.add_argument("--pretrain-steps", type=int, default=preset.pretrain_steps)
  parser.add_argument("--finetune-steps", type=int, default=preset.finetune_steps)
  parser.add_argument("--batch", type=int, default=preset.batch, help="examples per step")
  parser.add_argument("--width", type=int, default=preset.width, help="hidden layer width")
  args = parser.parse_args(argv)
  if min(args.pretrain_steps, args.finetune_steps, args.batch, args.width) < 1:
    parser.error("--pretrain-steps, --finetune-steps, --batch and --width must be >= 1")
  size = Size(args.pretrain_steps, args.finetune_steps, args.batch, args.width)
  return size, DTYPES[args.dtype], args.dir


def main(argv: list[str] | None = None) -> int:
  size, dtype, directory = parse_args(argv)
  with contextlib.ExitStack() as stack:
    if directory is None:
      directory = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
    return run(size, dtype, directory.resolve())  # orbax wants an absolute path


def run(size: Size, dtype: Any, directory: pathlib.Path) -> int:
  directory.mkdir(parents=True, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  pretrain_task, finetune_task = make_task(readout_seed=1), make_task(readout_seed=2)
  x_val = np.random.default_rng(SEED + 1).normal(size=(2048, FEATURES)).astype(np.float32)
  val_loss = jax.jit(mse)

  # 1. Pretrain in FP32 with plain optax, and save the float32 weights.
  print(f"1. pretrain in FP32 ({size.pretrain_steps} steps, width {size.width})")
  fp32_params = init_params(size.width)
  tx = adamw(1e-2, size.pretrain_steps)
  fp32_params, _ = train(
    "pretrain",
    make_step(tx),
    fp32_params,
    tx.init(fp32_params),
    batches(pretrain_task, size.batch, SEED),
    size.pretrain_steps,
  )
  pretrained_dir = directory / "pretrained_fp32"
  checkpointer.save(pretrained_dir, fp32_params, force=True)
  checkpointer.wait_until_finished()  # orbax writes in the background
  print(f"   saved to {pretrained_dir}")

  # 2. Restore: the target needs only shapes and dtypes, which eval_shape gets
  # from the init code, as a fresh process would (for a large model built with
  # jax.random, without allocating the weights).
  target = jax.eval_shape(lambda: init_params(size.width))
  restored = checkpointer.restore(pretrained_dir, target)
  print(f"2. restored {sum(x.size for x in jax.tree.leaves(restored)):,} float32 weights")

  # 3. Low-precision params, float32 masters seeded from the checkpoint itself.
  name = np.dtype(dtype).name
  tx = mpx.mixed_precision(adamw(3e-3, size.finetune_steps))
  if dtype == jnp.float16:
    tx = mpx.loss_scale(tx)  # float16's narrow range needs a loss scale; bfloat16 does not
  # Jitted: one compile instead of one per eager op on each leaf; the masters
  # come out exact either way.
  params, opt_state = jax.jit(lambda p: mpx.init_from_full_precision(tx, p, dtype))(restored)
  initial_masters = mpx.master_params(opt_state, params)
  rounded = share_changed(mpx.cast_tree(params, jnp.float32), restored)
  print(
    f"3. {name} params: {rounded:.1%} of the weights are not {name} numbers; their masters "
    "keep the exact checkpoint values\n   (tx.init on the cast params would start from the "
    "rounded ones)"
  )

  # 4. Fine-tune the low-precision model on the second task.
  before = float(val_loss(params, x_val, finetune_task(x_val)))
  print(f"4. fine-tune in {name} ({size.finetune_steps} steps); validation loss {before:.4f}")
  params, opt_state = train(
    "finetune",
    make_step(tx),
    params,
    opt_state,
    batches(finetune_task, size.batch, SEED + 2),
    size.finetune_steps,
  )
  after = float(val_loss(params, x_val, finetune_task(x_val)))
  print(f"   validation loss {before:.4f} -> {after:.4f}")
  skipped = optax.tree.get(opt_state, "skipped_steps")  # None without a loss scale
  if skipped is not None:
    print(f"   loss scale {float(mpx.get_loss_scale(opt_state)):.0f}, skipped steps {int(skipped)}")

  # 5. Export the float32 masters, not the rounded low-precision params.
  masters = mpx.master_params(opt_state, params)
  finetuned_dir = directory / "finetuned_fp32"
  checkpointer.save(finetuned_dir, masters, force=True)
  checkpointer.wait_until_finished()
  reread = checkpointer.restore(finetuned_dir, jax.eval_shape(lambda: masters))
  print(f"5. exported the float32 masters to {finetuned_dir} and read them back")

  checks = {
    "restored checkpoint equals the saved FP32 weights bitwise": same_bits(restored, fp32_params),
    "initial masters equal the checkpoint bitwise": same_bits(initial_masters, restored),
    f"params are {name}, masters float32": (
      {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(dtype)}
      and {x.dtype for x in jax.tree.leaves(masters)} == {np.dtype(jnp.float32)}
    ),
    "fine-tuning loss fell by more than half": after < 0.5 * before,
    "params are exactly the rounded masters": same_bits(
      params, rounded_as_mpx_documents(masters, dtype)
    ),
    "exported checkpoint equals the masters bitwise": same_bits(reread, masters),
  }
  if skipped is not None:
    checks["few float16 steps skipped (<= 10%)"] = int(skipped) <= max(2, size.finetune_steps // 10)
  return report(checks)


if __name__ == "__main__":
  sys.exit(main())
