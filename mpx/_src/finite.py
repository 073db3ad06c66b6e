"""``all_finite``: one on-device flag saying a tree holds no inf or NaN.

The check runs before any state is written, so its run and compile time are the
step's. docs/design.md ("The check") gives the XLA facts behind each form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import lowering
from mpx._src import tree as tree_lib

# float16 leaves are folded _FOLD_WIDTH-fold, twice where that leaves _MIN_FOLD_SIZE.
_FOLD_WIDTH = 16
_MIN_FOLD_SIZE = _FOLD_WIDTH * 1024
# Leaves below _SMALL elements share kernels, _GROUP of one shape at a time.
_GROUP = 16
_SMALL = 1 << 16


def all_finite(tree: tree_lib.PyTree) -> jax.Array:
  """Returns a scalar bool array: True iff no floating leaf holds inf or NaN.

  Non-floating leaves (integer counters, booleans) are ignored and an empty
  tree is finite. The result stays on device, so it can steer ``jnp.where`` or
  ``lax.cond`` inside ``jit`` without a host sync. Host values (numpy arrays,
  Python floats) are checked on the host as they are: made a jax array, a
  float64 value would first be narrowed to float32 (1e300 to inf).

  Args:
    tree: any pytree of arrays.

  Returns:
    A boolean scalar ``jax.Array``.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> bool(mpx.all_finite({"w": jnp.ones(3), "step": jnp.int32(7)}))
    True
    >>> bool(mpx.all_finite({"w": jnp.array([1.0, jnp.inf])}))
    False
    >>> big = jnp.full(4, 3e38, jnp.bfloat16)  # finite, though its sum overflows
    >>> bool(mpx.all_finite(big))
    True
  """
  leaves = [x for x in jax.tree.leaves(tree) if tree_lib.is_floating(x)]
  on_host = [x for x in leaves if isinstance(x, (np.ndarray, np.generic, float))]
  if not all(bool(np.isfinite(x).all()) for x in on_host):
    return jnp.asarray(False)
  on_device = [x for x in leaves if not isinstance(x, (np.ndarray, np.generic, float))]
  # The sums and folds read leaves whole: on several devices they would
  # gather leaves a mesh splits, so they are XLA:CPU's form on one device.
  return lowering.by_platform(
    on_device, cpu=_single_cpu, accelerator=_plain, cpu_needs_one_device=True
  )


def _plain(leaves: list[jax.Array]) -> jax.Array:
  """Returns the AND of ``isfinite(x).all()`` over the leaves: the form for
  several devices and accelerators."""
  return _all([jnp.isfinite(x).all() for x in leaves])


def _single_cpu(on_device: list[jax.Array]) -> jax.Array:
  """Returns the single-CPU form: sums where they prove finiteness, folded
  flags for dtypes narrower than float32's range."""
  summed = [x for x in on_device if _float32_range(x)]
  finite = _all(_elementwise_flags([x for x in on_device if not _float32_range(x)]))
  if not summed:
    return finite
  # Taken only when some sum is inf or NaN: an overflow, or a non-finite element.
  return finite & jax.lax.cond(
    _all_finite_values(_sums(summed, lambda x: x, _SMALL)),
    lambda: jnp.asarray(True),
    lambda: _all_finite_values(_sums(summed, lambda x: jax.lax.sub(x, x), None)),
  )


def _all(flags: list[jax.Array]) -> jax.Array:
  """Returns the AND of scalar flags, stacked behind an optimization barrier."""
  if not flags:
    return jnp.asarray(True)
  if len(flags) == 1:
    return flags[0]
  return jax.lax.optimization_barrier(jnp.stack(flags)).all()


def _all_finite_values(values: list[jax.Array]) -> jax.Array:
  """Returns whether every scalar is finite: one ``isfinite`` per dtype over
  the values, stacked behind a barrier."""
  if len(values) <= 1:
    return _all([jnp.isfinite(v) for v in values])
  by_dtype: dict[Any, list[jax.Array]] = {}
  for value in values:
    by_dtype.setdefault(jnp.dtype(value.dtype), []).append(value)
  return _all(
    [jnp.isfinite(jax.lax.optimization_barrier(jnp.stack(v))).all() for v in by_dtype.values()]
  )


