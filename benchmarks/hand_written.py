"""The hand-written mixed-precision steps the mpx steps are measured against.

Each ``build_*(p32, grads)`` returns ``(step, state, grads)`` or, for a step
with more arguments, ``(step, state, args, bad_args)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import mpx
from benchmarks.trees import BF16, F16, F32, PyTree, adam, copy_tree

# The hand-written steps check with mpx's own helper, so that their rows
# separate the cost of mpx's check from the cost of its way of skipping.
_finite = mpx.all_finite


def leafwise_sum_times_zero(tree: PyTree) -> jax.Array:
  """Checks ``x * 0`` is 0 (not NaN) with one sum per leaf, in its dtype.

  The formula of ``mpx.all_finite`` when this benchmark was written.
  """
  sums = [jnp.sum(x * 0).astype(F32) for x in jax.tree.leaves(tree)]
  return jnp.isfinite(sum(sums))


def leafwise_all_isfinite(tree: PyTree) -> jax.Array:
  """Checks ``all(isfinite(x))`` per leaf, as jmp, flax and optax do."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def hand_core(tx: optax.GradientTransformation):
  """Builds the step without safety on float32 masters.

  Casts the gradients to float32, runs ``tx`` on the masters, and updates the
  params by ``round(new_master) - param``.
  """

  def core(params, masters, opt, grads):
    grads = jax.tree.map(lambda g: g.astype(F32), grads)
    updates, opt = tx.update(grads, opt, masters)
    masters = optax.apply_updates(masters, updates)
    deltas = jax.tree.map(
      lambda m, p: m.astype(p.dtype).astype(F32) - p.astype(F32), masters, params
    )
    return optax.apply_updates(params, deltas), masters, opt

  return core


def hand_state(p32, tx, dtype=F16):
  """Builds ``(params in dtype, float32 masters, tx's state)`` from float32 params."""
  return (copy_tree(p32, dtype), copy_tree(p32), tx.init(p32))


def hand_grads(g, dtype):
  """Picks the gradients of ``dtype``: bf16 as they are, fp16 with the loss scale.

  The hand steps do not unscale: they measure the step's memory traffic, not
  its use.
  """
  return g.bf16 if dtype == BF16 else g.f16


def build_hand(p32, g, dtype=F16):
  """Builds the hand-written step without check or scaling."""
  tx = adam()
  core = hand_core(tx)

  def step(state, grads):
    return core(*state, grads)

  return step, hand_state(p32, tx, dtype), hand_grads(g, dtype)


def build_hand_bf16(p32, g):
  """Builds the hand-written step without safety on bf16 params."""
  return build_hand(p32, g, BF16)


def build_hand_check(p32, g):
  """Builds the hand step plus a finite check kept in the state but not acted on."""
  tx = adam()
  core = hand_core(tx)

  def step(state, grads):
    # The verdict is kept in the state (so XLA cannot drop it) but not used.
    return (*core(*state[:3], grads), _finite(grads))

  return step, (*hand_state(p32, tx), jnp.asarray(True)), g.f16


def build_hand_cond_flag(p32, g):
  """Builds the hand step inside ``lax.cond`` on a flag passed in as an argument."""
  tx = adam()
  core = hand_core(tx)

  def step(state, grads, finite):
    return jax.lax.cond(finite, lambda s: core(*s, grads), lambda s: s, state)

  args, bad = (g.f16, jnp.asarray(True)), (g.f16, jnp.asarray(False))
  return step, hand_state(p32, tx), args, bad


def build_hand_cond(p32, g, dtype=F16):
  """Builds the check-then-apply step: the hand step inside ``lax.cond(all_finite)``."""
  tx = adam()
  core = hand_core(tx)

  def step(state, grads):
    return jax.lax.cond(_finite(grads), lambda s: core(*s, grads), lambda s: s, state)

  return step, hand_state(p32, tx, dtype), hand_grads(g, dtype)


def build_hand_cond_bf16(p32, g):
  """Builds the check-then-apply step on bf16 params."""
  return build_hand_cond(p32, g, BF16)


def build_hand_select(p32, g):
  """Builds the hand step followed by ``jnp.where(all_finite, new, old)`` over the state."""
  tx = adam()
  core = hand_core(tx)

  def step(state, grads):
    finite = _finite(grads)
    new = core(*state, grads)
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)

  return step, hand_state(p32, tx), g.f16
