"""Validation shared by the transformations: clear errors at construction or
trace time instead of silent wrong answers (see docs/guarantees.md)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from mpx._src import tree as tree_lib


def check_transformation(inner: Any, name: str = "inner") -> None:
  """Raises a TypeError unless ``inner`` looks like an optax transformation."""
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
      f"{name} must be an optax GradientTransformation (with init and update), "
      f"got {type(inner).__name__}. Did you pass the factory instead of calling "
      "it, e.g. optax.adam instead of optax.adam(1e-3)?"
    )


def _is_hole(x: Any) -> bool:
  return x is None or isinstance(x, optax.MaskedNode)


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_hole)
  return [(tree_lib.path_str(path) or "<root>", leaf) for path, leaf in flat]


def describe(leaf: Any) -> str:
  """``float32[2, 3]``-style text for error messages."""
  dtype = tree_lib.leaf_dtype(leaf)
  if dtype is None:
    return type(leaf).__name__
  return f"{dtype}{list(np.shape(leaf))}"


def check_grads_match_params(name: str, grads: Any, params: Any) -> None:
  """Gradients must have the params' structure, and every floating param a
  floating gradient of its shape (a broadcastable one would be silently
  broadcast; an integer one would skip unscaling)."""
  grads_def = jax.tree.structure(grads, is_leaf=_is_hole)
  params_def = jax.tree.structure(params, is_leaf=_is_hole)
  if grads_def != params_def:
    raise ValueError(
      f"{name}: gradients do not match params.\n  gradients: {grads_def}\n  params: {params_def}"
    )
  for (path, grad), param in zip(
    _leaves_with_paths(grads), jax.tree.leaves(params, is_leaf=_is_hole), strict=True
  ):
    if _is_hole(param) or not tree_lib.is_floating(param):
      continue  # integer params take integer or float0 gradients
    if not tree_lib.is_floating(grad):
      raise ValueError(
        f"{name}: gradient {path!r} is {tree_lib.leaf_dtype(grad)} but its param is "
        f"{tree_lib.leaf_dtype(param)}: the gradient of a floating param must be floating."
      )
    if np.shape(grad) != np.shape(param):
      raise ValueError(
        f"{name}: gradient {path!r} has shape {list(np.shape(grad))} but its param has "
        f"shape {list(np.shape(param))}."
      )


def _signature(leaf: Any) -> tuple[tuple[int, ...], Any]:
  return (tuple(np.shape(leaf)), tree_lib.leaf_dtype(leaf))


def check_state_like(name: str, state: Any, expected: Any, prefix: str = "") -> None:
  """``state`` must have the structure, shapes and dtypes (weak types aside)
  of ``expected``, the abstract state this transformation's init builds."""
  state_def = jax.tree.structure(state, is_leaf=_is_hole)
  expected_def = jax.tree.structure(expected, is_leaf=_is_hole)
  intro = f"{name}: opt_state was not made by this transformation's init (or not for these params)"
  if state_def != expected_def:
    raise ValueError(f"{intro}: expected structure {expected_def}, got {state_def}.")
  for (path, want), got in zip(
    _leaves_with_paths(expected), jax.tree.leaves(state, is_leaf=_is_hole), strict=True
  ):
    if _is_hole(want):
      continue
    if _signature(want) != _signature(got):
      raise ValueError(
        f"{intro}: at {prefix}{path}: expected {describe(want)}, got {describe(got)}."
      )


def check_state_types_kept(name: str, new_state: Any, old_state: Any) -> None:
  """A skipped step returns the old state, so the inner rule must return its
  state with the types it was given; name the leaf where it does not."""
  new_def = jax.tree.structure(new_state, is_leaf=_is_hole)
  old_def = jax.tree.structure(old_state, is_leaf=_is_hole)
  if new_def != old_def:
    raise TypeError(
      f"{name}: the inner rule changed the structure of its state from {old_def} to {new_def}."
    )
  for (path, new), old in zip(
    _leaves_with_paths(new_state), jax.tree.leaves(old_state, is_leaf=_is_hole), strict=True
  ):
    if _is_hole(new):
      continue
    if _signature(new) != _signature(old):
      raise TypeError(
        f"{name}: the inner rule changed the type of its state at {path} from "
        f"{describe(old)} to {describe(new)}. Integer params reaching a rule such as "
        "Adam need optax.masked to keep the rule off them; 16-bit params under "
        "loss_scale alone get float32 gradients, so wrap the rule in "
        "mpx.mixed_precision, whose state is float32."
      )
