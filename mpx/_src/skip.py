"""Skipping a step on device: one ``lax.cond`` over the state.

``lax.cond`` runs only the branch it takes, so an applied step costs the
update alone and its state is written in place (a ``jnp.where`` over the state
would compute both sides and copy), while a skipped step costs nothing but the
finite check. The predicate stays on device: no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def apply_if_finite(
  finite: jax.Array,
  step: Callable[..., tuple[Any, Any]],
  state: Any,
  *args: Any,
) -> tuple[Any, Any, jax.Array]:
  """``step(state, *args)`` where ``finite`` holds, else the state unchanged.

  Args:
    finite: scalar bool array.
    step: ``step(state, *args) -> (new_state, outputs)``; ``new_state`` must
      have the types of ``state`` (the skipped branch returns ``state``), which
      ``step`` checks with :func:`validation.check_state_types_kept` to name
      the leaf of the inner rule's state that changed.
    state: what ``step`` updates; returned as it is on a skipped step.
    *args: further arguments of ``step``.

  Returns:
    ``(new_state, outputs, applied)``: ``step``'s results, or ``state`` and
    zeros like ``outputs`` on a skipped step. ``applied`` equals ``finite`` but
    is an output of the cond: use it after the cond. XLA fuses a computed
    predicate into each consumer, and with one consumer per parameter leaf
    the fusion pass became quadratic in the number of leaves.
  """
  outputs_like = []

  def apply(state, args):
    new_state, outputs = step(state, *args)
    # JAX traces this branch first, so the other one can build its zeros from
    # these shapes instead of tracing the step a second time.
    outputs_like.append(jax.tree.map(_shape_of, outputs))
    return new_state, outputs, jnp.asarray(True)

  def skip(state, args):
    if outputs_like:
      like = outputs_like[-1]
    else:
      like = jax.eval_shape(lambda state, args: step(state, *args)[1], state, args)
    # zeros_like keeps the sharding the shapes record, as cond requires of
    # both branches on explicit meshes.
    return state, jax.tree.map(jnp.zeros_like, like), jnp.asarray(False)

  return jax.lax.cond(finite, apply, skip, state, args)


def _shape_of(x: Any) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct.like(x)`` (shape, dtype, sharding, manual axes),
  spelled out for jax releases that lack it (before 0.10.2)."""
  like = getattr(jax.ShapeDtypeStruct, "like", None)
  if like is not None:
    return like(x)
  aval: Any = jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  if sharding is not None and sharding.mesh.empty:
    sharding = None
  extra = {}
  mat = getattr(aval, "mat", None)
  if mat is not None and not mat.empty:
    extra["manual_axis_type"] = mat
  return jax.ShapeDtypeStruct(
    aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type, **extra
  )