def _float32_range(x: jax.Array) -> bool:
  """Returns whether ``x`` has float32's range or more (bfloat16, float32,
  float64): such leaves are summed, the narrower ones checked elementwise."""
  return float(jnp.finfo(x.dtype).max) > 2.0**100


def _groups(leaves: list[jax.Array], below: int | None) -> list[list[jax.Array]]:
  """Groups leaves of one shape and dtype, up to ``_GROUP`` a group, where they
  have fewer than ``below`` elements (any, for None); larger leaves alone."""
  groups: list[list[jax.Array]] = []
  open_groups: dict[Any, list[jax.Array]] = {}
  for x in leaves:
    if below is not None and x.size >= below:
      groups.append([x])
      continue
    group = open_groups.setdefault((x.shape, jnp.dtype(x.dtype)), [])
    if not group:
      groups.append(group)
    group.append(x)
    if len(group) == _GROUP:
      del open_groups[(x.shape, jnp.dtype(x.dtype))]
  return groups


def _sums(
  leaves: list[jax.Array], term: Callable[[jax.Array], jax.Array], below: int | None
) -> list[jax.Array]:
  """Returns per group the sum of ``term(x)`` added elementwise over the
  group's leaves, in float32 or wider; a non-finite term makes it non-finite."""
  sums = []
  for group in _groups(leaves, below):
    dtype = jnp.promote_types(group[0].dtype, jnp.float32)
    total = term(group[0]).astype(dtype)
    for x in group[1:]:
      total = jax.lax.add(total, term(x).astype(dtype))  # lax: no nested jit per leaf
    sums.append(jnp.sum(total))
  return sums


def _elementwise_flags(leaves: list[jax.Array]) -> list[jax.Array]:
  """Returns one flag per group of leaves of one shape, of any size."""
  return [_folded_finite(group) for group in _groups(leaves, None)]


def _folded_finite(group: list[jax.Array]) -> jax.Array:
  """Returns ``isfinite(x).all()`` over a group of leaves of one shape, AND-ing
  ``_FOLD_WIDTH`` blocks of the group's leaves elementwise before reducing
  (twice for a large leaf)."""
  flats = [jnp.reshape(x, -1) for x in group]
  blocks = max(1, _FOLD_WIDTH // len(flats))
  block = flats[0].size // blocks
  if block == 0:  # fewer elements than blocks
    return _and_of_blocks([jnp.isfinite(flat) for flat in flats]).all()
  # isfinite is applied per block: XLA leaves one isfinite over the whole leaf
  # unfused, writing a predicate per element.
  parts = [jnp.isfinite(flat[i * block : (i + 1) * block]) for flat in flats for i in range(blocks)]
  folded = _and_of_blocks(parts)
  ok = jnp.asarray(True)
  if blocks * block < flats[0].size:  # fewer than `blocks` elements past the last block
    ok = _and_of_blocks([jnp.isfinite(flat[blocks * block :]) for flat in flats]).all()
  if folded.size >= _MIN_FOLD_SIZE:
    inner = folded.size // _FOLD_WIDTH
    ok &= folded[_FOLD_WIDTH * inner :].all()
    folded = _and_of_blocks(_blocks(folded, inner))
  return ok & folded.all()


def _blocks(flat: jax.Array, block: int) -> list[jax.Array]:
  """Returns the first ``_FOLD_WIDTH`` consecutive blocks of ``block`` elements."""
  return [flat[i * block : (i + 1) * block] for i in range(_FOLD_WIDTH)]


def _and_of_blocks(parts: list[jax.Array]) -> jax.Array:
  """Returns the elementwise AND of ``parts``."""
  result = parts[0]
  for part in parts[1:]:
    result = result & part
  return result
