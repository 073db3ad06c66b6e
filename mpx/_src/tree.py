"""Pytree helpers for mixed precision: finite checks, selection and casting.

Only floating leaves are ever inspected or cast: integer step counters, booleans
and PRNG keys pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
# A predicate receives the leaf's path (``"layer/norm/scale"``) and the leaf.
LeafPredicate = Callable[[str, Any], bool]


def leaf_dtype(leaf: Any) -> Any:
  """The dtype of an array-like leaf (PRNG keys give their extended dtype), or
  None for non-numeric leaves."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None:
    return dtype
  if isinstance(leaf, (bool, int, float, complex)):
    return jnp.asarray(leaf).dtype
  return None


def is_floating(leaf: Any) -> bool:
  """True for real floating-point leaves (f64 ... fp8), False for all else."""
  dtype = leaf_dtype(leaf)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def float_bits(leaf: Any) -> int:
  """The width in bits of a floating leaf's dtype (64 ... 8)."""
  return jnp.finfo(leaf_dtype(leaf)).bits


def path_str(path: tuple[Any, ...]) -> str:
  """Renders a pytree key path as ``"a/b/0"`` for predicates and messages."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def all_finite(tree: PyTree) -> jax.Array:
  """Returns a scalar bool array: True iff no floating leaf holds inf or NaN.

  Non-floating leaves (integer counters, booleans) are ignored and an empty
  tree is finite. The result stays on device, so it can steer ``jnp.where`` or
  ``lax.cond`` inside ``jit`` without a host sync.

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
  """
  leaves = [x for x in jax.tree.leaves(tree) if is_floating(x)]
  # Host values (numpy arrays, Python floats) are checked as they are: made a
  # jax array, a float64 would first be narrowed to float32 (1e300 -> inf).
  host_finite = all(bool(np.isfinite(x).all()) for x in leaves if _on_host(x))
  leaves = [x for x in leaves if not _on_host(x)]
  if not leaves or not host_finite:
    return jnp.asarray(host_finite)
  if not _fold_on_this_backend():
    return jnp.stack([_reduced_finite(x) for x in leaves]).all()
  # XLA:CPU computes on bfloat16 through float32: slicing a bfloat16 leaf into
  # blocks writes a float32 copy of it first (a bitcast to float16, a float16
  # copy), and its max reduction may drop a NaN, so bfloat16 is reduced.
  return jnp.stack(
    [_reduced_finite(x) if x.dtype == jnp.bfloat16 else _folded_finite(x) for x in leaves]
  ).all()


def _on_host(leaf: Any) -> bool:
  return isinstance(leaf, (np.ndarray, np.generic, float))


# A leaf is checked by folding when it has at least this many elements.
_FOLD_WIDTH = 16
_MIN_FOLD_SIZE = _FOLD_WIDTH * 1024


def _fold_on_this_backend() -> bool:
  """Whether :func:`all_finite` folds large leaves before reducing them.

  XLA:CPU runs a reduction as one scalar loop, at a fraction of the memory
  bandwidth that its (vectorised, multi-threaded) elementwise loops reach, so
  on the CPU the check first ANDs contiguous blocks of a leaf elementwise and
  reduces only the 1/256 that is left. The blocks cut across how a leaf is laid
  out over devices, which would cost communication (or be refused for an
  explicitly sharded leaf), so with several devices, and on accelerators,
  whose reductions are fast, the plain reduction is used.
  """
  return jax.default_backend() == "cpu" and jax.device_count() == 1


def _reduced_finite(x: jax.Array) -> jax.Array:
  return jnp.isfinite(x).all()


def _folded_finite(x: jax.Array) -> jax.Array:
  """``isfinite(x).all()`` with two elementwise folds of ``_FOLD_WIDTH``
  contiguous blocks each before the reduction (see ``_fold_on_this_backend``)."""
  flat = x.reshape(-1)
  if flat.size < _MIN_FOLD_SIZE:
    return _reduced_finite(flat)
  block = flat.size // _FOLD_WIDTH
  # Elements past the last whole block (fewer than _FOLD_WIDTH) are reduced apart.
  ok = _reduced_finite(flat[_FOLD_WIDTH * block :])
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


def select_tree(pred: jax.typing.ArrayLike, on_true: PyTree, on_false: PyTree) -> PyTree:
  """Picks ``on_true`` where the scalar ``pred`` holds, else ``on_false``.

  Both trees must have the same structure, shapes and dtypes; every leaf is
  selected with ``jnp.where``, so the choice happens on device (jit-friendly,
  no host sync) and the chosen leaf is returned bit for bit.

  Args:
    pred: a scalar boolean (array or Python bool).
    on_true: tree returned where ``pred`` is True.
    on_false: tree returned where ``pred`` is False.

  Returns:
    A tree like ``on_true``.

  Raises:
    ValueError: if ``pred`` is not a scalar, or the trees' structures, shapes or
      dtypes differ.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> mpx.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  pred = jnp.asarray(pred)
  if pred.shape != ():
    raise ValueError(f"select_tree needs a scalar predicate, got shape {pred.shape}.")
  true_def = jax.tree.structure(on_true)
  false_def = jax.tree.structure(on_false)
  if true_def != false_def:
    raise ValueError(
      f"select_tree needs two trees of one structure, got {true_def} and {false_def}."
    )

  def select(path, a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(
        f"select_tree: leaf {path_str(path)!r} differs between the trees: "
        f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}."
      )
    return jnp.where(pred, a, b)

  return jax.tree_util.tree_map_with_path(select, on_true, on_false)


