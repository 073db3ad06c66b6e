"""What mpx's two transformations share: their optimizer states, and the record
``loss_scale`` hands to a ``mixed_precision`` it wraps directly.

Both ``mixed_precision.py`` and ``loss_scale.py`` import this module; neither
imports the other's state from the other's module, so there is no import cycle.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpx._src import tree as tree_lib


class MixedPrecisionState(NamedTuple):
  """State of :func:`mpx.mixed_precision`.

  Attributes:
    master_params: the parameter tree with a ``dtype`` master copy at every
      floating leaf narrower than ``dtype`` and ``optax.MaskedNode()`` at every
      other leaf (those are updated in place, with no copy). The masters are
      the true weights; the low-precision parameters are their rounding.
    inner_state: the wrapped rule's state, built on the master view, so all of
      its floating leaves (Adam's moments, injected hyperparameters) are in
      ``dtype`` or wider.
  """

  master_params: optax.Params
  inner_state: optax.OptState


class LossScaleState(NamedTuple):
  """State of :func:`mpx.loss_scale` and :func:`mpx.static_loss_scale`.

  Attributes:
    loss_scale: float32 scalar; multiply the loss by it before differentiating
      (see :func:`mpx.scale_loss`). It is the scale the next gradients are
      unscaled with.
    growth_tracker: int32 count of consecutive finite steps since the last
      growth or overflow.
    overflow_streak: int32 count of consecutive non-finite steps (drives
      ``hysteresis``).
    skipped_steps: int32 total of steps skipped for non-finite gradients.
    last_step_finite: bool, whether the last step's gradients were finite
      (i.e. whether it was applied).
    inner_state: the wrapped rule's state.
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array
  overflow_streak: jax.Array
  skipped_steps: jax.Array
  last_step_finite: jax.Array
  inner_state: optax.OptState


class LossScaledGradients(NamedTuple):
  """The hand-over from ``loss_scale`` to the ``mixed_precision`` it wraps.

  ``loss_scale`` passes it as the ``loss_scaled=`` keyword of that
  transformation's ``update``, and only when its inner transformation *is* the
  one ``mixed_precision`` returned (checked when ``loss_scale`` is built), so
  the gradients given alongside are exactly the raw, scaled ones. The
  ``mixed_precision`` then unscales them inside its ``lax.cond``, where the
  float32 copy fuses into the update instead of becoming a buffer, and skips
  on ``finite`` instead of checking the gradients a second time. See
  docs/design.md.

  Attributes:
    inverse_scale: float32 scalar, ``1 / loss_scale``: the gradients are
      still multiplied by the loss scale.
    finite: bool scalar, ``loss_scale``'s verdict on the raw gradients
      (agreed across its ``axis_name``): the step is applied only if it holds.
  """

  inverse_scale: jax.Array
  finite: jax.Array

  def unscale(self, grad: Any) -> Any:
    """A floating gradient leaf in float32, divided by the loss scale; any
    other leaf as it is. The one unscaling rule of mpx."""
    return unscale_leaf(grad, self.inverse_scale)


def unscale_leaf(grad: Any, inverse_scale: jax.Array) -> Any:
  """``grad`` in float32 times ``inverse_scale`` if floating, else ``grad``."""
  if not tree_lib.is_floating(grad):
    return grad
  grad = jnp.asarray(grad).astype(jnp.float32)
  # lax, not `*`: jnp's operators trace as a nested jit at every leaf.
  return jax.lax.mul(grad, jax.lax.broadcast_in_dim(inverse_scale, grad.shape, ()))
