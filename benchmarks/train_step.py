"""A whole training step of the demo transformer: FP32 vs mpx bf16 vs mpx fp16.

One donated step serves every mode: the gradient of ``mpx.scale_loss(loss *
poison)``, the mode's update, ``apply_updates``. ``poison`` is 1.0 in timed
steps and inf in the one that checks a skipped step reuses the executable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import mpx
from benchmarks.common import Case
from benchmarks.model import ModelSize, init_params, loss_fn, make_batch

MODES = ("fp32 optax", "mpx bf16", "mpx fp16")
BASELINE = MODES[0]


def optimizer() -> optax.GradientTransformation:
  """Returns the AdamW every mode trains with."""
  return optax.adamw(3e-4, weight_decay=1e-2)


def make_step(size: ModelSize, tx: optax.GradientTransformation):
  """Builds ``step((params, opt), inputs, targets, poison)``: grad of the scaled loss, update."""

  def step(state, inputs, targets, poison):
    params, opt = state

    def scaled_loss(p):
      return mpx.scale_loss(loss_fn(size, p, inputs, targets) * poison, opt)

    grads = jax.grad(scaled_loss)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  return step


def build_cases(size: ModelSize) -> tuple[list[Case], int]:
  """Builds the three modes on one FP32 initialisation and one batch."""
  fp32 = init_params(size)
  n = sum(x.size for x in jax.tree.leaves(fp32))
  inputs, targets = make_batch(size)
  one, inf = jnp.ones((), jnp.float32), jnp.full((), jnp.inf, jnp.float32)
  cases = []
  for mode in MODES:
    fresh = jax.tree.map(jnp.copy, fp32)
    if mode == "fp32 optax":
      tx = optimizer()
      state, bad = (fresh, tx.init(fresh)), None
    else:
      dtype = jnp.bfloat16 if mode == "mpx bf16" else jnp.float16
      tx = mpx.mixed_precision(optimizer())
      if dtype == jnp.float16:
        tx = mpx.loss_scale(tx)
      # Jitted: one compile instead of one per op and leaf shape.
      init = jax.jit(lambda p, tx=tx, dtype=dtype: mpx.init_from_full_precision(tx, p, dtype))
      state = init(fresh)
      bad = (inputs, targets, inf)
    cases.append(Case(mode, make_step(size, tx), state, (inputs, targets, one), bad))
  return cases, n


def skipped_steps(case: Case) -> int | None:
  """Reads the skipped-step count from a case's optimizer state (None without one)."""
  value = optax.tree.get(case.state[1], "skipped_steps")
  return None if value is None else int(value)


def opt_state_bytes_per_param(case: Case, n: int) -> float:
  """Counts the optimizer state's bytes per parameter."""
  return sum(x.nbytes for x in jax.tree.leaves(case.state[1])) / n


def describe(size: ModelSize, n: int) -> dict[str, Any]:
  """Describes the model and batch for the report."""
  return {
    "params": n,
    "width": size.width,
    "depth": size.depth,
    "heads": size.heads,
    "seq": size.seq,
    "batch": size.batch,
    "vocab": size.vocab,
  }
