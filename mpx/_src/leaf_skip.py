"""``skip="leaf"``: each leaf stepped or kept by its own gradient's verdict, so
that no leaf's update waits for another's gradient (docs/howto.md, "Update
each leaf as its gradient arrives")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import storage, verdict
from mpx._src import tree as tree_lib


def finite_by_leaf(grads: Sequence[Any], dtypes: Sequence[Any]) -> list[jax.Array]:
  """Whether each gradient is finite as the inner rule receives it (``dtypes``,
  as ``verdict.received`` casts); True for a leaf that is not floating."""
  return [
    jnp.isfinite(verdict.received(g, d, None)).all()
    if tree_lib.is_floating(g)
    else jnp.asarray(True)
    for g, d in zip(grads, dtypes, strict=True)
  ]


def zeroed(flag: jax.Array, new: Any) -> Any:
  """``new`` where ``flag`` holds, else zeros (a skipped leaf's handoff)."""
  return jax.tree.map(lambda n: jnp.where(flag, n, jnp.zeros_like(n)), new)


def kept_by_param(
  new: Any,
  old: Any,
  param_paths: Sequence[tuple[Any, ...]],
  flags: Sequence[jax.Array],
  shared: jax.Array | None,
  is_leaf: Callable[[Any], bool] | None = None,
  select: Callable[[jax.Array, Any, Any], Any] | None = None,
) -> Any:
  """The inner state ``new`` where its param's flag holds, else ``old``.

  A state leaf belongs to the param whose path its own path ends with (the
  longest such: Adam's ``mu['w']`` is ``w``'s); ``is_leaf`` marks subtrees
  kept whole (a compressed moment), which the accelerators' program keeps
  by ``select(flag, new, old)`` where given (``two_pass.kept``, as the
  default step's select does). A leaf of no param (Adam's count, a
  schedule's step) is stepped where ``shared`` holds (None: always) and, if
  floating, it is finite: a flag read from every gradient would make every
  leaf's update wait for all of them (the count is read by each).
  """
  keys = [jax.tree_util.keystr(tuple(path)) for path in param_paths]
  longest_first = sorted(range(len(keys)), key=lambda i: -len(keys[i]))

  def leaf(path: tuple[Any, ...], n: Any, o: Any) -> Any:
    where = jax.tree_util.keystr(path)
    owner = next((i for i in longest_first if where.endswith(keys[i])), None)
    if owner is not None:
      if select is not None and is_leaf is not None and is_leaf(n):
        # Selected as bytes, XLA:GPU wrote each new 4-bit moment's codes out
        # and held many leaves' at once (0.86 B/param with float32 masters).
        return tree_lib.by_platform(
          flags[owner], n, o, cpu=tree_lib.select_tree, accelerator=select
        )
      return tree_lib.select_tree(flags[owner], n, o)
    floating = [x for x in jax.tree.leaves(n) if tree_lib.is_floating(x)]
    if not floating:
      return n if shared is None else tree_lib.select_tree(shared, n, o)
    finite = jnp.stack([jnp.isfinite(x).all() for x in floating]).all()
    flag = finite if shared is None else jnp.logical_and(shared, finite)
    return tree_lib.select_tree(flag, n, o)

  return jax.tree_util.tree_map_with_path(leaf, new, old, is_leaf=is_leaf)


def stalls_read_with(stored: list[Any], handoffs: list[Any]) -> tuple[list[Any], list[Any]]:
  """Each 24-bit master's stall flag tied to what its leaf stores
  (``lax.optimization_barrier``), so that it is read as the leaf lands: left
  free, XLA:GPU reads every leaf's flag in one kernel, which waits for every
  gradient."""
  tied_stored, tied = [], []
  for s, h in zip(stored, handoffs, strict=True):
    if isinstance(h, storage.Landed) and h.stalled is not None:
      s, stalled = jax.lax.optimization_barrier((s, h.stalled))
      h = storage.Landed(h.master, stalled)
    tied_stored.append(s)
    tied.append(h)
  return tied_stored, tied
