"""``loss_scale``: dynamic (or static) loss scaling with step skipping; the pure
rule that moves the scale is :class:`ScaleRule`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import adapters, state_search, validation, verdict
from mpx._src import tree as tree_lib
from mpx._src.states import MIXED_PRECISION_STATES, LossScaleState

DEFAULT_INIT_SCALE = 2.0**15
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24


@dataclasses.dataclass(frozen=True)
class ScaleRule:
  """The validated settings of a loss scale, and the rule that moves it.

  :meth:`adjust` is PyTorch's ``GradScaler`` rule (with Megatron's
  ``hysteresis``) as a pure function of the state and the step's finite flag,
  tested on its own against an independent reference (as jmp's
  ``DynamicLossScale.adjust``). A static scale is the rule whose factors are 1.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> from mpx._src.loss_scale import ScaleRule
    >>> rule = ScaleRule.dynamic(init_scale=8.0, growth_interval=2)
    >>> state = rule.initial_state(inner_state=())
    >>> for finite in [True, True, False]:
    ...   state = rule.adjust(state, jnp.asarray(finite))
    ...   print(float(state.loss_scale), int(state.growth_tracker))
    8.0 1
    16.0 0
    8.0 0
  """

  init_scale: float
  growth_factor: float
  backoff_factor: float
  growth_interval: int
  min_scale: float
  max_scale: float
  hysteresis: int

  @classmethod
  def dynamic(
    cls,
    *,
    init_scale: float = DEFAULT_INIT_SCALE,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = DEFAULT_MIN_SCALE,
    max_scale: float = DEFAULT_MAX_SCALE,
    hysteresis: int = 1,
  ) -> ScaleRule:
    """Validates the settings of :func:`mpx.loss_scale`, naming a bad one."""
    init_scale = _scale("init_scale", init_scale)
    min_scale = _scale("min_scale", min_scale)
    max_scale = _scale("max_scale", max_scale)
    growth_factor = _number("growth_factor", growth_factor)
    if not (math.isfinite(growth_factor) and growth_factor > 1.0):
      raise ValueError(f"growth_factor must be finite and > 1, got {growth_factor}.")
    backoff_factor = _number("backoff_factor", backoff_factor)
    if not 0.0 < backoff_factor < 1.0:
      raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}.")
    growth_interval = validation.positive_int("growth_interval", growth_interval)
    hysteresis = validation.positive_int("hysteresis", hysteresis)
    if min_scale > init_scale:
      raise ValueError(f"min_scale ({min_scale}) must be <= init_scale ({init_scale}).")
    if init_scale > max_scale:
      raise ValueError(f"init_scale ({init_scale}) must be <= max_scale ({max_scale}).")
    return cls(
      init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis
    )

  @classmethod
  def static(cls, scale: float) -> ScaleRule:
    """Makes a rule whose scale never moves (factors 1, floor and cap at ``scale``)."""
    scale = _scale("scale", scale)
    return cls(scale, 1.0, 1.0, 1, scale, scale, 1)

  def check_state(self, state: LossScaleState) -> None:
    """Raises a ValueError if a concrete ``state`` could not come from this
    rule (a scale outside ``[min_scale, max_scale]``, a growth tracker past
    the interval, a negative counter): a state restored into the wrong
    settings, or edited by hand. Traced states (under ``jit``) are not seen.
    ``validation.check_loss_scale_inputs`` calls it for every step."""
    fields = (state.loss_scale, state.growth_tracker, state.overflow_streak, state.skipped_steps)
    if any(isinstance(x, jax.core.Tracer) for x in fields):
      return
    scale, tracker = float(state.loss_scale), int(state.growth_tracker)
    problems = []
    if not self.min_scale <= scale <= self.max_scale:
      problems.append(
        f"loss_scale {scale} is outside [min_scale, max_scale] = "
        f"[{self.min_scale}, {self.max_scale}]"
      )
    if not 0 <= tracker < self.growth_interval:
      problems.append(
        f"growth_tracker {tracker} is outside [0, growth_interval) = [0, {self.growth_interval})"
      )
    if int(state.overflow_streak) < 0 or int(state.skipped_steps) < 0:
      problems.append("a counter is negative")
    if problems:
      raise ValueError(
        "loss_scale: the state does not fit this transformation's settings: "
        + "; ".join(problems)
        + ". Was it made by another loss_scale, or restored into different settings?"
      )

  def initial_state(self, inner_state: optax.OptState) -> LossScaleState:
    return LossScaleState(
      loss_scale=jnp.asarray(self.init_scale, jnp.float32),
      growth_tracker=jnp.zeros((), jnp.int32),
      overflow_streak=jnp.zeros((), jnp.int32),
      skipped_steps=jnp.zeros((), jnp.int32),
      last_step_finite=jnp.asarray(True),
      inner_state=inner_state,
    )

  def adjust(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
    """Returns the counters and scale after a step whose gradients were ``finite``.

    A finite step counts towards growth; the ``growth_interval``-th in a row
    multiplies the scale by ``growth_factor`` (capped at ``max_scale``) and
    restarts the count. A non-finite step restarts the count and, once
    ``hysteresis`` of them have come in a row, multiplies the scale by
    ``backoff_factor`` (floored at ``min_scale``). ``inner_state`` is kept.
    """
    scale = state.loss_scale
    grown = state.growth_tracker + 1 >= self.growth_interval
    streak = jnp.where(finite, 0, state.overflow_streak + 1)
    backoff = jnp.logical_not(finite) & (streak >= self.hysteresis)
    new_scale = jnp.where(
      finite & grown,
      jnp.minimum(scale * self.growth_factor, self.max_scale),
      jnp.where(backoff, jnp.maximum(scale * self.backoff_factor, self.min_scale), scale),
    )
    tracker = jnp.where(finite & jnp.logical_not(grown), state.growth_tracker + 1, 0)
    return state._replace(
      loss_scale=new_scale.astype(jnp.float32),
      growth_tracker=tracker.astype(jnp.int32),
      overflow_streak=streak.astype(jnp.int32),
      skipped_steps=state.skipped_steps + jnp.logical_not(finite).astype(jnp.int32),
      last_step_finite=finite,
    )


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


# A scale's reciprocal must be a normal float32 (XLA flushes subnormals to zero,
# so unscaling by 1/2**127 would zero every gradient), and so must the scale.
_SCALE_RANGE = (2.0**-126, 2.0**126)


def _scale(name: str, value: Any) -> float:
  value = _positive_finite(name, value)
  low, high = _SCALE_RANGE
  if not low <= value <= high:
    raise ValueError(
      f"{name} must be in [2**-126, 2**126], got {value}: beyond it the scale or its "
      "reciprocal is below float32's normal range, which XLA flushes to zero "
      "(unscaled gradients would all become 0, or every step would be skipped)."
    )
  return value


def _loss_scaling(
  inner: optax.GradientTransformation, rule: ScaleRule, axis_name: Any
) -> optax.GradientTransformationExtraArgs:
  """Builds the transformation behind :func:`loss_scale` and :func:`static_loss_scale`."""
  validation.check_transformation(inner)
  inner = optax.with_extra_args_support(inner)
  # Decided once, here: only a transformation given directly as `inner` that
  # takes the raw scaled gradients (mixed_precision) computes the verdict itself.
  hands_over = isinstance(inner, verdict.TakesLossScaledGradients)

  def init_fn(params: optax.Params) -> LossScaleState:
    adapters.refuse_fp8_metadata("loss_scale", params)
    inner_state = tree_lib.strong_types(inner.init(params))
    validation.refuse_rules_chained_after("loss_scale", inner_state)
    return rule.initial_state(inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    # A mixed_precision handed the gradients checks them itself, leaf by leaf.
    per_example = validation.check_loss_scale_inputs(
      updates, state, params, rule, axis_name, None if hands_over else inner.init
    )
    # The scale this step's loss was multiplied by, not the one about to be chosen.
    inverse_scale = (1.0 / state.loss_scale).astype(jnp.float32)
    unscaling = verdict.Unscaling(inverse_scale, rule.min_scale >= 1.0, axis_name)
    # L-BFGS's value= and grad= come from the scaled loss, like the gradients:
    # unscaled here, so its line search compares them with value_fn's loss.
    unscaled_extra = {
      name: _unscale_all(value, unscaling) if name in adapters.EXTRA_ARGS_FROM_THE_LOSS else value
      for name, value in extra_args.items()
    }
    if hands_over:
      # The mixed_precision decides the verdict, on the gradients as its rule
      # receives them, and returns it: it moves the scale.
      new_updates, new_inner, finite = inner.update_with_verdict(
        updates, state.inner_state, params, unscaling, **unscaled_extra
      )
    else:
      new_updates, new_inner, finite = _general_step(
        inner, state.inner_state, updates, params, unscaling, unscaled_extra, per_example
      )
    return new_updates, rule.adjust(state, finite)._replace(inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _general_step(
  inner: optax.GradientTransformationExtraArgs,
  inner_state: Any,
  grads: Any,
  params: Any,
  unscaling: verdict.Unscaling,
  extra_args: dict[str, Any],
  per_example: bool,
) -> tuple[Any, Any, jax.Array]:
  """Runs ``loss_scale`` around anything but a ``mixed_precision`` given directly:
  ``(updates, inner_state, finite)``. The verdict is taken on the gradients
  before ``inner`` runs, inside one ``lax.cond``; a ``mixed_precision`` deeper
  inside may still skip (a rule in front of it made an inf), and then the
  whole inner state is rolled back, so nothing around it advances either."""
  flat = jax.tree.leaves(grads)
  finite = verdict.gradients_finite(flat, [None] * len(flat), unscaling)
  rolls_back = verdict.holds_mixed_precision(inner_state)

  def step(inner_state, grads, params, unscaling, extra_args):
    # Unscaled inside the cond, so the float32 copy fuses into the update.
    grads = _unscale_all(grads, unscaling)
    updates, new_inner = inner.update(grads, inner_state, params, **extra_args)
    # Per-example gradients: the inner rule must have reduced the leading axes.
    reduced_like = params if per_example else None
    validation.check_inner_results("loss_scale", updates, new_inner, inner_state, reduced_like)
    if not rolls_back:
      return new_inner, (updates, jnp.asarray(True))
    applied = verdict.agreed(verdict.no_skip_counted(inner_state, new_inner), unscaling.axis_name)
    new_inner = _roll_back_unless(applied, new_inner, inner_state, unscaling.axis_name)
    return new_inner, (updates, applied)

  new_inner, (updates, inner_applied), _ = verdict.run_if_finite(
    finite, step, inner_state, grads, params, unscaling, extra_args
  )
  if rolls_back:  # zeroed after the cond, where the select fuses into the apply
    updates = jax.tree.map(lambda u: _select_leaf(inner_applied, u, jnp.zeros_like(u)), updates)
  return updates, new_inner, jnp.logical_and(finite, inner_applied)


def _roll_back_unless(applied: jax.Array, new_inner: Any, old_inner: Any, axis_name: Any) -> Any:
  """Returns ``new_inner`` where ``applied``, else ``old_inner``, selected leaf by
  leaf. A ``mixed_precision`` state that skipped on its own is already its old
  self (its skip counted), so on one device its leaves are kept as they are
  and only the rest is selected: no copy of the masters and their moments.
  With ``axis_name`` another replica's ``mixed_precision`` may have applied
  what this one skipped, so every leaf is selected."""
  if axis_name is not None:
    return jax.tree.map(lambda new, old: _select_leaf(applied, new, old), new_inner, old_inner)

  def leaf(new: Any, old: Any) -> Any:
    if isinstance(new, MIXED_PRECISION_STATES):
      return new
    return jax.tree.map(lambda n, o: _select_leaf(applied, n, o), new, old)

  is_mp = lambda x: isinstance(x, MIXED_PRECISION_STATES)  # noqa: E731
  return jax.tree.map(leaf, new_inner, old_inner, is_leaf=is_mp)


def _select_leaf(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Returns ``on_true`` where the scalar ``pred`` holds, else ``on_false``."""
  if not isinstance(on_true, jax.Array | np.ndarray) or not jnp.issubdtype(
    on_true.dtype, jnp.number
  ):
    return jnp.where(pred, on_true, on_false)  # PRNG keys, booleans
  return jax.lax.select(jnp.broadcast_to(pred, on_true.shape), on_true, on_false)


