"""``accumulate``: gradients averaged over micro-batches, each micro-step a
program of its own that only adds (docs/howto.md, "Accumulate gradients over
micro-batches")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import rounding, state_search, validation, verdict
from mpx._src import tree as tree_lib
from mpx._src.states import AccumulationState

ACCUMULATORS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Salts the accumulator's random bits apart from the stochastic masters' own.
_SALT = 0x41CC


def accumulate(
  inner: optax.GradientTransformation,
  every_k_schedule: int | Callable[[jax.Array], jax.typing.ArrayLike],
  *,
  accumulator: str = "float32",
) -> optax.GradientTransformationExtraArgs:
  """Averages gradients over ``every_k_schedule`` micro-batches, then runs
  ``inner`` on their mean once.

  ``optax.MultiSteps(tx, k)`` becomes ``mpx.accumulate(tx, k)``. Its ``update``
  behaves as MultiSteps' (zero updates until the window is full), so any
  trainer can call it on every micro-batch; a loop that knows which
  micro-batch ends the window runs the others through
  :func:`mpx.accumulate_gradients`, a program that only adds (no optimizer
  work: docs/howto.md). The mean reaches a rule holding an mpx state as the
  accumulator holds it (float32, or bfloat16 exactly widened); any other
  rule gets it in the gradients' own dtype, as from MultiSteps. An inf or
  NaN in any micro-batch stays in the window's mean: an mpx ``inner`` skips
  the window and counts one skip, and ``mpx.loss_scale`` backs off (wrap it,
  not the other way round); the next window starts afresh.

  Args:
    inner: the rule to run once per window, e.g. ``mpx.mixed_precision(...)``.
    every_k_schedule: micro-batches per window: an int, or a function of the
      ``gradient_step`` count returning one (as ``optax.MultiSteps`` takes).
    accumulator: ``"float32"`` (4 bytes per param) or ``"bfloat16"`` (2,
      rounded stochastically, so the running mean stays unbiased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`~mpx.AccumulationState`; ``update`` forwards extra arguments.

  Raises:
    ValueError: for a bad ``every_k_schedule`` or ``accumulator``.
    TypeError: if ``inner`` is not a gradient transformation.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.accumulate(mpx.mixed_precision(optax.sgd(1.0)), 2)
    >>> params = {"w": jnp.zeros(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> state = mpx.accumulate_gradients({"w": jnp.ones(2, jnp.bfloat16)}, state)
    >>> updates, state = tx.update({"w": jnp.full(2, 2.0, jnp.bfloat16)}, state, params)
    >>> updates["w"].tolist(), int(state.gradient_step), int(state.mini_step)
    ([-1.5, -1.5], 1, 0)
  """
  validation.check_transformation(inner)
  inner = optax.with_extra_args_support(inner)
  every_k = _check_schedule(every_k_schedule)
  if accumulator not in ACCUMULATORS:
    raise ValueError(
      f"accumulate: accumulator must be one of {', '.join(map(repr, ACCUMULATORS))}, "
      f"got {accumulator!r}."
    )
  accumulator_dtype = ACCUMULATORS[accumulator]

  def init_fn(params: optax.Params) -> AccumulationState:
    zero = jnp.zeros((), jnp.int32)
    return AccumulationState(
      mini_step=zero,
      gradient_step=zero,
      acc_grads=jax.tree.map(lambda p: _zeros(p, accumulator_dtype), params),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _check_state(state, "update")
    acc_grads = _added(updates, state)
    micro_batches = state.mini_step + 1
    emit = micro_batches >= every_k(state.gradient_step)
    # An mpx rule reads the mean where the accumulator holds it (its two
    # passes read it there, no float32 copy beside it); others as MultiSteps.
    mean = acc_grads
    if not verdict.holds_mixed_precision(state.inner_state):
      mean = jax.tree.map(_as_grad, acc_grads, updates, is_leaf=tree_lib.is_masked_node)
    if isinstance(inner, verdict.TakesLossScaledGradients):
      # A mixed_precision given directly folds "not yet" into its skip's one
      # select: a second select of its state around it would copy the moments.
      new_updates, new_inner, _ = inner.update_with_verdict(
        mean, state.inner_state, params, None, step_due=emit, **extra_args
      )
    else:
      new_updates, new_inner = inner.update(mean, state.inner_state, params, **extra_args)
      zeros = jax.tree.map(jnp.zeros_like, new_updates)
      new_updates = tree_lib.select_tree(emit, new_updates, zeros)
      new_inner = tree_lib.select_tree(emit, new_inner, state.inner_state)
    return new_updates, AccumulationState(
      mini_step=jnp.where(emit, 0, micro_batches),
      gradient_step=state.gradient_step + emit.astype(jnp.int32),
      acc_grads=acc_grads,
      inner_state=new_inner,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def accumulate_gradients(grads: optax.Updates, opt_state: optax.OptState) -> optax.OptState:
  """Averages one micro-batch's ``grads`` into the :func:`accumulate` state in ``opt_state``.

  The micro-step of a loop that chooses on the host which micro-batch ends
  the window (it calls ``tx.update`` for that one): it reads the gradients
  and the accumulator and writes the accumulator, with no optimizer work and
  no conditional. Jit it as its own program, ``opt_state`` donated.

  Args:
    grads: the micro-batch's gradients, shaped like the params.
    opt_state: an optimizer state holding exactly one :class:`~mpx.AccumulationState`
      (at any depth, e.g. under ``optax.inject_hyperparams``).

  Returns:
    ``opt_state`` with that state's ``acc_grads`` and ``mini_step`` advanced.

  Raises:
    ValueError: if ``opt_state`` holds no accumulation state, or several.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.accumulate(optax.sgd(0.1), 4, accumulator="bfloat16")
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> state = mpx.accumulate_gradients({"w": jnp.ones(3)}, state)
    >>> int(state.mini_step), state.acc_grads["w"].tolist()
    (1, [1.0, 1.0, 1.0])
  """
  found = state_search.find_states(opt_state, AccumulationState)
  if len(found) != 1:
    raise ValueError(
      f"accumulate_gradients: opt_state holds {len(found)} mpx.accumulate states; "
      "pass a state holding exactly one."
    )
  _check_state(found[0], "accumulate_gradients")

  def added(state: AccumulationState) -> AccumulationState:
    return state._replace(mini_step=state.mini_step + 1, acc_grads=_added(grads, state))

  return state_search.replace_states(opt_state, AccumulationState, added)


def _added(grads: Any, state: AccumulationState) -> Any:
  """The accumulator with one more micro-batch: the window's running mean
  (``m + (g - m) / n`` in float32, as MultiSteps keeps it: the mean stays in
  the gradients' range, where a bfloat16 sum would lose a bit each time it
  doubled), bfloat16 rounded stochastically; a mean that is not finite stays
  so (as NaN in bfloat16), for the inner rule's verdict. The window's
  first micro-batch starts afresh: the accumulator still holds the last
  window's mean, so the step ending a window writes it once."""
  fresh = state.mini_step == 0
  n = (state.mini_step + 1).astype(jnp.float32)
  leaves, treedef = jax.tree.flatten(state.acc_grads)
  treedef = cast(Any, treedef)  # jax's stubs lack flatten_up_to
  added = []
  for index, (acc, grad) in enumerate(zip(leaves, treedef.flatten_up_to(grads), strict=True)):
    grad = jnp.asarray(grad).astype(jnp.float32)
    mean = acc.astype(jnp.float32)
    mean = jnp.where(fresh, grad, mean + (grad - mean) / n)
    if acc.dtype == jnp.bfloat16:
      key = jnp.uint32(rounding.leaf_key(_SALT, index)) ^ (
        state.mini_step.astype(jnp.uint32) * np.uint32(0x9E3779B9)
      )
      bits = rounding.random_bits(key, state.gradient_step, mean.shape)
      # stochastic_round saturates inf; adding mean - mean (0, or NaN where
      # mean is not finite) keeps it for the verdict. A jnp.where choosing
      # between the two made XLA:GPU hold the float32 means beside the step.
      mean = rounding.stochastic_round(mean, bits) + (mean - mean).astype(jnp.bfloat16)
    added.append(mean.astype(acc.dtype))
  return treedef.unflatten(added)


def _as_grad(mean: Any, grad: Any) -> Any:
  """One leaf's mean in its gradient's dtype (as MultiSteps hands it on)."""
  if tree_lib.is_masked_node(mean):  # no accumulator: the gradient as it came
    return grad
  return mean.astype(jnp.asarray(grad).dtype)


def _zeros(param: Any, dtype: Any) -> Any:
  if not tree_lib.is_floating(param):
    return optax.MaskedNode()
  return jnp.zeros(np.shape(param), dtype)


def _check_schedule(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
  if callable(every_k_schedule):
    return every_k_schedule
  if isinstance(every_k_schedule, bool):  # an int to operator.index, never a count
    raise ValueError(
      f"accumulate: every_k_schedule must be an integer >= 1, got {every_k_schedule}."
    )
  k = validation.positive_int("accumulate: every_k_schedule", every_k_schedule)
  return lambda step: k


def _check_state(state: Any, name: str) -> None:
  if not isinstance(state, AccumulationState):
    raise ValueError(f"{name}: expected an mpx.AccumulationState, got {type(state).__name__}.")
