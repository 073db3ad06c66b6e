"""``loss_scale``: dynamic (or static) loss scaling with step skipping.

The scale, its growth tracker and the skip counters live in the optimizer
state, so the whole rule is pure, jit-compiled and host-sync free. The
configuration (factors, interval, floor, cap) lives in the transformation, not
in the state: it cannot be lost by ``jit``, ``tree_map`` or a checkpoint.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpx._src import base, skip_step, state_search
from mpx._src import tree as tree_lib
from mpx._src import verdict as verdict_lib
from mpx._src.base import check_transformation

PyTree = Any

DEFAULT_INIT_SCALE = 2.0**15
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24


class LossScaleState(NamedTuple):
  """State of :func:`loss_scale` and :func:`static_loss_scale`.

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


def _number(name: str, value: Any) -> float:
  try:
    return float(value)
  except (TypeError, ValueError) as error:
    raise ValueError(f"{name} must be a number, got {value!r}.") from error


def _positive_finite(name: str, value: Any) -> float:
  value = _number(name, value)
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be finite and > 0, got {value}.")
  if value > float(jnp.finfo(jnp.float32).max):
    raise ValueError(f"{name} must be representable in float32, got {value}.")
  return value


def _positive_int(name: str, value: Any) -> int:
  try:
    as_int = operator.index(value)
  except TypeError as error:
    raise ValueError(f"{name} must be an integer >= 1, got {value!r}.") from error
  if as_int < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {as_int}.")
  if as_int > jnp.iinfo(jnp.int32).max:
    raise ValueError(f"{name} must fit in int32, got {as_int}.")
  return as_int


