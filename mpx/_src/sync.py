"""``sync_masters``: masters that follow params edited outside the optimizer."""

from __future__ import annotations

from typing import Any

import jax
import optax

from mpx._src import state_search, storage
from mpx._src import tree as tree_lib
from mpx._src.states import MIXED_PRECISION_STATES


def sync_masters(opt_state: optax.OptState, params: tree_lib.PyTree) -> optax.OptState:
  """Restarts the masters of params edited outside the optimizer.

  ``mixed_precision`` moves each low-precision param onto the rounding of its
  master, so an edit made after ``optax.apply_updates`` (a projection, a
  pruning mask, weight surgery) would be undone by the next step. Call this
  after the edit: every element whose param is no longer the rounding of its
  master gets the param, widened, as its new master; every other element
  keeps its master bit for bit. Masters are found at any depth of
  ``opt_state`` (chain, ``MultiSteps``, ``inject_hyperparams``, partitions,
  ``loss_scale``).

  With ``masters="remainder"`` the master follows any edit by itself (a
  param set to zero under a negative remainder restarts it at 0); with
  ``"stochastic"`` there is no master and the state is returned as is.

  Args:
    opt_state: a state containing :func:`mpx.mixed_precision` states.
    params: the edited low-precision params, the tree the state was made for.

  Returns:
    The new state, of the same structure, dtypes and shardings. Jit-able.

  Raises:
    ValueError: if ``params`` does not match the masters' tree.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.array([0.5, -0.25], jnp.bfloat16)}
    >>> tx = mpx.mixed_precision(optax.sgd(1e-3))
    >>> state = tx.init(params)
    >>> params = {"w": jnp.maximum(params["w"], 0)}  # a projection onto w >= 0
    >>> state = mpx.sync_masters(state, params)
    >>> state.master_params["w"].tolist()
    [0.5, 0.0]
  """

  def sync(state: Any) -> Any:
    mode = storage.MODE_OF_STATE[type(state)]
    try:
      synced = mode.map_stored(_sync_leaf, state, params)
    except ValueError as error:
      raise ValueError(
        "sync_masters: params do not match the masters in opt_state (pass the "
        "params the state was made for)."
      ) from error
    return state._replace(**{mode.stored_field: synced})

  return state_search.replace_states(opt_state, MIXED_PRECISION_STATES, sync)


def _sync_leaf(kind: storage.StorageKind, stored: Any, param: Any) -> Any:
  synced = kind.sync(stored, param)
  # Outside jit, keep the stored leaf's sharding object itself (an
  # equivalent spec spelled differently would recompile a pinned step).
  if not isinstance(synced, jax.core.Tracer) and isinstance(stored, jax.Array):
    synced = jax.device_put(synced, stored.sharding)
  return synced
