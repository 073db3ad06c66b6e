"""``zero1_shardings``: optimizer state sharded over the data-parallel axis.

ZeRO stage 1 in JAX is only shardings; docs/multi_device.md, "ZeRO-1", tells
what it saves, why it is bitwise the replicated run and how to pin the step.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpx._src import moment_codes, variables
from mpx._src import tree as tree_lib
from mpx._src.moments import KIND_OF_STORED
from mpx._src.states import (
  COMPRESSED_MOMENTS,
)


def _axes(entry: Any) -> tuple[str, ...]:
  """Returns the mesh axis names in one entry of a PartitionSpec."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _devices_along(entry: Any, mesh: Mesh) -> int:
  """Returns how many ways one PartitionSpec entry splits its dimension on ``mesh``."""
  return math.prod(mesh.shape[name] for name in _axes(entry))


def _param_spec(leaf: Any, mesh: Mesh, ndim: int) -> tuple[Any, ...]:
  """Returns the leaf's PartitionSpec on ``mesh``, padded to ``ndim``;
  replicated if it carries no NamedSharding on a mesh with the same axes."""
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh.shape_tuple == mesh.shape_tuple:
    entries = tuple(sharding.spec)
  else:
    entries = ()
  if len(entries) > ndim:
    return (None,) * ndim
  return entries + (None,) * (ndim - len(entries))


def _add_axis(
  shape: tuple[int, ...], entries: tuple[Any, ...], mesh: Mesh, axis: str
) -> tuple[Any, ...]:
  """Adds ``axis`` to the first dimension it divides evenly, an unsharded one
  first, else appended to a sharded one (``("model", "data")``); if none
  divides, the leaf stays replicated over ``axis``."""
  if any(axis in _axes(entry) for entry in entries):
    return entries  # already sharded over axis (e.g. FSDP params)
  size = mesh.shape[axis]

  def fits(dim: int) -> bool:
    existing = _devices_along(entries[dim], mesh)
    return shape[dim] % (existing * size) == 0

  free = [d for d in range(len(shape)) if entries[d] is None and fits(d)]
  taken = [d for d in range(len(shape)) if entries[d] is not None and fits(d)]
  new = list(entries)
  if free:
    new[free[0]] = axis
  elif taken:
    new[taken[0]] = (*_axes(entries[taken[0]]), axis)
  return tuple(new)


def _canonical(entries: Any, mesh: Mesh) -> PartitionSpec:
  """Spells ``entries`` as jax names a sharding XLA chose: no size-1 axes, no
  trailing None (``P('data')``). jit's cache tells the spellings apart, so any
  other would miss it on the next step (docs/multi_device.md, "ZeRO-1")."""
  canonical = []
  for entry in entries:
    names = tuple(name for name in _axes(entry) if mesh.shape[name] != 1)
    canonical.append(None if not names else names[0] if len(names) == 1 else names)
  while canonical and canonical[-1] is None:
    canonical.pop()
  return PartitionSpec(*canonical)


