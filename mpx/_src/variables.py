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

  ``nnx.Optimizer`` initialises a rule on ``Variable``-wrapped params, so each
  leaf mpx stores for a param comes back inside that param's ``Variable``,
  metadata and all. Two kinds of leaf would not fit it: a compressed moment
  (a NamedTuple: nnx rebuilds a ``Variable``'s structured value as a nested
  ``State`` on every ``nnx.update``) and a leaf of another shape than the
  param's (a stochastic rounding key, the 8-bit block scales), which the
  param's ``out_sharding`` would misdescribe. So a compressed moment becomes
  a NamedTuple of ``Variable``s, and each axis whose length is not the
  param's loses its sharding. Without flax imported, nothing can be a
  ``Variable`` and ``state`` is returned as is.
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
  """A ``Variable`` of ``variable``'s type and metadata around ``value``, its
  ``out_sharding`` kept on the axes where ``value`` has the param's length
  (``param_shape``; None: ``value`` is the variable's own value)."""
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
