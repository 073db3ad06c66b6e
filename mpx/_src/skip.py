"""Skipping a step on device: a ``lax.cond`` on CPUs, a select elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import compat, lowering


def run_if_finite(
  finite: jax.Array,
  step: Callable[..., tuple[Any, Any]],
  state: Any,
  *args: Any,
) -> tuple[Any, Any, jax.Array]:
  """Runs ``step(state, *args)`` where ``finite`` holds, else keeps ``state``.

  A ``lax.cond`` where the step is lowered for XLA:CPU (it runs only the
  branch taken), a select elsewhere (XLA:GPU would sync with the host for a
  conditional); both give the same bits. docs/design.md, "Two platforms, one
  step".

  Args:
    finite: scalar bool array.
    step: ``step(state, *args) -> (new_state, outputs)``, keeping the types
      of ``state``.
    state: what ``step`` updates; returned as it is on a skipped step.
    *args: further arguments of ``step`` (pytrees): their arrays are
      passed to the jitted step as arguments, never as constants.

  Returns:
    ``(new_state, outputs, applied)``: ``step``'s results, or ``state`` and
    zero ``outputs`` on a skipped step. ``applied`` equals ``finite``; on
    CPUs it is an output of the cond, so its uses after the cond do not each
    fuse a copy of the predicate (quadratic in the leaves).
  """
  traced, arrays = _jitted_on_arrays(step, args)
  return lowering.by_platform(
    finite,
    state,
    arrays,
    cpu=lambda finite, state, arrays: _by_cond(finite, traced, state, arrays),
    accelerator=lambda finite, state, arrays: _by_select(finite, traced, state, arrays),
  )


def _jitted_on_arrays(
  step: Callable[..., tuple[Any, Any]], args: tuple[Any, ...]
) -> tuple[Callable[[Any, list[Any]], tuple[Any, Any]], list[Any]]:
  """Returns ``(traced, arrays)``: ``step`` jitted with every array leaf of ``args``
  as an argument (``traced(state, arrays)``), the other leaves closed over.

  Called eagerly, a closed-over array would be a constant of the step, and
  XLA folds constants in ways it never folds arguments (``c + (t - c)`` to
  ``t``, in float32): an eager step would then compute other bits than the
  same step under ``jit``. One jitted function serves both forms of the
  skip, so the step (the inner rule) is traced once.
  """
  flat, treedef_ = jax.tree.flatten(args)
  treedef: Any = treedef_  # typed for its methods
  is_array = [isinstance(x, jax.Array | np.ndarray | np.generic) for x in flat]

  def on_arrays(state: Any, arrays: list[Any]) -> tuple[Any, Any]:
    given = iter(arrays)
    leaves = [next(given) if array else x for x, array in zip(flat, is_array, strict=True)]
    return step(state, *treedef.unflatten(leaves))

  return jax.jit(on_arrays), [x for x, array in zip(flat, is_array, strict=True) if array]


def _by_cond(
  finite: jax.Array, step: Callable[..., tuple[Any, Any]], state: Any, args: Any
) -> tuple[Any, Any, jax.Array]:
  outputs_like = []

  def apply(state, args):
    new_state, outputs = step(state, args)
    # JAX traces this branch first, so the other one can build its zeros from
    # these shapes instead of tracing the step a second time.
    outputs_like.append(jax.tree.map(compat.shape_dtype_struct_like, outputs))
    return new_state, outputs, jnp.asarray(True)

  def skip(state, args):
    if outputs_like:
      like = outputs_like[-1]
    else:
      like = jax.eval_shape(lambda state, args: step(state, args)[1], state, args)
    # zeros_like keeps the sharding the shapes record, as cond requires of
    # both branches on explicit meshes.
    return state, jax.tree.map(jnp.zeros_like, like), jnp.asarray(False)

  return jax.lax.cond(finite, apply, skip, state, args)


def _by_select(
  finite: jax.Array, step: Callable[..., tuple[Any, Any]], state: Any, args: Any
) -> tuple[Any, Any, jax.Array]:
  new_state, outputs = step(state, args)
  kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
  zeroed = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), outputs)
  return kept, zeroed, finite
