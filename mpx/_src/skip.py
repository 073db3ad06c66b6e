"""Skipping a step on device: a ``lax.cond`` on CPUs, a select elsewhere."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import compat


def apply_if_finite(
  finite: jax.Array,
  step: Callable[..., tuple[Any, Any]],
  state: Any,
  *args: Any,
) -> tuple[Any, Any, jax.Array]:
  """Runs ``step(state, *args)`` where ``finite`` holds, else keeps ``state``.

  The form is chosen by the platform the step is lowered for
  (``jax.lax.platform_dependent``), not by the process's devices. XLA:CPU
  runs a ``lax.cond`` in place and only the branch it takes, so a skipped
  step costs the finite check alone. XLA:GPU runs a ``conditional`` by
  copying the predicate to the host and waiting for the stream, so on every
  other platform the step always runs and its results are selected with
  ``jnp.where``: no host sync, one program of fused kernels, and the results
  bitwise those of the cond (a select returns the chosen value's bits).
  ``step`` is traced once for both forms.

  Args:
    finite: scalar bool array.
    step: ``step(state, *args) -> (new_state, outputs)``; ``new_state`` must
      have the types of ``state``, which ``step`` checks with
      :func:`validation.check_state_types_kept` to name the leaf of the inner
      rule's state that changed.
    state: what ``step`` updates; returned as it is on a skipped step.
    *args: further arguments of ``step``.

  Returns:
    ``(new_state, outputs, applied)``: ``step``'s results, or ``state`` and
    zeros like ``outputs`` on a skipped step. ``applied`` equals ``finite``;
    on CPUs it is an output of the cond: use it after the cond. XLA fuses a
    computed predicate into each consumer, and with one consumer per
    parameter leaf the fusion pass became quadratic in the number of leaves.
  """
  # One jitted function for both forms: the second call, with the same
  # shapes, hits jit's cache, so the step (the inner rule) is traced once.
  traced = jax.jit(lambda state, args: step(state, *args))
  if gpu_form_on_cpu():
    return _by_select(finite, traced, state, args)
  return jax.lax.platform_dependent(
    finite,
    state,
    args,
    cpu=lambda finite, state, args: _by_cond(finite, traced, state, args),
    default=lambda finite, state, args: _by_select(finite, traced, state, args),
  )


def gpu_form_on_cpu() -> bool:
  """The tests' switch: ``MPX_TEST_GPU_FORM=1`` lowers the forms a GPU
  program has (the select, ``all_finite``'s plain check) for the CPU too,
  so the suites check what GPUs run against what CPUs run."""
  return os.environ.get("MPX_TEST_GPU_FORM", "") not in ("", "0")


def _by_cond(
  finite: jax.Array, step: Callable[..., tuple[Any, Any]], state: Any, args: tuple[Any, ...]
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
  finite: jax.Array, step: Callable[..., tuple[Any, Any]], state: Any, args: tuple[Any, ...]
) -> tuple[Any, Any, jax.Array]:
  new_state, outputs = step(state, args)
  kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
  zeroed = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), outputs)
  return kept, zeroed, finite
