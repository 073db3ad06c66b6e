"""Skipping a whole optimizer step on device when its gradients are not finite.

``lax.cond`` runs only the taken branch, so a finite step costs the update
alone (no select over the whole state, whose extra passes cost several times
the update on a bandwidth-bound machine) and a skipped step costs nothing but
the finite check. The predicate stays on device: no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import base


def unless_finite(
  name: str,
  finite: jax.Array,
  step: Callable[..., tuple[Any, ...]],
  operands: tuple[Any, ...],
  keep: Callable[[tuple[Any, ...]], tuple[Any, ...]],
) -> tuple[Any, ...]:
  """``step(*operands)`` if ``finite``, else zero updates and the kept state.

  Args:
    name: the transformation, for error messages.
    finite: scalar bool array.
    step: returns ``(updates, *new_state)``.
    operands: the arguments of ``step``.
    keep: maps ``operands`` to the unchanged ``new_state`` parts returned on
      a skipped step, matching ``step``'s outputs after the updates.

  Returns:
    ``step``'s outputs, or ``(zeros like its updates, *keep(operands))``.

  Raises:
    TypeError: if ``step`` returns state of other types than it was given
      (the skipped branch could not return the old state then).
  """
  shapes = jax.eval_shape(step, *operands)
  base.check_state_types_kept(name, shapes[-1], keep(operands)[-1])

  def skip(*ops):
    # zeros_like keeps the sharding and varying axes eval_shape recorded, which
    # cond requires of both branches on explicit meshes and under shard_map.
    zeros = jax.tree.map(jnp.zeros_like, shapes[0])
    return (zeros, *keep(ops))

  return jax.lax.cond(finite, step, skip, *operands)
