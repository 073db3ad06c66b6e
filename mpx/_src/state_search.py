"""Finding and replacing states of a given type wherever optax nests them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

State = TypeVar("State")


def find_states(tree: Any, state_type: type[State] | tuple[type, ...]) -> list[State]:
  """Returns all instances of ``state_type`` in ``tree``, outermost first, in tree order."""
  found: list[State] = []

  def visit(node: Any) -> None:
    found.append(node)
    # States nest (an injected optimizer inside another): look inside too.
    for child in jax.tree.leaves(tuple(node), is_leaf=lambda x: isinstance(x, state_type)):
      if isinstance(child, state_type):
        visit(child)

  for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, state_type)):
    if isinstance(node, state_type):
      visit(node)
  return found


def replace_states(
  tree: Any,
  state_type: type[State] | tuple[type, ...],
  replace: Callable[[State], State],
) -> Any:
  """Returns ``tree`` with every ``state_type`` instance ``s`` (nested ones too,
  innermost first) replaced by ``replace(s)``."""

  def visit(node: Any) -> Any:
    if not isinstance(node, state_type):
      return node
    state: Any = node  # a NamedTuple of the given type(s)
    inner = jax.tree.map(visit, tuple(state), is_leaf=lambda x: isinstance(x, state_type))
    return replace(type(state)(*inner))

  return jax.tree.map(visit, tree, is_leaf=lambda x: isinstance(x, state_type))


def chained_after(tree: Any, state_type: type | tuple[type, ...]) -> list[Any]:
  """Returns the states an ``optax.chain`` runs after a ``state_type`` state,
  at any depth. optax.chain's state is the one plain tuple among optax's states
  (the others are NamedTuples, dicts or leaves), its rules' states in order."""
  found: list[Any] = []

  def visit(node: Any) -> None:
    children: Any
    if type(node) is tuple:
      for i, child in enumerate(node[:-1]):
        if isinstance(child, state_type):
          found.extend(node[i + 1 :])
      children = node
    elif isinstance(node, tuple | list):  # NamedTuple states, state_type's included
      children = tuple(node)
    elif isinstance(node, dict):
      children = tuple(node.values())
    else:
      return
    for child in children:
      visit(child)

  visit(tree)
  return found
