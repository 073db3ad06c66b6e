"""The boxes around state leaves derived from a param: nnx ``Variable``s,
linen ``Partitioned`` boxes and optax's params placeholder."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any, cast

import jax
import numpy as np

from mpx._src import compat, moments
from mpx._src import tree as tree_lib
from mpx._src.states import MIXED_PRECISION_STATES, MixedPrecisionStochasticState


class NotParams:
  """Stands, in the state ``tx.init`` makes of optax's params placeholder, for
  a tree shaped like the params that holds no param-like leaf: the stochastic
  mode's scalar rounding keys. ``optax.tree_utils.tree_map_params`` hands the
  tree there to ``transform_non_params``, not to ``f``."""

  def __repr__(self) -> str:
    return "NotParams()"


def fit_variables(state: Any, compressed_as: str | None = None, linen_boxes: bool = False) -> Any:
  """Returns ``state`` with each box around a leaf derived from a param fitting that leaf.

  With nnx imported, each nnx ``Variable`` holds one array its sharding fits:
  a compressed moment becomes a NamedTuple of ``Variable``s, and an axis
  whose length is not the param's loses its sharding (docs/howto.md, "Use a
  flax nnx Optimizer"). With ``linen_boxes`` (and flax imported), each flax
  ``AxisMetadata`` box with ``names`` (linen's ``nn.Partitioned``) is fitted
  likewise: a compressed moment becomes a NamedTuple of boxes, a scalar
  rounding key is unboxed (``update`` must then run through
  ``tree.through_linen_boxes``). A state made of optax's params placeholder
  (``tree_map_params``) gets :class:`NotParams` for its rounding keys, and is
  refused if its moments are compressed (``compressed_as``: the ``moments=``
  setting as written; None where the moments are kept as the rule made them).
  Without flax imported, boxes are left as they are.

  Raises:
    ValueError: for optax's params placeholder under compressed moments.
  """
  state = _for_optax_placeholder(state, compressed_as)
  if linen_boxes:
    state = _fit_linen_boxes(state)
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return state
  variable_type = nnx.Variable

  def fit(node: Any) -> Any:
    if not isinstance(node, variable_type):
      return node
    compat.check_nnx_supported()
    value: Any = node.get_value()
    if moments.is_compressed(value):
      return type(value)(
        *(_rewrap(node, part, shape) for part, shape in zip(value, _mirrored(value), strict=True))
      )
    if tree_lib.is_placeholder(value) or not hasattr(value, "shape"):
      return node
    return _rewrap(node, value, None)

  return jax.tree.map(fit, state, is_leaf=lambda x: isinstance(x, variable_type))


def _rewrap(variable: Any, value: Any, param_shape: tuple[int, ...] | None) -> Any:
  """Wraps ``value`` in a ``Variable`` like ``variable``, its ``out_sharding``
  kept on the axes where ``value`` has the param's length (``param_shape``;
  None: ``value`` is the variable's own value)."""
  metadata = variable.get_metadata()
  axes = tuple(metadata.pop("out_sharding", None) or ())
  # () for a scalar rounding key under a matrix's sharding
  axes = _on_param_axes(axes, np.shape(value), param_shape) or ()
  if any(a is not None for a in axes):
    metadata["out_sharding"] = axes
  if param_shape is None and metadata == variable.get_metadata():
    return variable
  return type(variable)(value, **metadata)


def _mirrored(moment: Any) -> list[tuple[int, ...]]:
  """Returns, per part of a compressed moment, the lengths its axes have
  where they run along the param's: its first part (bfloat16 values, 8-bit
  codes, 4-bit codes two a byte along the last axis) mirrors the param axis
  by axis, so it keeps every box entry and splits like the param; the block
  scales only on the axes before the last."""
  param_shape = moments.param_shape_of(moment)
  return [tuple(np.shape(moment[0])), *[param_shape] * (len(moment) - 1)]


def _on_param_axes(
  axes: tuple[Any, ...], shape: tuple[int, ...], param_shape: tuple[int, ...] | None
) -> tuple[Any, ...] | None:
  """Returns ``axes`` (sharding entries or names, one per axis of the param)
  kept where ``shape`` has the param's length (``param_shape``; None: the
  leaf's own), or None if their counts differ."""
  if len(axes) != len(shape):
    return None
  reference = shape if param_shape is None else param_shape
  return tuple(a if n == m else None for a, n, m in zip(axes, shape, reference, strict=True))


# Set while a caller of tree_map_params maps each compressed moment itself.
_COMPRESSED_MAPPED: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "mpx_compressed_mapped", default=False
)


