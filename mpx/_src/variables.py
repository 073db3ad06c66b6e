"""flax nnx ``Variable``s around the state leaves that mpx derives from a param."""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from mpx._src import compat, moments
from mpx._src import tree as tree_lib


def fit_variables(state: Any) -> Any:
  """Returns ``state`` with each nnx ``Variable`` holding one array its sharding fits.

  A compressed moment becomes a NamedTuple of ``Variable``s, and an axis
  whose length is not the param's loses its sharding (docs/howto.md, "Use a
  flax nnx Optimizer"). Without flax imported, ``state`` is returned as is.
  """
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
      shape = np.shape(value[0])  # the codes or values: the param's shape
      return type(value)(*(_rewrap(node, part, shape) for part in value))
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
  shape = np.shape(value)
  reference = shape if param_shape is None else param_shape
  if len(axes) == len(shape):
    axes = tuple(a if n == m else None for a, n, m in zip(axes, shape, reference, strict=True))
  else:  # a scalar rounding key under a matrix's sharding
    axes = ()
  if any(a is not None for a in axes):
    metadata["out_sharding"] = axes
  if param_shape is None and metadata == variable.get_metadata():
    return variable
  return type(variable)(value, **metadata)