def _any_nonfinite_across(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Reduces the finite flag over ``axis_name`` so every replica agrees."""
  if axis_name is None:
    return finite
  return jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)


def _inverse(scale: jax.Array) -> jax.Array:
  """``1 / scale`` in float32: unscaling multiplies by it (exact for powers of two)."""
  return (1.0 / scale).astype(jnp.float32)


def _unscale_leaf(grad: Any, inv_scale: jax.Array) -> Any:
  return grad.astype(jnp.float32) * inv_scale if tree_lib.is_floating(grad) else grad


def _unscale_with(grads: PyTree, inv_scale: jax.Array) -> PyTree:
  return jax.tree.map(lambda g: _unscale_leaf(g, inv_scale), grads)


def _unscale(grads: PyTree, scale: jax.Array) -> PyTree:
  """Floating leaves to float32, divided by ``scale``; other leaves untouched."""
  return _unscale_with(grads, _inverse(scale))


def _skips_itself(inner_state: optax.OptState) -> bool:
  """Whether ``inner_state`` holds a transformation that takes over the skip
  decision (see :mod:`mpx._src.verdict`)."""
  # Imported here: mixed_precision imports this module for LossScaleState.
  from mpx._src.mixed_precision import MixedPrecisionState

  return bool(state_search.find_states(inner_state, MixedPrecisionState))


def _update_handing_over(
  inner: optax.GradientTransformationExtraArgs,
  finite: jax.Array,
  inv_scale: jax.Array,
  raw_grads: PyTree,
  inner_state: optax.OptState,
  params: PyTree,
  extra_args: dict[str, Any],
) -> tuple[PyTree, optax.OptState]:
  """Runs ``inner`` with the skip decision handed over to the
  ``mixed_precision`` inside it, then protects what it did not guard.

  Every state leaf the nested transformations neither left untouched nor
  guarded is selected back to its old value on a skipped step, and every
  unguarded update is zeroed: the same result as a ``lax.cond`` around the
  whole update, without returning the updates from inside a cond.
  """
  grads = _unscale_with(raw_grads, inv_scale)
  rebuild = functools.partial(_unscale_leaf, inv_scale=inv_scale)
  verdict = verdict_lib.Verdict(
    finite=finite,
    sources={
      id(g): (g, raw, rebuild)
      for g, raw in zip(jax.tree.leaves(grads), jax.tree.leaves(raw_grads), strict=True)
    },
  )
  with verdict_lib.published(verdict):
    updates, new_inner = inner.update(grads, inner_state, params, **extra_args)
  base.check_state_types_kept("loss_scale", new_inner, inner_state)

  def protect_state(new, old):
    if new is old or verdict.is_guarded_state(new):
      return new
    return jnp.where(finite, new, old)

  def protect_update(update):
    if verdict.is_guarded_update(update):
      return update
    return jnp.where(finite, update, jnp.zeros_like(update))

  # A guarded state is taken whole: its subtree in the old state is passed along.
  new_inner = jax.tree.map(protect_state, new_inner, inner_state, is_leaf=verdict.is_guarded_state)
  return jax.tree.map(protect_update, updates), new_inner


def _scaling_transformation(
  inner: optax.GradientTransformation,
  *,
  init_scale: float,
  growth_factor: float,
  backoff_factor: float,
  growth_interval: int,
  min_scale: float,
  max_scale: float,
  hysteresis: int,
  axis_name: Any,
) -> optax.GradientTransformationExtraArgs:
  """Shared implementation; a static scale is growth_factor = backoff = 1."""
  check_transformation(inner)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: PyTree) -> LossScaleState:
    return LossScaleState(
      loss_scale=jnp.asarray(init_scale, jnp.float32),
      growth_tracker=jnp.zeros((), jnp.int32),
      overflow_streak=jnp.zeros((), jnp.int32),
      skipped_steps=jnp.zeros((), jnp.int32),
      last_step_finite=jnp.asarray(True),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise TypeError(
        f"loss_scale.update got a state of type {type(state).__name__}, not "
        "LossScaleState: pass the state made by this transformation's init."
      )
    if params is not None:
      base.check_grads_match_params("loss_scale", updates, params)
      base.check_state_like(
        "loss_scale", state.inner_state, jax.eval_shape(inner.init, params), "inner_state/"
      )
    scale = state.loss_scale
    # Unscale with the scale this step's loss was multiplied by, not the next.
    inv_scale = _inverse(scale)

    def to_check(grad):
      # Unscaling by a scale >= 1 cannot overflow a gradient of at most 32
      # bits, so the check reads it raw (no float32 copy); a float64 one may
      # overflow float32, and a scale < 1 may overflow anything.
      if min_scale >= 1.0 and tree_lib.is_floating(grad) and tree_lib.float_bits(grad) <= 32:
        return grad
      return _unscale_leaf(grad, inv_scale)

    checked = jax.tree.map(to_check, updates)
    finite = _any_nonfinite_across(tree_lib.all_finite(checked), axis_name)

    if _skips_itself(state.inner_state):
      out_updates, new_inner = _update_handing_over(
        inner, finite, inv_scale, updates, state.inner_state, params, extra_args
      )
    else:

      def step(updates, inner_state, params):
        # Unscaled inside the step, so the float32 copy fuses into the update.
        return inner.update(_unscale_with(updates, inv_scale), inner_state, params, **extra_args)

      out_updates, new_inner = skip_step.unless_finite(
        "loss_scale",
        finite,
        step,
        (updates, state.inner_state, params),
        keep=lambda ops: (ops[1],),
      )

    grown = state.growth_tracker + 1 >= growth_interval
    streak = jnp.where(finite, 0, state.overflow_streak + 1)
    backoff = jnp.logical_not(finite) & (streak >= hysteresis)
    new_scale = jnp.where(
      finite & grown,
      jnp.minimum(scale * growth_factor, max_scale),
      jnp.where(backoff, jnp.maximum(scale * backoff_factor, min_scale), scale),
    ).astype(jnp.float32)
    tracker = jnp.where(finite & jnp.logical_not(grown), state.growth_tracker + 1, 0)
    return out_updates, LossScaleState(
      loss_scale=new_scale,
      growth_tracker=tracker.astype(jnp.int32),
      overflow_streak=streak.astype(jnp.int32),
      skipped_steps=state.skipped_steps + jnp.logical_not(finite).astype(jnp.int32),
      last_step_finite=finite,
      inner_state=new_inner,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def loss_scale(
  inner: optax.GradientTransformation,
  *,
  init_scale: float = DEFAULT_INIT_SCALE,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  min_scale: float = DEFAULT_MIN_SCALE,
  max_scale: float = DEFAULT_MAX_SCALE,
  hysteresis: int = 1,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Dynamic loss scaling with non-finite step skipping around ``inner``.

  Multiply the loss by the current scale before differentiating (use
  :func:`mpx.scale_loss`) and pass the resulting scaled gradients, of any
  float dtype, to ``update``. Each step then follows PyTorch's ``GradScaler``
  rule, with no host sync:

  1. The gradients are unscaled **in float32** with the scale the loss was
     multiplied by (the state's scale, not the one about to be chosen), so
     ``inner`` sees float32 gradients: clipping and norms see true values.
  2. If every unscaled gradient is finite, ``inner`` updates and the growth
     tracker counts the step. After ``growth_interval`` consecutive finite
     steps the scale is multiplied by ``growth_factor``, capped at
     ``max_scale`` (so it never becomes inf), and the tracker restarts.
  3. If any gradient is inf or NaN, the step is skipped: zero updates, the
     inner state stays bitwise unchanged (its counts and schedules do not
     advance), the tracker restarts and ``skipped_steps`` counts the step. Once
     ``hysteresis`` non-finite steps have come in a row (at once, with the
     default 1), the scale becomes ``max(scale * backoff_factor, min_scale)``,
     and so on each further non-finite step of that run.

  With ``axis_name`` (inside ``shard_map`` or ``pmap``), the finite decision
  is reduced over that axis so every replica skips, or applies, together and
  the scales stay identical.

  Defaults: the initial scale is ``2**15``, the largest power of two below the
  fp16 maximum 65504 (``2**16 = 65536`` would overflow as soon as a gradient
  of 1 is scaled, skipping the first steps); ``min_scale`` 1 keeps a run of
  genuine infs from shrinking the scale to nothing (lower it if your fp16
  gradients exceed 65504 even unscaled); ``max_scale`` ``2**24`` as in Apex and
  MXNet.

  Args:
    inner: the rule to feed unscaled float32 gradients, typically
      ``mpx.mixed_precision(optax.adamw(...))``.
    init_scale: the first scale.
    growth_factor: factor (> 1) applied after ``growth_interval`` finite steps.
    backoff_factor: factor in (0, 1) applied on overflow.
    growth_interval: number (>= 1) of consecutive finite steps before growth.
    min_scale: floor of the scale (> 0).
    max_scale: cap of the scale (finite).
    hysteresis: number (>= 1) of consecutive non-finite steps before the
      scale backs off (Megatron's option; every such step is skipped anyway).
    axis_name: optional mapped axis name (or tuple of names) to agree on the
      finite decision across devices.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`; extra keyword arguments are forwarded to
    ``inner``.

  Raises:
    ValueError: for an invalid setting, naming the argument.
    TypeError: if ``inner`` is not a gradient transformation.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(3, jnp.float16)}
    >>> tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(0.1)), init_scale=1024.0)
    >>> state = tx.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"].astype(jnp.float32) ** 2)
    >>> grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p), state))(params)
    >>> grads["w"].tolist()  # 2 * w, scaled by 1024
    [2048.0, 2048.0, 2048.0]
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"].tolist()  # 1 - 0.1 * 2, in fp16
    [0.7998046875, 0.7998046875, 0.7998046875]
  """
  init_scale = _positive_finite("init_scale", init_scale)
  min_scale = _positive_finite("min_scale", min_scale)
  max_scale = _positive_finite("max_scale", max_scale)
  growth_factor = _number("growth_factor", growth_factor)
  if not (math.isfinite(growth_factor) and growth_factor > 1.0):
    raise ValueError(f"growth_factor must be finite and > 1, got {growth_factor}.")
  backoff_factor = _number("backoff_factor", backoff_factor)
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}.")
  growth_interval = _positive_int("growth_interval", growth_interval)
  hysteresis = _positive_int("hysteresis", hysteresis)
  if min_scale > init_scale:
    raise ValueError(f"min_scale ({min_scale}) must be <= init_scale ({init_scale}).")
  if init_scale > max_scale:
    raise ValueError(f"init_scale ({init_scale}) must be <= max_scale ({max_scale}).")
  return _scaling_transformation(
    inner,
    init_scale=init_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
    min_scale=min_scale,
    max_scale=max_scale,
    hysteresis=hysteresis,
    axis_name=axis_name,
  )