@contextlib.contextmanager
def mapping_compressed_moments() -> Iterator[None]:
  """Lets ``optax.tree_utils.tree_map_params`` map a state with compressed
  moments, for a caller whose ``f`` takes each compressed moment whole
  (``is_leaf``), as ``zero1_shardings`` does."""
  token = _COMPRESSED_MAPPED.set(True)
  try:
    yield
  finally:
    _COMPRESSED_MAPPED.reset(token)


def is_optax_placeholder(tree: Any) -> bool:
  """Tells whether ``tree`` is the params placeholder of
  ``optax.tree_utils.tree_map_params`` (as ``optax.masked`` tells it)."""
  # A private name of optax's: looked up, never imported at mpx's import.
  state_utils = sys.modules.get("optax.tree_utils._state_utils")
  placeholder = getattr(state_utils, "_ParamsPlaceholder", None)
  if placeholder is not None:
    return isinstance(tree, placeholder)
  return type(tree).__name__ == "_ParamsPlaceholder"


def _for_optax_placeholder(state: Any, compressed_as: str | None) -> Any:
  """Returns a state made of optax's params placeholder as ``tree_map_params``
  can map it: the rounding keys marked :class:`NotParams`; refuses one whose
  moments are compressed, which the placeholder cannot stand for."""
  if not isinstance(state, MIXED_PRECISION_STATES) or not is_optax_placeholder(state[0]):
    return state
  if compressed_as is not None and not _COMPRESSED_MAPPED.get():
    raise ValueError(
      "optax.tree_utils.tree_map_params cannot map the state of mixed_precision(..., "
      f"moments={compressed_as}): each compressed moment is a NamedTuple (its bfloat16 "
      "values, or its 8-bit codes and block scales) where the params have one leaf, and "
      "the block scales do not have the param's shape. For shardings that follow the "
      "params', use mpx.zero1_shardings(tx, params, mesh, axis=None) (docs/multi_device.md)."
    )
  if isinstance(state, MixedPrecisionStochasticState):
    return state._replace(rounding_keys=NotParams())
  return state


def _fit_linen_boxes(state: Any) -> Any:
  """Returns ``state`` with each linen box's ``names`` fitting the leaf it holds
  (:func:`_rebox`)."""

  def fit(node: Any) -> Any:
    if not tree_lib.is_linen_box(node) or not hasattr(node, "names"):
      return node
    value: Any = tree_lib.unboxed(node)
    if moments.is_compressed(value):
      return type(value)(
        *(_rebox(node, part, shape) for part, shape in zip(value, _mirrored(value), strict=True))
      )
    if tree_lib.is_placeholder(value) or not hasattr(value, "shape"):
      return node
    if not np.shape(value) and tuple(node.names):
      return value  # a scalar rounding key under a matrix's names: unboxed, replicated
    return _rebox(node, value, None)

  return jax.tree.map(fit, state, is_leaf=tree_lib.is_linen_box)


def _rebox(box: Any, value: Any, param_shape: tuple[int, ...] | None) -> Any:
  """Boxes ``value`` like ``box``, its ``names`` kept on the axes where ``value``
  has the param's length (``param_shape``; None: ``box``'s own value)."""
  shape = np.shape(value)
  names = _on_param_axes(tuple(box.names), shape, param_shape) or (None,) * len(shape)
  if param_shape is None and names == tuple(box.names):
    return box
  if dataclasses.is_dataclass(box):
    return dataclasses.replace(cast(Any, box), value=value, names=names)
  return box.replace_boxed(value)
