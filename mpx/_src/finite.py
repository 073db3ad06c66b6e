"""``all_finite``: one on-device flag saying a tree holds no inf or NaN.

The check runs on every step before any state is written, so its run time and
its compile time are part of the step's. How it is computed follows from four
measured facts about XLA (see docs/design.md):

1. XLA:CPU never fuses an elementwise producer into a reduction:
   ``isfinite(x).all()`` first writes a predicate per element (1 byte of
   scratch per parameter), then reduces it. A float32 ``sum`` of a bfloat16,
   float32 or float64 leaf is handed to a library kernel that reads the leaf
   once, at full bandwidth, with no scratch.
2. A sum is exact one way: inf and NaN propagate through addition, so a finite
   sum proves every element finite. Only a non-finite sum is ambiguous (finite
   values may overflow), and only then, under a ``lax.cond``, is the exact
   ``sum(x - x)`` computed: ``x - x`` is 0 for every finite ``x`` and NaN for
   inf and NaN, so that sum never overflows.
3. XLA:CPU converts float16 with a full copy before any sum, so float16 leaves
   (the loss-scaled path) are checked by AND-ing blocks of the leaf
   elementwise and reducing only what is left (1/16 byte of scratch per
   parameter).
4. Facts 1 to 3 are about a single CPU device. With several devices, and on
   accelerators, every leaf is checked with the plain ``isfinite(x).all()``:
   accelerators fuse it, and sums or blocks would add collectives across
   shards.
5. The per-leaf flags are stacked behind an optimization barrier. Without it
   XLA fuses every per-leaf reduction into the one fusion that combines them,
   and its fusion pass scans that fusion once per reduction: compile time grew
   quadratically with the number of leaves (minutes at a thousand).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import tree as tree_lib

# Leaves a float32 (or wider) sum reads without a copy; see fact 1 above.
_SUMMED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))
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
  summed = [x for x in on_device if jnp.dtype(x.dtype) in _SUMMED_DTYPES]
  others = [x for x in on_device if jnp.dtype(x.dtype) not in _SUMMED_DTYPES]
  finite = _all([_elementwise_finite(x) for x in others])
  if not summed:
    return finite
  sums_finite = _all([jnp.isfinite(_sum(x)) for x in summed])
  # Taken only when some sum is inf or NaN: an overflow, or a non-finite element.
  exact = jax.lax.cond(
    sums_finite,
    lambda: jnp.asarray(True),
    lambda: _all([jnp.isfinite(_sum(x - x)) for x in summed]),
  )
  return finite & exact


def _all(flags: list[jax.Array]) -> jax.Array:
  """The AND of scalar flags, combined after a barrier (fact 5 above)."""
  if not flags:
    return jnp.asarray(True)
  if len(flags) == 1:
    return flags[0]
  return jax.lax.optimization_barrier(jnp.stack(flags)).all()


def _sum(x: jax.Array) -> jax.Array:
  """The sum of ``x`` in float32, or in ``x``'s dtype where that is wider."""
  return jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))


def _elementwise_finite(x: jax.Array) -> jax.Array:
  """``isfinite(x).all()``, with large leaves folded first (fact 3 above)."""
  x = jnp.asarray(x)
  if x.size < _MIN_FOLD_SIZE:
    return jnp.isfinite(x).all()
  return _folded_finite(x.reshape(-1))


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
