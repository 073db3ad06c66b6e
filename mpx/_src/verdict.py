"""Trace-time hand-over of the skip decision from ``loss_scale`` to the
``mixed_precision`` inside it.

``loss_scale`` decides from the raw gradients whether a step is applied. It
could act on that verdict with one ``lax.cond`` around its whole inner update,
but then the updates must leave the cond as a buffer of their own: one float32
array per parameter, written and read back on every step (and, on XLA:CPU,
freshly mapped each time). Instead, while it traces its inner update,
``loss_scale`` publishes a :class:`Verdict`: the finite flag and, for each
unscaled gradient leaf it passes down, how to rebuild that leaf from the raw
one. A ``mixed_precision`` that receives those leaves skips its own state
update on the flag with ``lax.cond`` (its masters and moments are then
overwritten in place), rebuilds the unscaled gradients inside its branch (so
unscaling fuses into the update), and computes the updates it returns after the
cond, where they fuse into ``optax.apply_updates``. It records the state and
the updates it made skip-safe in the verdict; ``loss_scale`` protects whatever
else changed.

Objects are matched by identity, and the verdict holds every object it
records, so no id is reused while it is alive.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax


@dataclasses.dataclass(eq=False)
class Verdict:
  """What an enclosing ``loss_scale`` decided, for the transformations it wraps.

  Attributes:
    finite: traced scalar bool: whether the step is applied.
    sources: ``id(leaf) -> (leaf, raw, rebuild)`` for each gradient leaf passed
      down, where ``rebuild(raw)`` recomputes ``leaf`` (the unscaling) inside
      another trace scope, such as a ``lax.cond`` branch.
    guarded_states: ``id(state) -> state`` for each whole state a nested
      transformation returned unchanged on a skipped step. A whole state, not
      its leaves: a leaf value may also be stored elsewhere (a rule that keeps
      the last update), where it is not skip-safe.
    guarded_updates: ``id(leaf) -> leaf`` for update leaves that are zero on a
      skipped step (a value, so skip-safe wherever it goes).
  """

  finite: jax.Array
  sources: dict[int, tuple[Any, Any, Callable[[Any], Any]]]
  guarded_states: dict[int, Any] = dataclasses.field(default_factory=dict)
  guarded_updates: dict[int, Any] = dataclasses.field(default_factory=dict)

  def covers(self, leaf: Any) -> bool:
    """Whether ``leaf`` is one of the gradient leaves this verdict was made on."""
    return id(leaf) in self.sources

  def source(self, leaf: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """``(raw, rebuild)`` for a covered leaf, else None."""
    entry = self.sources.get(id(leaf))
    return None if entry is None else entry[1:]

  def guard_state(self, state: Any) -> None:
    """Records that ``state`` (one object) is its old value on a skipped step."""
    self.guarded_states[id(state)] = state

  def guard_updates(self, updates: Any) -> None:
    """Records that the leaves of ``updates`` are zero on a skipped step."""
    self.guarded_updates.update((id(leaf), leaf) for leaf in jax.tree.leaves(updates))

  def is_guarded_state(self, node: Any) -> bool:
    return id(node) in self.guarded_states

  def is_guarded_update(self, leaf: Any) -> bool:
    return id(leaf) in self.guarded_updates


_VERDICT: contextvars.ContextVar[Verdict | None] = contextvars.ContextVar(
  "mpx_enclosing_verdict", default=None
)


@contextlib.contextmanager
def published(verdict: Verdict | None) -> Iterator[Verdict | None]:
  """Makes ``verdict`` the enclosing one (None: no enclosing verdict) within."""
  token = _VERDICT.set(verdict)
  try:
    yield verdict
  finally:
    _VERDICT.reset(token)


def enclosing() -> Verdict | None:
  """The verdict of the ``loss_scale`` whose inner update is being traced."""
  return _VERDICT.get()
