"""``all_finite``: one on-device flag saying a tree holds no inf or NaN.

The check runs on every step before any state is written, so its run time and
its compile time are part of the step's. How it is computed follows from six
measured facts about XLA (see docs/design.md):

1. XLA:CPU never fuses an elementwise producer into a reduction:
   ``isfinite(x).all()`` first writes a predicate per element (1 byte of
   scratch per parameter), then reduces it. A float32 ``sum`` of a bfloat16,
   float32 or float64 leaf is handed to a library kernel that reads the leaf
   once, at full bandwidth, with no scratch.
2. A sum is exact one way: inf and NaN propagate through addition, so a finite
   sum proves every element finite. Only a non-finite sum is ambiguous (finite
   values of a float32-range dtype may overflow), and only then, under a
   ``lax.cond``, is the exact ``sum(x - x)`` computed: ``x - x`` is 0 for
   every finite ``x`` and NaN for inf and NaN, so that sum never overflows.
3. XLA:CPU copies float16 to float32 before a sum, so float16 (and narrower)
   leaves are checked elementwise: large ones by AND-ing blocks of the leaf
   and reducing only what is left (1/16 byte of scratch per parameter).
4. Facts 1 to 3 are about a single CPU device. With several devices, and on
   accelerators, every leaf is checked with the plain ``isfinite(x).all()``:
   accelerators fuse it, and sums or blocks would add collectives across
   shards.
5. Per-leaf results are stacked behind an optimization barrier and tested in
   one kernel. Without the barrier XLA fuses every per-leaf reduction into the
   one fusion that combines them, and its fusion pass scans that fusion once
   per reduction: compile time grew quadratically with the number of leaves
   (minutes at a thousand).
6. Compile time grows with the number of kernels, so leaves of one shape share
   kernels, a few at a time: their values are added (or their ``isfinite``
   AND-ed) elementwise before one reduction. Model trees repeat shapes from
   layer to layer. The fast sums group small leaves only: for a large leaf a
   single-input sum is faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import skip
from mpx._src import tree as tree_lib

# float16 leaves are folded _FOLD_WIDTH-fold, twice where that leaves _MIN_FOLD_SIZE (fact 3).
_FOLD_WIDTH = 16
_MIN_FOLD_SIZE = _FOLD_WIDTH * 1024
# Leaves below _SMALL elements share kernels, _GROUP of one shape at a time (fact 6).
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
  if not _single_cpu_device():
    return _plain(on_device)
  # Facts 1 to 3 hold where the check is lowered for XLA:CPU; a process with
  # one CPU device may lower for another platform (ahead-of-time compilation).
  return jax.lax.platform_dependent(on_device, cpu=_single_cpu, default=_plain)


def _plain(leaves: list[jax.Array]) -> jax.Array:
  """``isfinite(x).all()`` per leaf (fact 4)."""
  return _all([jnp.isfinite(x).all() for x in leaves])


def _single_cpu(on_device: list[jax.Array]) -> jax.Array:
  """Sums where they are exact, folded flags for narrow dtypes (facts 1 to 3)."""
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
  """The AND of scalar flags, combined after a barrier (fact 5 above)."""
  if not flags:
    return jnp.asarray(True)
  if len(flags) == 1:
    return flags[0]
  return jax.lax.optimization_barrier(jnp.stack(flags)).all()


def _all_finite_values(values: list[jax.Array]) -> jax.Array:
  """Whether every scalar is finite: one isfinite over the stacked values
  (a kernel for all, not one per leaf), stacked behind a barrier (fact 5)."""
  if len(values) <= 1:
    return _all([jnp.isfinite(v) for v in values])
  by_dtype: dict[Any, list[jax.Array]] = {}
  for value in values:
    by_dtype.setdefault(jnp.dtype(value.dtype), []).append(value)
  return _all(
    [jnp.isfinite(jax.lax.optimization_barrier(jnp.stack(v))).all() for v in by_dtype.values()]
  )


def _float32_range(x: jax.Array) -> bool:
  """bfloat16, float32, float64: summed (fact 1), though finite values can
  overflow the sum (fact 2). Narrower dtypes are checked elementwise (fact 3)."""
  return float(jnp.finfo(x.dtype).max) > 2.0**100


def _groups(leaves: list[jax.Array], below: int | None) -> list[list[jax.Array]]:
  """Leaves in groups of up to ``_GROUP`` of one shape and dtype, if they have
  fewer than ``below`` elements (any, for None); larger leaves alone."""
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
  """Per group, the sum of ``term(x)`` added elementwise over the group's
  leaves, in float32 (or a wider dtype). Non-finite terms make it non-finite."""
  sums = []
  for group in _groups(leaves, below):
    dtype = jnp.promote_types(group[0].dtype, jnp.float32)
    total = term(group[0]).astype(dtype)
    for x in group[1:]:
      total = jax.lax.add(total, term(x).astype(dtype))  # lax: no nested jit per leaf
    sums.append(jnp.sum(total))
  return sums


def _elementwise_flags(leaves: list[jax.Array]) -> list[jax.Array]:
  """One flag per group of leaves of one shape, of any size (fact 6): folding
  keeps what is reduced at 1/_FOLD_WIDTH of the group's predicates."""
  return [_folded_finite(group) for group in _groups(leaves, None)]


def _single_cpu_device() -> bool:
  """Whether facts 1 to 3 above apply (see fact 4); not under the tests'
  ``MPX_TEST_GPU_FORM`` switch (``skip.gpu_form_on_cpu``)."""
  if skip.gpu_form_on_cpu():
    return False
  return jax.default_backend() == "cpu" and jax.device_count() == 1


def _folded_finite(group: list[jax.Array]) -> jax.Array:
  """``isfinite(x).all()`` for every leaf of a group of one shape.

  ``_FOLD_WIDTH`` parts are AND-ed elementwise before anything is reduced: the
  group's leaves, each cut into ``_FOLD_WIDTH // len(group)`` contiguous
  blocks, so what is left to reduce is a 1/_FOLD_WIDTH of one leaf's
  predicates (fact 3). A large leaf folds its result once more.
  """
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
  """The first ``_FOLD_WIDTH`` consecutive blocks of ``block`` elements."""
  return [flat[i * block : (i + 1) * block] for i in range(_FOLD_WIDTH)]


def _and_of_blocks(parts: list[jax.Array]) -> jax.Array:
  result = parts[0]
  for part in parts[1:]:
    result = result & part
  return result