def _unscale_all(tree: Any, unscaling: verdict.Unscaling) -> Any:
  """Unscales the floating leaves of ``tree`` (in the wider of their dtype
  and float32); the others as they are."""
  return jax.tree.map(lambda leaf: verdict.received(leaf, None, unscaling), tree)


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
  """Wraps ``inner`` in dynamic loss scaling that skips non-finite steps.

  Multiply the loss by the scale (:func:`mpx.scale_loss`) and pass the scaled
  gradients to ``update``. They are unscaled in the wider of their dtype and
  float32; the step is applied only if every gradient is finite as ``inner``
  receives it (agreed across ``axis_name``), else the updates are zero and the
  inner state is unchanged. The scale grows by ``growth_factor`` after
  ``growth_interval`` applied steps in a row and backs off by
  ``backoff_factor`` after ``hysteresis`` skipped ones, as PyTorch's
  ``GradScaler`` does, with no host sync. Put it outside ``optax.MultiSteps``;
  the step and its corner cases: docs/design.md, docs/guarantees.md.

  Args:
    inner: the rule to feed the unscaled gradients, typically
      ``mpx.mixed_precision(optax.adamw(...))``.
    init_scale: the first scale.
    growth_factor: factor (> 1) applied after ``growth_interval`` finite steps.
    backoff_factor: factor in (0, 1) applied on overflow.
    growth_interval: number (>= 1) of consecutive finite steps before growth.
    min_scale: floor of the scale, at least ``2**-126``.
    max_scale: cap of the scale, at most ``2**126``.
    hysteresis: number (>= 1) of non-finite steps in a row before a backoff.
    axis_name: mapped axis name(s) to agree on the verdict across devices.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`; extra keyword arguments (``optax.lbfgs``'s
    ``value`` and ``grad`` unscaled) are forwarded to ``inner``.

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
  rule = ScaleRule.dynamic(
    init_scale=init_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
    min_scale=min_scale,
    max_scale=max_scale,
    hysteresis=hysteresis,
  )
  return _loss_scaling(inner, rule, axis_name)


def static_loss_scale(
  inner: optax.GradientTransformation,
  scale: float = DEFAULT_INIT_SCALE,
  *,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` in a fixed loss scale, still skipping non-finite steps.

  Like :func:`loss_scale` with a scale that never changes: gradients are
  unscaled in the wider of their dtype and float32 (float64 ones stay float64)
  and a step with inf or NaN is skipped (and counted in ``skipped_steps``).
  The state is a :class:`LossScaleState`, so :func:`mpx.scale_loss` and
  :func:`mpx.get_loss_scale` work unchanged.

  Args:
    inner: the rule to feed unscaled float32 gradients.
    scale: the loss scale, in ``[2**-126, 2**126]``.
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
  return _loss_scaling(inner, ScaleRule.static(scale), axis_name)


def get_loss_scale(opt_state: optax.OptState) -> jax.Array:
  """Returns the current loss scale in ``opt_state`` as a float32 scalar (1.0 if none).

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


def unscale(grads: tree_lib.PyTree, opt_state: optax.OptState) -> tree_lib.PyTree:
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
  return _unscale_all(
    grads, verdict.Unscaling((1.0 / get_loss_scale(opt_state)).astype(jnp.float32), True)
  )