def static_loss_scale(
  inner: optax.GradientTransformation,
  scale: float = DEFAULT_INIT_SCALE,
  *,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """A fixed loss scale, still skipping non-finite steps.

  Like :func:`loss_scale` with a scale that never changes: gradients are
  unscaled in float32 and a step with inf or NaN is skipped (and counted in
  ``skipped_steps``). The state is a :class:`LossScaleState`, so
  :func:`mpx.scale_loss` and :func:`mpx.get_loss_scale` work unchanged.

  Args:
    inner: the rule to feed unscaled float32 gradients.
    scale: the loss scale (finite, > 0).
    axis_name: optional mapped axis name to agree on the finite decision.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`LossScaleState`.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.static_loss_scale(optax.sgd(1.0), 128.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> updates, state = tx.update(jnp.array([128.0, jnp.nan]), state)
    >>> updates, int(state.skipped_steps), float(state.loss_scale)
    (Array([0., 0.], dtype=float32), 1, 128.0)
  """
  scale = _positive_finite("scale", scale)
  return _scaling_transformation(
    inner,
    init_scale=scale,
    growth_factor=1.0,
    backoff_factor=1.0,
    growth_interval=1,
    min_scale=scale,
    max_scale=scale,
    hysteresis=1,
    axis_name=axis_name,
  )


def get_loss_scale(opt_state: optax.OptState) -> jax.Array:
  """The current loss scale in ``opt_state`` as a float32 scalar (1.0 if none).

  The :class:`LossScaleState` is found at any depth (chain, ``MultiSteps``,
  ``inject_hyperparams``, ``partition``).

  Raises:
    ValueError: if ``opt_state`` holds several loss-scale states, which one
      scaled loss cannot serve.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = optax.chain(optax.identity(), mpx.loss_scale(optax.sgd(0.1)))
    >>> float(mpx.get_loss_scale(tx.init(jnp.zeros(2))))
    32768.0
    >>> float(mpx.get_loss_scale(optax.sgd(0.1).init(jnp.zeros(2))))
    1.0
  """
  states = state_search.find_states(opt_state, LossScaleState)
  if not states:
    return jnp.ones((), jnp.float32)
  if len(states) > 1:
    raise ValueError(
      f"opt_state holds {len(states)} LossScaleStates; one loss can only be "
      "scaled by one of them. Use a single mpx.loss_scale around the whole "
      "transformation (it covers every parameter group)."
    )
  return jnp.asarray(states[0].loss_scale, jnp.float32)


def scale_loss(loss: jax.typing.ArrayLike, opt_state: optax.OptState) -> jax.Array:
  """``loss`` in float32 times the loss scale of ``opt_state``.

  Differentiate this instead of the loss; pass the gradients to the
  transformation, which unscales them. Casting first keeps a large scale from
  overflowing a 16-bit loss.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> state = mpx.loss_scale(optax.sgd(0.1), init_scale=8.0).init(jnp.zeros(2))
    >>> mpx.scale_loss(jnp.float16(1.5), state)
    Array(12., dtype=float32)
  """
  return jnp.asarray(loss).astype(jnp.float32) * get_loss_scale(opt_state)


def unscale(grads: PyTree, opt_state: optax.OptState) -> PyTree:
  """Divides scaled gradients by the loss scale, in float32.

  For gradients you use yourself (a gradient penalty, logging a gradient
  norm); the transformation unscales the gradients it is given on its own, so
  never pass it unscaled ones.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> state = mpx.loss_scale(optax.sgd(0.1), init_scale=4.0).init(jnp.zeros(2))
    >>> mpx.unscale({"w": jnp.array([8.0, 2.0], jnp.float16)}, state)
    {'w': Array([2. , 0.5], dtype=float32)}
  """
  return _unscale(grads, get_loss_scale(opt_state))
