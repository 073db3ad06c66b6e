"""``all_finite``: one on-device flag saying a tree holds no inf or NaN.

The check runs on every step before any state is written, so its run time and
its compile time are part of the step's. How it is computed follows from five
measured facts about XLA (see docs/design.md):

1. XLA:CPU never fuses an elementwise producer into a reduction:
   ``isfinite(x).all()`` first writes a predicate per element (1 byte of
   scratch per parameter), then reduces it. A float32 ``sum`` of a bfloat16,
   float32 or float64 leaf is handed to a library kernel that reads the leaf
   once, at full bandwidth, with no scratch.
2. A sum is exact one way: inf and NaN propagate through addition, so a finite
   sum proves every element finite. Only a non-finite sum is ambiguous (finite
   bfloat16 or float32 values may overflow), and only then, under a
   ``lax.cond``, is the exact ``sum(x - x)`` computed: ``x - x`` is 0 for
   every finite ``x`` and NaN for inf and NaN, so that sum never overflows.
   float16 values (at most 65504) cannot overflow a float32 sum at all.
3. XLA:CPU copies float16 to float32 before a sum, so large float16 leaves
   (the loss-scaled path) are checked by AND-ing blocks of the leaf
   elementwise and reducing only what is left (1/16 byte of scratch per
   parameter); small ones are summed through the copy.
4. Facts 1 to 3 are about a single CPU device. With several devices, and on
   accelerators, every leaf is checked with the plain ``isfinite(x).all()``:
   accelerators fuse it, and sums or blocks would add collectives across
   shards.
5. Per-leaf results are stacked behind an optimization barrier and tested in
   one kernel. Without the barrier XLA fuses every per-leaf reduction into the
   one fusion that combines them, and its fusion pass scans that fusion once
   per reduction: compile time grew quadratically with the number of leaves
   (minutes at a thousand).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import tree as tree_lib

# A float16 leaf is folded when it has at least this many elements (fact 3).
_FOLD_WIDTH = 16
_MIN_FOLD_SIZE = _FOLD_WIDTH * 1024


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
    return _all([jnp.isfinite(x).all() for x in on_device])
  folded = [x for x in on_device if _folds(x)]
  may_overflow = [x for x in on_device if not _folds(x) and _sum_may_overflow(x)]
  exact = [x for x in on_device if not _folds(x) and not _sum_may_overflow(x)]
  finite = _all([_folded_finite(jnp.reshape(x, -1)) for x in folded])
  finite &= _all_finite_values([_sum(x) for x in exact])
  if not may_overflow:
    return finite
  # Taken only when some sum is inf or NaN: an overflow, or a non-finite element.
  return finite & jax.lax.cond(
    _all_finite_values([_sum(x) for x in may_overflow]),
    lambda: jnp.asarray(True),
    lambda: _all_finite_values([_sum(x - x) for x in may_overflow]),
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


def _sum(x: jax.Array) -> jax.Array:
  """The sum of ``x`` in float32, or in ``x``'s dtype where that is wider."""
  return jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))


def _folds(x: jax.Array) -> bool:
  """Large float16 (or narrower) leaves are folded: XLA:CPU would copy them to
  float32 before a sum (fact 3 above)."""
  return jnp.finfo(x.dtype).bits <= 16 and x.dtype != jnp.bfloat16 and x.size >= _MIN_FOLD_SIZE


def _sum_may_overflow(x: jax.Array) -> bool:
  """Whether finite values of ``x`` can sum to inf: those of a float32-range
  dtype can; float16 values (at most 65504) cannot, in float32, in any number."""
  return float(jnp.finfo(x.dtype).max) > 2.0**100


def _single_cpu_device() -> bool:
  """Whether facts 1 to 3 above apply (see fact 4)."""
  return jax.default_backend() == "cpu" and jax.device_count() == 1


def _folded_finite(flat: jax.Array) -> jax.Array:
  """``isfinite(flat).all()`` with two elementwise folds of ``_FOLD_WIDTH``
  contiguous blocks each before the reduction."""
  block = flat.size // _FOLD_WIDTH
  # Elements past the last whole block (fewer than _FOLD_WIDTH) are reduced apart.
  ok = jnp.isfinite(flat[_FOLD_WIDTH * block :]).all()
  # isfinite is applied per block: XLA leaves one isfinite over the whole leaf
  # unfused, writing a predicate per element.
  folded = _and_of_blocks([jnp.isfinite(part) for part in _blocks(flat, block)])
  if block >= _MIN_FOLD_SIZE:
    inner = block // _FOLD_WIDTH
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
