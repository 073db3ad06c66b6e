"""Trace-time record of gradient leaves already proven finite.

``loss_scale`` checks the unscaled gradients for inf/NaN and skips the whole
inner update when any is found. While it traces its inner update it records
the identity of the gradient leaves it checked; a ``mixed_precision`` nested
inside that receives those very leaves (no transformation in between rebuilt
them) can skip its own, redundant check. Anything else is checked again.
Identity is only compared while the checked leaves are alive, so no id is
reused.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

_CHECKED_LEAVES: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
  "mpx_checked_finite_leaves", default=frozenset()
)


@contextlib.contextmanager
def checked_finite(tree: Any) -> Iterator[None]:
  """Within this block, the leaves of ``tree`` count as known to be finite."""
  ids = _CHECKED_LEAVES.get() | {id(leaf) for leaf in jax.tree.leaves(tree)}
  token = _CHECKED_LEAVES.set(frozenset(ids))
  try:
    yield
  finally:
    _CHECKED_LEAVES.reset(token)


def known_finite(tree: Any) -> bool:
  """True iff every leaf of ``tree`` was checked by an enclosing ``checked_finite``."""
  checked = _CHECKED_LEAVES.get()
  return bool(checked) and all(id(leaf) in checked for leaf in jax.tree.leaves(tree))
