"""``init_from_full_precision``: masters seeded from full-precision weights
(docs/design.md, "the one context variable")."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import rounding, storage, validation
from mpx._src import tree as tree_lib

# Keyed by leaf identity, which survives any wrapper's reshaping of the tree
# where key paths would not (docs/design.md, "the one context variable").


class _MasterSources:
  """Full-precision values keyed by the low-precision leaves made from them,
  and the storage kind each ``mixed_precision`` init gave those leaves."""

  def __init__(self, pairs: list[tuple[Any, Any, str]]):
    # Holding the low leaves keeps their ids from being reused meanwhile.
    self._by_id = {id(low): (low, full, path) for low, full, path in pairs}
    self._kinds: dict[int, Any] = {}

  def take(self, leaf: Any) -> Any:
    entry = self._by_id.get(id(leaf))
    return leaf if entry is None else entry[1]

  def note_kinds(self, leaves: list[Any], kinds: list[Any]) -> None:
    for leaf, kind in zip(leaves, kinds, strict=True):
      if id(leaf) in self._by_id:
        self._kinds[id(leaf)] = kind

  def seen(self) -> list[tuple[str, Any, Any]]:
    """Returns ``(path, full-precision value, kind)`` per leaf, sorted by path:
    ``kind`` the storage kind a ``mixed_precision`` gave it (None: none saw it)."""
    entries = [(path, full, self._kinds.get(i)) for i, (_, full, path) in self._by_id.items()]
    return sorted(entries, key=lambda entry: entry[0])


_MASTER_SOURCES: contextvars.ContextVar[_MasterSources | None] = contextvars.ContextVar(
  "mpx_master_sources", default=None
)


def full_precision_sources(leaves: list[Any], kinds: list[Any]) -> Callable[[Any], Any]:
  """Returns what a master is made from: a leaf's full-precision source while
  init_from_full_precision runs tx.init (which learns each leaf's storage
  kind, ``kinds``, for its messages), else the leaf itself."""
  sources = _MASTER_SOURCES.get()
  if sources is None:
    return lambda leaf: leaf
  sources.note_kinds(leaves, kinds)
  return sources.take


def init_from_full_precision(
  tx: optax.GradientTransformation,
  params: tree_lib.PyTree,
  param_dtype: jax.typing.DTypeLike,
  where: tree_lib.LeafPredicate | tree_lib.PyTree | None = None,
  *,
  allow_rounding: bool = False,
) -> tuple[tree_lib.PyTree, optax.OptState]:
  """Starts low-precision training from full-precision weights, losing no bit.

  Casts ``params`` (e.g. FP32 weights restored from a checkpoint) to
  ``param_dtype`` as their masters round (saturating: a weight beyond the
  fp16 range becomes 65504, not inf; bfloat16 ties away from zero, as
  :func:`mixed_precision` rounds) and initialises ``tx`` on the result, but
  seeds every master from the *original* value, so each master equals the
  checkpoint bit for bit (``tx.init`` on cast params could only recover the
  rounded value), in ``masters="remainder"`` mode too. The inner rules are
  initialised on those exact masters. Masters that keep fewer bits than the
  weights (``masters="24bit"``, ``"stochastic"``, or a ``dtype`` narrower than
  the weights') are refused unless ``allow_rounding``.

  Args:
    tx: the full transformation, containing one or more
      :func:`mixed_precision` (at any depth).
    params: full-precision parameters.
    param_dtype: the low-precision dtype to train the model in.
    where: which floating leaves to cast, as in :func:`mpx.cast_tree`.
    allow_rounding: accept masters that keep fewer bits than ``params``: a
      24-bit master is then the weight rounded to nearest (a relative error
      below 2**-16), a narrower ``dtype`` its rounding, and under
      ``masters="stochastic"`` (no master) the cast param is the model.

  Returns:
    ``(low_precision_params, opt_state)``.

  Raises:
    ValueError: if bits of some cast leaf would be lost: no
      ``mixed_precision`` covers it, its ``dtype`` is not wider than
      ``param_dtype``, or (without ``allow_rounding``) its master keeps fewer
      bits. The message names the leaves, grouped by cause, with each fix.

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
  pairs = [
    (low_leaf, full_leaf, path)
    for path, low_leaf, full_leaf in zip(
      user_paths(low), jax.tree.leaves(low), jax.tree.leaves(params), strict=True
    )
    if low_leaf is not full_leaf
  ]
  opt_state, sources = init_seeded(tx, low, pairs)
  _refuse_lost_bits(sources, np.dtype(param_dtype), allow_rounding)
  return low, opt_state


def _refuse_lost_bits(sources: _MasterSources, param_dtype: Any, allow_rounding: bool) -> None:
  """Raises if some leaf's full-precision bits are lost, naming the leaves by cause."""
  lost: dict[str, list[str]] = {}
  for path, full, kind in sources.seen():
    cause = _lost_by(kind, jnp.dtype(full.dtype), allow_rounding)
    if cause is not None:
      lost.setdefault(cause, []).append(path)
  if lost:
    count = sum(len(paths) for paths in lost.values())
    raise ValueError(
      f"init_from_full_precision: the full-precision bits of {count} leaves cast to "
      f"{param_dtype} would be lost. "
      + " ".join(
        f"{len(paths)} ({', '.join(paths[:10])}{' ...' if len(paths) > 10 else ''}) {cause}."
        for cause, paths in lost.items()
      )
    )


def _lost_by(kind: Any, full_dtype: Any, allow_rounding: bool) -> str | None:
  """Returns why a leaf of ``full_dtype`` loses bits under its storage ``kind``
  (None: no ``mixed_precision`` saw it), with the fix; None if it loses none."""
  if kind is None:
    return (
      "are under no mixed_precision in tx: wrap the rule for them in "
      "mpx.mixed_precision, or keep them in full precision with `where`"
    )
  if isinstance(kind, storage.NoMaster):
    return (
      "get no master, their mixed_precision's dtype being no wider than param_dtype: "
      "give it a wider dtype, or keep them in full precision with `where`"
    )
  if allow_rounding:
    return None
  if isinstance(kind, storage.Stochastic):
    return (
      "are under masters='stochastic', which keeps no master: pass "
      "allow_rounding=True to train from the cast params (or cast them with "
      "mpx.cast_tree and call tx.init)"
    )
  if isinstance(kind, storage.Master24bit):
    return (
      "are under masters='24bit', which keeps 24 of float32's 32 bits (a relative "
      "error up to 2**-16): pass allow_rounding=True to round them, or use "
      "masters='remainder' (exact)"
    )
  master = getattr(kind, "master_dtype", None)
  if master is not None and jnp.finfo(master).bits < jnp.finfo(full_dtype).bits:
    return (
      f"get {jnp.dtype(master)} masters, narrower than their {full_dtype} weights: "
      "pass allow_rounding=True to round them, or a wider mixed_precision dtype"
    )
  return None


def user_paths(tree: Any) -> list[str]:
  """Returns the path of each leaf of ``tree`` as the user wrote it: a flax
  linen box's leaf by the box's path (``"Dense_0/kernel"``, not its ``value``)."""
  return [
    tree_lib.path_str(path)
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=tree_lib.is_linen_box)[0]
    for _ in jax.tree.leaves(node)
  ]


def init_seeded(
  tx: optax.GradientTransformation, params: Any, pairs: list[tuple[Any, Any, str]]
) -> tuple[optax.OptState, _MasterSources]:
  """Returns ``tx.init(params)``, every master of a param leaf named in
  ``pairs`` (``(leaf, full-precision value, path)``) seeded from its value,
  and the sources, which tell which pairs a master took and each leaf's kind."""
  sources = _MasterSources(pairs)
  token = _MASTER_SOURCES.set(sources)
  try:
    opt_state = tx.init(params)
  finally:
    _MASTER_SOURCES.reset(token)
  return opt_state, sources


def _cast_for_masters(leaf: Any, param_dtype: Any) -> jax.Array:
  """Casts a full-precision leaf to the param its master rounds to: bfloat16
  ties away (docs/concepts_masters.md), other dtypes to nearest even, saturating."""
  leaf = jnp.asarray(leaf)
  if jnp.dtype(param_dtype) == jnp.bfloat16 and leaf.dtype != jnp.bfloat16:
    return rounding.round_ties_away(rounding.canonical(leaf.astype(jnp.float32)))
  return tree_lib.saturating_cast(leaf, param_dtype)
