"""``zero1_shardings``: optimizer state sharded over the data-parallel axis.

In plain data parallelism every device holds the whole optimizer state: with
:func:`mpx.mixed_precision` and Adam that is 12 bytes per parameter (the
float32 master and two moments) next to the 2-byte bf16 parameter. ZeRO stage
1 (Rajbhandari et al., 2020) shards that state across the data-parallel
devices instead, so each holds ``1 / n`` of it, while the low-precision
parameters the forward and backward passes read stay replicated.

In JAX this needs no new transformation, only shardings: pass the tree
returned here as the ``out_shardings`` of a jitted ``tx.init`` and as the
state's in and out shardings of the jitted step. XLA's SPMD partitioner then
runs the optimizer update on each device's shard only and all-gathers the new
parameters. For elementwise rules (SGD, Adam, AdamW, Lion; loss scaling and the
masters included) each device computes exactly what it computed before, on a
slice, so training equals the replicated run bit for bit. A rule with a global
reduction, such as ``optax.clip_by_global_norm``, sums in another order and
may differ by a rounding. Constrain the gradients to the parameters' shardings
in the step (``jax.lax.with_sharding_constraint``) so the finite check runs on
the reduced, replicated gradients instead of adding collectives of its own.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpx._src import moment_codes
from mpx._src import tree as tree_lib
from mpx._src.states import COMPRESSED_MOMENTS, Nonnegative8bitMoment, Signed8bitMoment


def _axes(entry: Any) -> tuple[str, ...]:
  """The mesh axis names in one entry of a PartitionSpec."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _param_spec(leaf: Any, mesh: Mesh, ndim: int) -> tuple[Any, ...]:
  """The leaf's own PartitionSpec on ``mesh``, padded to ``ndim``; replicated
  if it carries no NamedSharding on a mesh with the same axes."""
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
) -> PartitionSpec:
  """``entries`` with ``axis`` added to the first dimension that divides evenly.

  A dimension not yet sharded is preferred; otherwise ``axis`` is appended to a
  sharded one (``("model", "data")``). If no dimension divides evenly, the leaf
  stays replicated over ``axis``.
  """
  if any(axis in _axes(entry) for entry in entries):
    return _canonical(entries, mesh)  # already sharded over axis (e.g. FSDP params)
  size = mesh.shape[axis]

  def fits(dim: int) -> bool:
    existing = math.prod(mesh.shape[name] for name in _axes(entries[dim]))
    return shape[dim] % (existing * size) == 0

  free = [d for d in range(len(shape)) if entries[d] is None and fits(d)]
  taken = [d for d in range(len(shape)) if entries[d] is not None and fits(d)]
  new = list(entries)
  if free:
    new[free[0]] = axis
  elif taken:
    new[taken[0]] = (*_axes(entries[taken[0]]), axis)
  return _canonical(new, mesh)