def cast_tree(
  tree: PyTree,
  dtype: jax.typing.DTypeLike,
  where: LeafPredicate | PyTree | None = None,
  *,
  saturate: bool = False,
) -> PyTree:
  """Casts the floating leaves of ``tree`` to ``dtype``; all other leaves stay.

  Integer counters, booleans and PRNG keys are never cast. ``where`` picks which
  floating leaves to cast, to keep e.g. normalisation layers in float32.

  Args:
    tree: a pytree (model parameters, a batch, an optimizer state).
    dtype: the floating target dtype, e.g. ``jnp.bfloat16``.
    where: optional selector of leaves to cast. Either a callable
      ``where(path, leaf) -> bool`` where ``path`` is the leaf's key path as
      ``"a/b/0"``, or a pytree of bools with the structure of ``tree`` (or a
      prefix of it), as for ``optax.masked``. Leaves it rejects keep their dtype.
    saturate: if True, finite values beyond the range of ``dtype`` become its
      largest finite value (with their sign) instead of inf, as when casting
      full-precision weights to fp16 for training.

  Returns:
    The cast tree, with the structure of ``tree``.

  Raises:
    ValueError: if ``dtype`` is not a floating dtype.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> params = {"dense": jnp.ones(2), "norm": jnp.ones(2), "step": jnp.int32(0)}
    >>> low = mpx.cast_tree(params, jnp.bfloat16, where=lambda path, x: "norm" not in path)
    >>> {k: str(v.dtype) for k, v in low.items()}
    {'dense': 'bfloat16', 'norm': 'float32', 'step': 'int32'}
  """
  dtype = require_floating_dtype(dtype, "dtype")

  def cast(leaf):
    if not is_floating(leaf):
      return leaf
    return saturating_cast(leaf, dtype) if saturate else leaf.astype(dtype)

  if where is None:
    return jax.tree.map(cast, tree)
  if callable(where):
    return jax.tree_util.tree_map_with_path(
      lambda path, leaf: cast(leaf) if where(path_str(path), leaf) else leaf, tree
    )
  return jax.tree.map(lambda keep, sub: jax.tree.map(cast, sub) if keep else sub, where, tree)


def require_floating_dtype(dtype: Any, name: str) -> np.dtype:
  """Returns ``np.dtype(dtype)`` or raises a ValueError naming the argument."""
  if dtype is None:  # numpy would read None as float64
    raise ValueError(f"{name} must be a floating dtype, got None.")
  try:
    resolved = np.dtype(jnp.dtype(dtype))
  except TypeError as error:
    raise ValueError(f"{name} must be a floating dtype, got {dtype!r}.") from error
  if not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(f"{name} must be a floating dtype such as jnp.float32, got {resolved}.")
  return resolved


def saturating_cast(x: Any, dtype: Any) -> jax.Array:
  """Rounds ``x`` to ``dtype``; finite values beyond its range become its
  largest finite value instead of inf. inf and NaN stay as they are."""
  x = jnp.asarray(x)
  dtype = jnp.dtype(dtype)
  if jnp.finfo(dtype).max >= jnp.finfo(x.dtype).max:
    return x.astype(dtype)
  limit = jnp.asarray(jnp.finfo(dtype).max, x.dtype)
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -limit, limit), x).astype(dtype)
