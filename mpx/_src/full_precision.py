"""``init_from_full_precision``: masters seeded from full-precision weights.

``mixed_precision``'s ``init`` asks :func:`full_precision_sources` what each
master is made from (docs/design.md, "the one context variable").
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import rounding, state_search, states, validation
from mpx._src import tree as tree_lib

# Keyed by leaf identity, which survives any wrapper's reshaping of the tree
# where key paths would not (docs/design.md, "the one context variable").


class _MasterSources:
  """Full-precision values keyed by the low-precision leaves made from them."""

  def __init__(self, pairs: list[tuple[Any, Any, str]]):
    # Holding the low leaves keeps their ids from being reused meanwhile.
    self._by_id = {id(low): (low, full, path) for low, full, path in pairs}
    self._unused = set(self._by_id)

  def take(self, leaf: Any) -> Any:
    entry = self._by_id.get(id(leaf))
    if entry is None:
      return leaf
    self._unused.discard(id(leaf))
    return entry[1]

  def unused_paths(self) -> list[str]:
    return sorted(self._by_id[i][2] for i in self._unused)


_MASTER_SOURCES: contextvars.ContextVar[_MasterSources | None] = contextvars.ContextVar(
  "mpx_master_sources", default=None
)


def full_precision_sources() -> Callable[[Any], Any]:
  """Returns what a master is made from: a leaf's full-precision source while
  init_from_full_precision runs tx.init, else the leaf itself."""
  sources = _MASTER_SOURCES.get()
  return (lambda leaf: leaf) if sources is None else sources.take


def init_from_full_precision(
  tx: optax.GradientTransformation,
  params: tree_lib.PyTree,
  param_dtype: jax.typing.DTypeLike,
  where: tree_lib.LeafPredicate | tree_lib.PyTree | None = None,
) -> tuple[tree_lib.PyTree, optax.OptState]:
  """Starts low-precision training from full-precision weights, losing no bit.

  Casts ``params`` (e.g. FP32 weights restored from a checkpoint) to
  ``param_dtype`` as their masters round (saturating: a weight beyond the
  fp16 range becomes 65504, not inf; bfloat16 ties away from zero, as
  :func:`mixed_precision` rounds) and initialises ``tx`` on the result, but
  seeds every master from the *original* value, so each master equals the
  checkpoint bit for bit (``tx.init`` on cast params could only recover the
  rounded value), in ``masters="remainder"`` mode too. The inner rules are
  initialised on those exact masters.

  Args:
    tx: the full transformation, containing one or more
      :func:`mixed_precision` (at any depth).
    params: full-precision parameters.
    param_dtype: the low-precision dtype to train the model in.
    where: which floating leaves to cast, as in :func:`mpx.cast_tree`.

  Returns:
    ``(low_precision_params, opt_state)``.

  Raises:
    ValueError: if some cast leaf gets no master from ``tx`` (no
      ``mixed_precision`` covers it, or its ``dtype`` is not wider than
      ``param_dtype``): its low bits would be lost. The message names the
      leaves.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> full = {"w": jnp.array([1.0 + 2.0**-20])}  # not representable in bf16
    >>> tx = mpx.mixed_precision(optax.adam(1e-3))
    >>> params, state = mpx.init_from_full_precision(tx, full, jnp.bfloat16)
    >>> params["w"].dtype, bool(state.master_params["w"][0] == full["w"][0])
    (dtype(bfloat16), True)
  """
  validation.check_transformation(tx, "tx")
  param_dtype = tree_lib.require_floating_dtype(param_dtype, "dtype")
  low = tree_lib.map_floating(params, lambda leaf: _cast_for_masters(leaf, param_dtype), where)
  low_with_paths, _ = jax.tree_util.tree_flatten_with_path(low)
  pairs = [
    (low_leaf, full_leaf, tree_lib.path_str(path))
    for (path, low_leaf), full_leaf in zip(low_with_paths, jax.tree.leaves(params), strict=True)
    if low_leaf is not full_leaf
  ]
  opt_state, unused = init_seeded(tx, low, pairs)
  if unused:
    stochastic = set(_stochastic_paths(opt_state)).intersection(unused)
    if len(stochastic) == len(unused):
      fix = (
        "They are under mpx.mixed_precision, but masters='stochastic' keeps no "
        "master to seed: cast them with mpx.cast_tree and call tx.init instead."
      )
    else:
      fix = (
        "Wrap the rule for them in mpx.mixed_precision with a dtype wider than "
        "param_dtype, or keep them in full precision with `where`."
      )
      if stochastic:
        fix += (
          f" ({len(stochastic)} of them are under masters='stochastic', which "
          "keeps no master: cast those with mpx.cast_tree and call tx.init.)"
        )
    raise ValueError(
      f"init_from_full_precision: {len(unused)} leaves cast to "
      f"{np.dtype(param_dtype)} got no master copy from tx, so their "
      f"full-precision bits would be lost: {', '.join(unused[:10])}"
      f"{' ...' if len(unused) > 10 else ''}. {fix}"
    )
  return low, opt_state


def _stochastic_paths(opt_state: Any) -> list[str]:
  """The paths of the leaves that a ``masters="stochastic"`` state in
  ``opt_state`` rounds (for ``init_from_full_precision``'s message)."""
  paths = []
  for state in state_search.find_states(opt_state, states.MixedPrecisionStochasticState):
    keys, _ = jax.tree_util.tree_flatten_with_path(state.rounding_keys)
    paths += [tree_lib.path_str(path) for path, _ in keys]
  return paths


def init_seeded(
  tx: optax.GradientTransformation, params: Any, pairs: list[tuple[Any, Any, str]]
) -> tuple[optax.OptState, list[str]]:
  """Returns ``(tx.init(params), unused paths)``, every master of a param leaf
  named in ``pairs`` (``(leaf, full-precision value, path)``) seeded from its
  value; the paths are those of the pairs no master took."""
  sources = _MasterSources(pairs)
  token = _MASTER_SOURCES.set(sources)
  try:
    opt_state = tx.init(params)
  finally:
    _MASTER_SOURCES.reset(token)
  return opt_state, sources.unused_paths()


def _cast_for_masters(leaf: Any, param_dtype: Any) -> jax.Array:
  """Casts a full-precision leaf to the param its master rounds to: bfloat16
  ties away (docs/concepts_masters.md), other dtypes to nearest even, saturating."""
  leaf = jnp.asarray(leaf)
  if jnp.dtype(param_dtype) == jnp.bfloat16 and leaf.dtype != jnp.bfloat16:
    return rounding.round_ties_away(rounding.canonical(leaf.astype(jnp.float32)))
  return tree_lib.saturating_cast(leaf, param_dtype)