def _canonical(entries: Any, mesh: Mesh) -> PartitionSpec:
  """``entries`` as jax writes a sharding it reads back from XLA.

  jax names an output sharding that XLA chose (one not pinned by
  ``out_shardings``) with size-1 mesh axes dropped, a lone axis unwrapped from
  its tuple and trailing unsharded dimensions cut (``P('data')``, not
  ``P('data', None)``). ``NamedSharding`` equality and hashing, and so jit's
  cache, tell the two spellings apart: a state laid out as ``P('data', None)``
  that comes back as ``P('data')`` misses the cache on the next call, which
  then takes jit's slow path to the executable already compiled for the
  equivalent layout, and leaves a second cache entry.
  """
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
  """Shardings that split the optimizer state of ``tx`` across ``axis``.

  Every leaf of the state that mirrors a parameter (the float32 masters of
  :func:`mpx.mixed_precision`, Adam's ``mu`` and ``nu``, momentum traces) gets
  its parameter's ``PartitionSpec`` with ``axis`` added to the first dimension
  whose size divides evenly, so each of the ``n`` devices along ``axis`` holds
  ``1 / n`` of it. Leaves no dimension of which divides evenly, and every
  other leaf (step counts, the loss scale and its counters, injected
  hyperparameters), are left replicated over ``axis``. A parameter already
  sharded over ``axis`` keeps its spec. ``optax.MaskedNode`` holes (leaves
  with no master) stay holes, so the tree matches the state's structure.

  Use it as the ``out_shardings`` of a jitted ``tx.init`` and as the state's
  in and out shardings of the jitted training step, with the parameters'
  own (replicated) shardings for the parameters. Pin the parameters in the
  step's ``out_shardings`` too: left to XLA, the new parameters come out
  sharded like the masters they are computed from, so the next call sees
  other input shardings and compiles again. Meant for meshes whose axes are
  ``jax.sharding.AxisType.Auto`` (GSPMD), which is what
  ``jax.sharding.Mesh(devices, names)`` makes.

  The specs are spelled the way jax names the shardings XLA chooses: no
  trailing unsharded dimensions and no mesh axes of size 1 (``P('data')``,
  not ``P('data', None)``), so a state leaf that XLA leaves where it was
  compares equal to, and hashes like, its entry here.

  Args:
    tx: the optimizer, e.g. ``mpx.mixed_precision(optax.adamw(3e-4))``. Its
      ``init`` is only traced (``jax.eval_shape``), never run.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``). A leaf with a
      ``NamedSharding`` on a mesh of ``mesh``'s shape contributes its spec
      (e.g. tensor parallelism over a ``"model"`` axis); any other leaf counts
      as replicated.
    mesh: the device mesh.
    axis: the data-parallel mesh axis to shard the state over, or None for
      no ZeRO: every state leaf then mirrors its parameter's sharding (what
      plain GSPMD gives), and the other leaves are replicated over the mesh.

  Returns:
    A tree of ``NamedSharding`` with the structure of ``tx.init(params)``.

  Raises:
    ValueError: if ``axis`` is not an axis of ``mesh``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpx
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> from mpx import zero1_shardings
    >>> mesh = Mesh(jax.devices(), ("data",))
    >>> replicated = NamedSharding(mesh, P())
    >>> params = {"w": jnp.ones((48, 3), jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
    >>> params = jax.device_put(params, replicated)
    >>> tx = mpx.mixed_precision(optax.adam(1e-3))
    >>> shardings = zero1_shardings(tx, params, mesh)
    >>> n = len(jax.devices())  # on one device the size-1 "data" axis is dropped
    >>> shardings.master_params["w"].spec == (P("data") if n > 1 else P())
    True
    >>> shardings.master_params["b"].spec == shardings.inner_state[0].count.spec == P()
    True
    >>> opt_state = jax.jit(tx.init, out_shardings=shardings)(params)
    >>> opt_state.master_params["w"].sharding == shardings.master_params["w"]
    True
    >>> opt_state.master_params["w"].addressable_shards[0].data.shape == (48 // n, 3)
    True
  """
  if axis is not None and axis not in mesh.axis_names:
    raise ValueError(f"zero1_shardings: axis {axis!r} is not an axis of the mesh {mesh.shape}.")
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract_state = jax.eval_shape(tx.init, params)

  def spec(shape: tuple[int, ...], param: Any, fit_shape: tuple[int, ...]) -> NamedSharding:
    """The param's spec for a leaf of ``shape``, ``axis`` added to the first
    dimension of ``fit_shape`` it divides."""
    if not shape:
      return replicated
    entries = _param_spec(param, mesh, len(shape))
    if axis is None:
      return NamedSharding(mesh, _canonical(entries, mesh))
    return NamedSharding(mesh, _add_axis(fit_shape, entries, mesh, axis))

  def shard_like_param(leaf: Any, param: Any) -> Any:
    if tree_lib.is_placeholder(leaf):
      return leaf
    if isinstance(leaf, COMPRESSED_MOMENTS):
      # Every part (codes and block scales alike) gets one spec, chosen as if
      # the leaf's last axis were its blocks: a split of it then falls on
      # block boundaries, so no block straddles two devices. A last block cut
      # short never splits.
      parts: Any = leaf
      shape = fit_shape = tuple(parts[0].shape)
      if isinstance(leaf, (Signed8bitMoment, Nonnegative8bitMoment)):
        size, blocks = moment_codes.block_layout(shape)
        fit_shape = (*shape[:-1], blocks if size * blocks == shape[-1] else 1)
      return type(leaf)(*[spec(shape, param, fit_shape)] * len(parts))
    shape = tuple(getattr(leaf, "shape", ()))
    return spec(shape, param, shape)

  return optax.tree_utils.tree_map_params(
    tx,
    shard_like_param,
    abstract_state,
    params,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: tree_lib.is_placeholder(x) or isinstance(x, COMPRESSED_MOMENTS),
  )
