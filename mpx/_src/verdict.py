"""A step's verdict: every gradient finite as the inner rule will receive it.

One rule for both transformations; who computes it: docs/design.md, "One
verdict, and who computes it".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import state_search
from mpx._src import tree as tree_lib
from mpx._src.finite import all_finite
from mpx._src.states import MIXED_PRECISION_STATES


@dataclasses.dataclass(frozen=True)
class Unscaling:
  """What ``loss_scale`` hands the transformation it wraps directly, with the
  raw (still scaled) gradients: how to unscale them, and across which axis to
  agree on the verdict.

  Attributes:
    inverse_scale: float32 scalar, ``1 / loss_scale``.
    scale_at_least_one: whether the scale can never fall below 1 (then
      unscaling only shrinks values and cannot overflow).
    axis_name: the mapped axis (or axes) to reduce the verdict over, or None.
  """

  inverse_scale: jax.Array
  scale_at_least_one: bool
  axis_name: Any = None


# A pytree whose one array is the inverse scale, so that a jitted step takes
# it as an argument (skip.run_if_finite).
jax.tree_util.register_dataclass(
  Unscaling, data_fields=["inverse_scale"], meta_fields=["scale_at_least_one", "axis_name"]
)


class TakesLossScaledGradients(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` that also takes the raw
  loss-scaled gradients: ``update_with_verdict(grads, state, params,
  unscaling, **extra_args)`` unscales them with an :class:`Unscaling`,
  decides the step's verdict itself and returns it, ``(updates, state,
  finite)``. ``update`` is the same step with no loss scale.
  :func:`mpx.mixed_precision` returns one; :func:`mpx.loss_scale` hands over
  to its inner transformation only if it is one (decided when it is built, so
  nothing can sit between the two)."""

  # No __slots__: an instance carries update_with_verdict beside optax's fields.
  update_with_verdict: Callable[..., tuple[Any, Any, jax.Array]]

  def __new__(
    cls, init: optax.TransformInitFn, update_with_verdict: Callable[..., tuple[Any, Any, jax.Array]]
  ) -> TakesLossScaledGradients:
    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
      new_updates, new_state, _ = update_with_verdict(updates, state, params, None, **extra_args)
      return new_updates, new_state

    transformation = super().__new__(cls, init, update)
    transformation.update_with_verdict = update_with_verdict
    return transformation

  def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle rebuild by __new__
    return (self.init, self.update_with_verdict)


def received(grad: Any, dtype: Any, unscaling: Unscaling | None) -> Any:
  """Returns a gradient leaf as the inner rule receives it: unscaled (in the wider of
  its dtype and float32) under a loss scale, then cast to ``dtype`` (None:
  kept). Non-floating leaves pass as they are."""
  if not tree_lib.is_floating(grad):
    return grad
  grad = jnp.asarray(grad)
  if unscaling is not None:
    wide = grad.astype(jnp.promote_types(grad.dtype, jnp.float32))
    inverse = jax.lax.convert_element_type(unscaling.inverse_scale, wide.dtype)
    # lax, not `*`: jnp's operators trace as a nested jit at every leaf.
    grad = jax.lax.mul(wide, jax.lax.broadcast_in_dim(inverse, wide.shape, ()))
  return grad if dtype is None else grad.astype(dtype)


def _can_overflow(grad: Any, dtype: Any, unscaling: Unscaling | None) -> bool:
  """Returns whether ``received`` can make a finite ``grad`` non-finite."""
  if unscaling is not None and not unscaling.scale_at_least_one:
    return True  # dividing by a scale below 1 grows values
  return dtype is not None and jnp.finfo(dtype).max < jnp.finfo(tree_lib.leaf_dtype(grad)).max


def gradients_finite(grads: list[Any], dtypes: list[Any], unscaling: Unscaling | None) -> jax.Array:
  """Returns the verdict: whether every gradient is finite as ``received`` makes it
  with its ``dtypes`` entry, agreed across ``unscaling.axis_name``. Reads the
  raw gradient wherever receiving it cannot overflow."""
  # As jax holds them: a host float64 gradient without x64 is float32 (1e300
  # is inf) when the rule receives it, and is judged so.
  floating = [
    (jnp.asarray(g), d) for g, d in zip(grads, dtypes, strict=True) if tree_lib.is_floating(g)
  ]
  to_check = [
    received(g, dtype, unscaling) if _can_overflow(g, dtype, unscaling) else g
    for g, dtype in floating
  ]
  return agreed(all_finite(to_check), None if unscaling is None else unscaling.axis_name)


def agreed(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Returns ``finite`` AND-ed over ``axis_name`` (if any), so every replica agrees."""
  if axis_name is None:
    return finite
  return jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)


def holds_mixed_precision(inner_state: Any) -> bool:
  """Returns whether ``inner_state`` holds a ``mixed_precision`` state, which records
  its own skips (at trace time: a question about the structure)."""
  return bool(state_search.find_states(inner_state, MIXED_PRECISION_STATES))


def no_skip_counted(old_inner: Any, new_inner: Any) -> jax.Array:
  """Returns whether no ``mixed_precision`` state in ``new_inner`` counted a skip
  since ``old_inner``: the verdicts they computed, as one flag. Comparing
  counts, not a last-step flag, reads a step that never reached them (a
  ``MultiSteps`` accumulation step) as applied."""
  old: list[Any] = state_search.find_states(old_inner, MIXED_PRECISION_STATES)
  new: list[Any] = state_search.find_states(new_inner, MIXED_PRECISION_STATES)
  same = [jnp.equal(a.nonfinite_steps, b.nonfinite_steps) for a, b in zip(old, new, strict=True)]
  return jnp.asarray(np.bool_(True)) if not same else jnp.stack(same).all()