def zero1_shardings(
  tx: optax.GradientTransformation,
  params: optax.Params,
  mesh: Mesh,
  axis: str | None = "data",
) -> optax.OptState:
  """Returns shardings that split the optimizer state of ``tx`` across ``axis``.

  Each state leaf that mirrors a parameter (masters, moments) gets its
  parameter's ``PartitionSpec`` with ``axis`` added to the first dimension it
  divides evenly; every other leaf stays replicated over ``axis``. An 8-bit
  moment's codes get that spec; its block scales keep each entry only where
  their own axis divides (the last: whole blocks on each device). Shard a
  jitted ``tx.init`` and the step's state with it, and pin the params in the
  step (docs/multi_device.md, "ZeRO-1").

  Args:
    tx: the optimizer, e.g. ``mpx.mixed_precision(optax.adamw(3e-4))``. Its
      ``init`` is only traced (``jax.eval_shape``), never run.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``, bare or in
      flax linen boxes). A leaf with a ``NamedSharding`` on a mesh of
      ``mesh``'s shape contributes its spec (e.g. tensor parallelism), a
      boxed leaf without one its box's ``names`` of ``mesh``'s axes; any other
      leaf counts as replicated.
    mesh: the device mesh, its axes ``AxisType.Auto`` (GSPMD).
    axis: the data-parallel mesh axis, or None for no ZeRO: each state leaf
      then mirrors its parameter's sharding ("shard like the params").

  Returns:
    A tree of ``NamedSharding`` with the structure of ``tx.init(params)``,
    ``optax.MaskedNode`` holes and linen boxes included.

  Raises:
    ValueError: if ``axis`` is not an axis of ``mesh``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpx
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices(), ("data",))
    >>> params = {"w": jnp.ones((48, 3), jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
    >>> tx = mpx.mixed_precision(optax.adam(1e-3))
    >>> shardings = mpx.zero1_shardings(tx, params, mesh)
    >>> n = len(jax.devices())  # on one device the size-1 "data" axis is dropped
    >>> shardings.master_params["w"].spec == (P("data") if n > 1 else P())
    True
    >>> shardings.master_params["b"].spec == shardings.inner_state[0].count.spec == P()
    True
    >>> opt_state = jax.jit(tx.init, out_shardings=shardings)(params)
    >>> opt_state.master_params["w"].addressable_shards[0].data.shape == (48 // n, 3)
    True
  """
  if axis is not None and axis not in mesh.axis_names:
    raise ValueError(f"zero1_shardings: axis {axis!r} is not an axis of the mesh {mesh.shape}.")
  if tree_lib.has_linen_boxes(params):
    # flax linen boxes: each boxed param contributes its names as its spec, and
    # the shardings come back in the boxes of the state tx.init makes of them.
    shardings = zero1_shardings(tx, _with_box_specs(params, mesh), mesh, axis)
    return tree_lib.boxed_like(jax.eval_shape(tx.init, params), shardings)
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract_state = jax.eval_shape(tx.init, params)

  def entries_for(
    shape: tuple[int, ...], param: Any, fit_shape: tuple[int, ...]
  ) -> tuple[Any, ...]:
    """Returns the param's spec entries for a leaf of ``shape``, ``axis`` added
    to the first dimension of ``fit_shape`` it divides."""
    entries = _param_spec(param, mesh, len(shape))
    if axis is None:
      return entries
    return _add_axis(fit_shape, entries, mesh, axis)

  def shard_like_param(leaf: Any, param: Any) -> Any:
    if tree_lib.is_placeholder(leaf):
      return leaf
    if isinstance(leaf, COMPRESSED_MOMENTS):
      # The codes (or bfloat16 values) follow the param's spec, ``axis`` added
      # as if the last axis were its blocks: a split of it then falls on block
      # boundaries. Each part keeps an entry only where its own axis divides
      # (4-bit codes: two a byte; the scales' last axis: whole blocks, not cut
      # short).
      moment: Any = leaf
      shape = fit_shape = tuple(np.shape(param))
      kind = KIND_OF_STORED[type(leaf)]
      if isinstance(kind, moment_codes.BlockScaledKind) and shape:
        size = kind.block_size(shape)  # None where the blocks do not tile the axis
        fit_shape = (*shape[:-1], shape[-1] // size if size else 1)
      entries = entries_for(shape, param, fit_shape)
      codes = _fitting(entries, tuple(moment[0].shape), mesh)
      scales = _fitting(entries, fit_shape, mesh)
      return type(moment)(
        NamedSharding(mesh, _canonical(codes, mesh)),
        *[NamedSharding(mesh, _canonical(scales, mesh))] * (len(moment) - 1),
      )
    shape = tuple(getattr(leaf, "shape", ()))
    if not shape:
      return replicated
    return NamedSharding(mesh, _canonical(entries_for(shape, param, shape), mesh))

  is_leaf = lambda x: tree_lib.is_placeholder(x) or isinstance(x, COMPRESSED_MOMENTS)  # noqa: E731
  with variables.mapping_compressed_moments():  # shard_like_param maps them
    return optax.tree_utils.tree_map_params(
      tx,
      shard_like_param,
      abstract_state,
      params,
      # A whole tree where the state holds no param-like leaf (the rounding keys).
      transform_non_params=lambda tree: jax.tree.map(lambda _: replicated, tree),
      is_leaf=is_leaf,
    )


def _with_box_specs(params: Any, mesh: Mesh) -> Any:
  """Returns ``params`` unboxed, each flax linen box's leaf as a
  ``jax.ShapeDtypeStruct`` sharded by the box's partition spec (its mesh
  axes of ``mesh``; any other name counts as replicated) unless it already
  carries a sharding on a mesh of ``mesh``'s shape."""

  def spec_of(node: Any) -> Any:
    if not tree_lib.is_linen_box(node) or not hasattr(node, "names"):
      return node
    value = tree_lib.unboxed(node)
    if _param_spec(value, mesh, np.ndim(value)) != (None,) * np.ndim(value):
      return value
    spec = tuple(node.names)
    spmd = sys.modules.get("flax.linen.spmd")
    if hasattr(node, "rules") and spmd is not None:
      # nn.LogicallyPartitioned: logical names, mapped by its rules or those in force.
      spec = tuple(spmd.logical_to_mesh_axes(spec, node.rules))
    names = [tuple(n for n in _axes(entry) if n in mesh.axis_names) or None for entry in spec]
    sharding = NamedSharding(mesh, _canonical(names, mesh))
    return jax.ShapeDtypeStruct(np.shape(value), value.dtype, sharding=sharding)

  return jax.tree.map(spec_of, params, is_leaf=tree_lib.is_linen_box)


def _fitting(entries: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> tuple[Any, ...]:
  """Returns ``entries`` with each entry kept only where it divides ``shape``."""
  return tuple(
    entry if shape[d] % _devices_along(entry, mesh) == 0 else None
    for d, entry in enumerate(entries)
  )
