"""``switch_masters``: a run's optimizer state carried over to another ``masters=`` mode."""

from __future__ import annotations

from typing import Any

import jax
import optax

from mpx._src import full_precision, moments, state_search, validation
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
  ``new`` everywhere but in the stored masters, naming the first place they differ."""

  def without_masters(state: Any) -> Any:
    fields = ("applied_steps", "nonfinite_steps", "inner_state")
    return {field: getattr(state, field) for field in fields}

  def outside_masters(state: Any) -> Any:
    return state_search.replace_states(state, MIXED_PRECISION_STATES, without_masters)

  old_leaves, new_leaves = _stored_forms(outside_masters(old)), _stored_forms(outside_masters(new))
  for path in sorted(old_leaves.keys() | new_leaves.keys()):
    old_form, new_form = old_leaves.get(path, "nothing"), new_leaves.get(path, "nothing")
    if old_form != new_form:
      moments_differ = any(_is_moment_form(f) for f in (old_form, new_form))
      fix = (
        "build tx with the run's moments= (and moment_fields=)"
        if moments_differ
        else "build tx from the run's own rule"
      )
      raise ValueError(
        f"switch_masters: tx's state differs from opt_state outside the masters: at "
        f"{path}, opt_state holds {old_form} and tx's state {new_form}. To switch, "
        f"{fix}, with only masters= changed."
      )


def _stored_forms(tree: Any) -> dict[str, str]:
  """Returns, by path, how ``tree`` stores each leaf: a compressed moment by its
  type's name (one node), an array as ``float32[2, 3]``."""
  is_leaf = lambda x: moments.is_compressed(x) or tree_lib.is_placeholder(x)  # noqa: E731
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {
    tree_lib.path_text(path): type(leaf).__name__
    if moments.is_compressed(leaf) or tree_lib.is_placeholder(leaf)
    else validation.describe(leaf)
    for path, leaf in flat
  }


def _is_moment_form(form: str) -> bool:
  return form.endswith("Moment")
