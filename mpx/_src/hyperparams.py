"""``adjust``: set injected hyperparameters anywhere in a nested state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from mpx._src import state_search

_INJECTED_STATES = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def _scheduled_names(state: Any) -> set[str]:
  return set(getattr(state, "hyperparams_states", None) or ())


def adjust(opt_state: optax.OptState, **hyperparams: Any) -> optax.OptState:
  """Sets hyperparameters injected with ``optax.inject_hyperparams``.

  Every ``inject_hyperparams`` state in ``opt_state`` (at any depth: inside
  :func:`mpx.mixed_precision`, :func:`mpx.loss_scale`, chains, ``MultiSteps``,
  partitions) that has a hyperparameter of the given name gets the new value,
  converted to the dtype, shape and sharding of the value it replaces. A
  jitted step therefore sees the same state (abstract values and shardings)
  and never recompiles, whether you pass a Python float or an array.

  Args:
    opt_state: the optimizer state.
    **hyperparams: new values, e.g. ``learning_rate=1e-4``. A value may be
      traced, so ``adjust`` works inside ``jit``.

  Returns:
    A new state; ``opt_state`` itself is not modified.

  Raises:
    ValueError: if a name exists in no injected state (the message lists the
      names that do), if it names a hyperparameter driven by a schedule (which
      would overwrite it), if a value's shape does not fit, or if the state has
      no injected hyperparameters at all (the message says how to inject them).

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.mixed_precision(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
    >>> state = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
    >>> state = mpx.adjust(state, learning_rate=3e-4)
    >>> lr = optax.tree.get(state, "learning_rate")
    >>> lr.dtype, round(float(lr), 8)
    (dtype('float32'), 0.0003)
  """
  injected: list[Any] = state_search.find_states(opt_state, _INJECTED_STATES)
  if not injected:
    raise ValueError(
      "adjust: opt_state has no injectable hyperparameters. Build the rule with "
      "optax.inject_hyperparams, e.g. "
      "mpx.mixed_precision(optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4))."
    )
  available = set().union(*(s.hyperparams for s in injected))
  unknown = sorted(set(hyperparams) - available)
  if unknown:
    raise ValueError(
      f"adjust: no injected hyperparameter named {', '.join(map(repr, unknown))}; "
      f"the state has {', '.join(map(repr, sorted(available)))}."
    )
  scheduled = set().union(*(_scheduled_names(s) for s in injected))
  fixed_by_schedule = sorted(set(hyperparams) & scheduled)
  if fixed_by_schedule:
    verb = "is" if len(fixed_by_schedule) == 1 else "are"
    raise ValueError(
      f"adjust: {', '.join(map(repr, fixed_by_schedule))} {verb} driven by a schedule, "
      "which would overwrite the new value on the next step; inject a number "
      "instead of a schedule to set it by hand."
    )

  def convert(name: str, old: Any, value: Any) -> jax.Array:
    old = jnp.asarray(old)
    new = jnp.asarray(value, dtype=old.dtype)
    try:
      new = jnp.broadcast_to(new, old.shape)
    except ValueError as error:
      raise ValueError(
        f"adjust: {name!r} has shape {old.shape}; got a value of shape {new.shape}."
      ) from error
    # Put it where the old value lives, so the jitted step sees the same input
    # sharding; an uncommitted old value gets an uncommitted new one, since jit
    # compiles committed arguments separately.
    concrete = not isinstance(old, jax.core.Tracer) and not isinstance(new, jax.core.Tracer)
    if concrete and old.committed:
      new = jax.device_put(new, old.sharding)
    return new

  def set_values(state: Any) -> Any:
    if not any(name in state.hyperparams for name in hyperparams):
      return state
    values = dict(state.hyperparams)
    for name, value in hyperparams.items():
      if name in values:
        values[name] = convert(name, values[name], value)
    return state._replace(hyperparams=values)

  return state_search.replace_states(opt_state, _INJECTED_STATES, set_values)
