"""Global-norm clipping with the norm from a first backward pass, so that a
step can update each leaf as its gradient arrives (docs/howto.md, "Clip by
the global norm")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mpx._src import tree as tree_lib


def clipped_grad(
  fun: Callable[..., Any], max_norm: float, *, has_aux: bool = False
) -> Callable[..., Any]:
  """Returns a function computing ``fun``'s gradient clipped to ``max_norm`` by its
  global norm, in two backward passes.

  ``optax.clip_by_global_norm`` must read every gradient before it may scale
  any, so a step that clips holds the whole gradient. Here a first backward
  pass only reduces each gradient into the global norm (it holds a leaf's
  gradient at a time), and a second computes the gradients again and scales
  each as it arrives, so that ``mpx.mixed_precision(..., skip="leaf")`` (or
  plain optax) updates the leaf and frees its gradient. The cost is a second
  forward and backward pass.

  The gradients come back in float32 (each floating one; others as they
  are), clipped as ``optax.clip_by_global_norm(max_norm)`` clips them in
  float32: a step on them equals, bit for bit, the same step with
  ``optax.clip_by_global_norm(max_norm)`` first in the inner rule. The norm
  is a verdict known before any leaf changes: where it is not finite (some
  gradient holds an inf or NaN) every gradient is NaN, so that
  ``skip="leaf"`` skips the whole step, as the default skip does.

  Args:
    fun: the loss, differentiated with respect to its first argument.
    max_norm: the largest global norm the gradients keep.
    has_aux: as in ``jax.grad``: ``fun`` returns ``(loss, aux)``.

  Returns:
    A function of ``fun``'s arguments returning ``(grads, global_norm)``,
    or ``(grads, global_norm, aux)`` with ``has_aux`` (the second pass's
    ``aux``); ``global_norm`` is the float32 norm before clipping.

  Example:
    >>> import jax, jax.numpy as jnp, mpx
    >>> loss = lambda p, x: jnp.sum(p["w"] * x)
    >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
    >>> grads, norm = mpx.clipped_grad(loss, 1.0)(params, jnp.full(4, 2.0, jnp.bfloat16))
    >>> float(norm), grads["w"].dtype, float(grads["w"][0])
    (4.0, dtype('float32'), 0.5)
  """
  grad_fn = jax.grad(fun, has_aux=has_aux)

  def clipped(params: Any, *args: Any, **kwargs: Any) -> Any:
    first = grad_fn(params, *args, **kwargs)
    norm = global_norm(first[0] if has_aux else first)
    # The second pass reads params through a barrier with the norm: XLA:GPU
    # can neither merge the two passes into one (which would hold the whole
    # gradient until the norm is known) nor start the second before the norm.
    # (XLA:CPU drops the barrier and merges them: one pass's time there.)
    params, norm = jax.lax.optimization_barrier((params, norm))
    second = grad_fn(params, *args, **kwargs)
    grads = clip_to_norm(second[0] if has_aux else second, norm, max_norm)
    return (grads, norm, second[1]) if has_aux else (grads, norm)

  return clipped


def global_norm(grads: Any) -> jax.Array:
  """Returns the float32 global norm of the floating leaves of ``grads``, as
  ``optax.clip_by_global_norm`` computes it on them in float32."""
  return optax.tree.norm(tree_lib.cast_tree(grads, jnp.float32))


def clip_to_norm(grads: Any, norm: jax.Array, max_norm: float) -> Any:
  """Returns the floating leaves of ``grads`` in float32, scaled as
  ``optax.clip_by_global_norm(max_norm)`` scales them where their norm is
  ``norm`` (float32); NaN everywhere where ``norm`` is not finite."""
  within = norm < max_norm
  finite = jnp.isfinite(norm)

  def clip(g: jax.Array) -> jax.Array:
    g = g.astype(jnp.float32)
    scaled = jax.lax.select(within, g, (g / norm) * max_norm)
    return jnp.where(finite, scaled, jnp.nan)

  return tree_lib.map_floating(grads, clip)
