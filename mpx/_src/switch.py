"""``switch_masters``: a run's optimizer state carried over to another ``masters=`` mode."""

from __future__ import annotations

from typing import Any

import jax
import optax

from mpx._src import full_precision, state_search, validation
from mpx._src import tree as tree_lib
from mpx._src.mixed_precision import master_params
from mpx._src.states import MIXED_PRECISION_STATES


def switch_masters(
  tx: optax.GradientTransformation, opt_state: optax.OptState, params: tree_lib.PyTree
) -> optax.OptState:
  """Returns ``opt_state`` as ``tx``, the same rule in another ``masters=`` mode, holds it.

  Every :func:`mixed_precision` state in ``opt_state`` (at any depth: under
  ``loss_scale``, chain, ``MultiSteps``, partitions) becomes ``tx``'s state of
  that mode, with its masters, its inner state (moments, counts) and its
  ``applied_steps`` and ``nonfinite_steps`` carried over; every other leaf
  (a loss scale, a clipping state, ``MultiSteps``' accumulators) is kept as
  it is. The params stay as they are: each is already its master's rounding
  in every mode. Between ``"full"`` and ``"remainder"`` nothing is lost, so
  the run continues bit for bit as if it had never switched; to
  ``"stochastic"`` the masters' low bits are dropped (the params are the
  model from then on), and from it the masters start at the params.

  Args:
    tx: the run's transformation built with the new ``masters=`` (and the same
      everything else, ``moments=`` included).
    opt_state: the run's current state, made by the old transformation.
    params: the current params, the tree ``opt_state`` was made for.

  Returns:
    The state ``tx.update`` takes.

  Raises:
    ValueError: if ``tx``'s state does not match ``opt_state`` outside the
      masters (another rule, another ``moments=``), naming what differs.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> full = mpx.mixed_precision(optax.sgd(1e-3))
    >>> state = full.init(params)
    >>> updates, state = full.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> compact = mpx.mixed_precision(optax.sgd(1e-3), masters="remainder")
    >>> state = mpx.switch_masters(compact, state, params)
    >>> type(state).__name__, int(state.applied_steps)
    ('MixedPrecisionRemainderState', 1)
    >>> round(float(mpx.master_params(state, params)["w"][0]), 6)  # not bf16's 1.0
    0.999
  """
  masters = master_params(opt_state, params)
  with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
  pairs = [
    (param, master, tree_lib.path_str(path))
    for (path, param), master in zip(with_paths, jax.tree.leaves(masters), strict=True)
    if master is not param
  ]
  fresh, _ = full_precision.init_seeded(tx, params, pairs)
  old_states: list[Any] = state_search.find_states(opt_state, MIXED_PRECISION_STATES)
  new_states: list[Any] = state_search.find_states(fresh, MIXED_PRECISION_STATES)
  if len(old_states) != len(new_states):
    raise ValueError(
      f"switch_masters: opt_state holds {len(old_states)} mixed_precision states and "
      f"tx's state {len(new_states)}: build tx as the run's transformation with only "
      "masters= changed."
    )
  _check_same_outside_masters(fresh, opt_state)
  return jax.tree.map(_carried_over, fresh, opt_state, is_leaf=_is_mixed_precision)


def _is_mixed_precision(node: Any) -> bool:
  return isinstance(node, MIXED_PRECISION_STATES)


def _carried_over(new: Any, old: Any) -> Any:
  """Returns ``new``'s stored masters with ``old``'s counters and inner state at a
  mixed_precision state; anything else as ``old`` holds it."""
  if not _is_mixed_precision(new):
    return old
  return new._replace(
    applied_steps=old.applied_steps,
    nonfinite_steps=old.nonfinite_steps,
    inner_state=old.inner_state,
  )


def _check_same_outside_masters(new: Any, old: Any) -> None:
  """Raises a ValueError unless ``old`` has the structure, shapes and dtypes of
  ``new`` everywhere but in the stored masters."""

  def without_masters(state: Any) -> Any:
    return (state.applied_steps, state.nonfinite_steps, state.inner_state)

  def outside_masters(state: Any) -> Any:
    return state_search.replace_states(state, MIXED_PRECISION_STATES, without_masters)

  try:
    validation.check_state_like("switch_masters", outside_masters(old), outside_masters(new))
  except ValueError as error:
    raise ValueError(
      "switch_masters: tx's state differs from opt_state outside the masters (another "
      "rule, or another moments=?). Build tx as the run's transformation with only "
      f"masters= changed. ({error})"
    ) from error
