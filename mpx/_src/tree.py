"""Pytree helpers: leaf types, holes, linen boxes, selection, casts of floating
leaves only, and the one question of which program a step is lowered to."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
# A predicate receives the leaf's path (``"layer/norm/scale"``) and the leaf.
LeafPredicate = Callable[[str, Any], bool]


def is_masked_node(leaf: Any) -> bool:
  """Returns whether ``leaf`` is the ``optax.MaskedNode`` that stands in a
  state's stored tree for a param with no master copy."""
  return isinstance(leaf, optax.MaskedNode)


def is_placeholder(leaf: Any) -> bool:
  """Returns whether ``leaf`` is None or an ``optax.MaskedNode``: a position
  that holds no array, compared as a leaf when two trees are lined up."""
  return leaf is None or isinstance(leaf, optax.MaskedNode)


def leaf_dtype(leaf: Any) -> Any:
  """Returns the dtype of an array-like leaf (PRNG keys give their extended
  dtype), or None for non-numeric leaves."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None:
    return dtype
  if isinstance(leaf, (bool, int, float, complex)):
    return jnp.asarray(leaf).dtype
  return None


def is_floating(leaf: Any) -> bool:
  """Returns True for real floating-point leaves (f64 ... fp8), else False."""
  dtype = leaf_dtype(leaf)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def path_str(path: tuple[Any, ...]) -> str:
  """Renders a pytree key path as ``"a/b/0"`` for predicates and messages."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def path_text(path: tuple[Any, ...]) -> str:
  """Renders a key path for a message: :func:`path_str`, ``"<root>"`` for the root."""
  return path_str(path) or "<root>"


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
  true_def: Any = jax.tree.structure(on_true)
  false_def: Any = jax.tree.structure(on_false)
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
    return saturating_cast(leaf, dtype) if saturate else leaf.astype(dtype)

  return map_floating(tree, cast, where)


def map_floating(
  tree: PyTree, fn: Callable[[Any], Any], where: LeafPredicate | PyTree | None = None
) -> PyTree:
  """Applies ``fn`` to the floating leaves of ``tree`` that ``where`` selects
  (as in :func:`cast_tree`); every other leaf stays as it is."""

  def apply(leaf):
    return fn(leaf) if is_floating(leaf) else leaf

  if where is None:
    return jax.tree.map(apply, tree)
  if callable(where):
    return jax.tree_util.tree_map_with_path(
      lambda path, leaf: apply(leaf) if where(path_str(path), leaf) else leaf, tree
    )
  return jax.tree.map(lambda keep, sub: jax.tree.map(apply, sub) if keep else sub, where, tree)


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
  return saturate(x, dtype).astype(dtype)


def saturate(x: Any, dtype: Any) -> jax.Array:
  """Clips the finite values of ``x`` to ``dtype``'s finite range, in ``x``'s
  dtype (inf and NaN stay)."""
  x = jnp.asarray(x)
  dtype = jnp.dtype(dtype)
  if jnp.finfo(dtype).max >= jnp.finfo(x.dtype).max:
    return x
  # lax, not jnp: this runs once per leaf per step, and jnp.clip traces as a
  # nested jit, which the step's trace and lowering pay for at every leaf.
  limit = np.asarray(jnp.finfo(dtype).max, x.dtype)
  clamped = jax.lax.clamp(-limit, x, limit)
  return jax.lax.select(jax.lax.is_finite(x), clamped, x)


def round_as(x: jax.Array, dtype: Any) -> jax.Array:
  """Returns ``x.astype(dtype).astype(x.dtype)`` for a float ``x`` within
  ``dtype``'s finite range (nearest, ties to even; inf and NaN stay), in a
  form XLA keeps for float16 and bfloat16.

  Example:
    >>> import jax.numpy as jnp
    >>> from mpx._src import tree
    >>> tree.round_as(jnp.float32(1e-3), jnp.float16).item()
    0.0010004043579101562
  """
  # Not the round trip itself: XLA:GPU's excess precision (on by default)
  # drops a convert to a narrower float and back inside a fusion.
  if jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
    # reduce_precision models IEEE formats only, not fp8's without inf.
    return x.astype(dtype).astype(x.dtype)
  narrow, wide = jnp.finfo(dtype), jnp.finfo(x.dtype)
  normal = jax.lax.reduce_precision(x, exponent_bits=narrow.nexp, mantissa_bits=narrow.nmant)
  if narrow.nexp >= wide.nexp:  # bfloat16 in float32: its subnormals are float32's
    return normal
  # reduce_precision flushes what lies below dtype's normals to zero; there
  # the values are whole multiples of its smallest subnormal (powers of two:
  # exact to scale by).
  scale = np.asarray(2.0 ** -np.log2(float(narrow.smallest_subnormal)), x.dtype)
  count = jax.lax.round(jax.lax.mul(x, scale), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
  small = jax.lax.div(count, scale)
  below = jax.lax.lt(jax.lax.abs(x), np.asarray(narrow.tiny, x.dtype))
  return jax.lax.select(below, small, normal)


def elementwise_max(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """Returns the elementwise maximum of two tuples of arrays, pair by pair: the
  computation of a variadic ``lax.reduce`` that takes several maxima at once."""
  return tuple(jax.lax.max(x, y) for x, y in zip(a, b, strict=True))


def strong_types(tree: PyTree) -> PyTree:
  """Makes every weakly typed array in ``tree`` strongly typed (same bits).
  A skip by select keeps each leaf's type, so a weak leaf of a rule's init,
  returned strong by its update, would make the second step compile again."""

  def strong(x: Any) -> Any:
    if isinstance(x, jax.Array) and getattr(jax.typeof(x), "weak_type", False):
      return jnp.asarray(x, x.dtype)
    return x

  return jax.tree.map(strong, tree)


def jitted_when_eager(fn: Callable[..., Any], static: Any, *arrays: Any) -> Any:
  """Returns ``fn(static, *arrays)``. Outside a trace (an eager ``init`` or
  ``mpx.master_params``) it is one jitted call, cached by ``fn``, ``static``
  (hashable) and the arrays' shapes: op by op, jax dispatches each operation
  alone and compiles it for each new shape. Under a trace, or given anything
  but jax arrays, ``fn`` is called as it is."""
  if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in arrays):
    return _jitted(fn, static, *arrays)
  return fn(static, *arrays)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jitted(fn: Callable[..., Any], static: Any, *arrays: jax.Array) -> Any:
  return fn(static, *arrays)


# Which program a step is lowered to: XLA:CPU's or the accelerators'
# (docs/design.md, "Two platforms, one step").


def by_platform(
  *operands: Any,
  cpu: Callable[..., Any],
  accelerator: Callable[..., Any],
  cpu_needs_one_device: bool = False,
) -> Any:
  """Returns ``cpu(*operands)`` in a program lowered for XLA:CPU, else
  ``accelerator(*operands)``.

  The platform the step is lowered for decides (``lax.platform_dependent``),
  never the process's devices: a CPU process compiles for an H100 ahead of
  time, a GPU process runs CPU programs too. ``cpu_needs_one_device`` keeps
  the accelerator form in a process of several devices, for CPU forms that
  read single elements of leaves a mesh may split (XLA would gather them).
  """
  if cpu_needs_one_device and jax.device_count() > 1:
    return accelerator(*operands)
  return jax.lax.platform_dependent(*operands, cpu=cpu, default=accelerator)


# optax.lookahead: the gradients mirror the fast weights of LookaheadParams.


def gradient_params(params: Any) -> Any:
  """Returns the part of ``params`` that gradients mirror: the fast weights of
  ``optax.lookahead``'s ``LookaheadParams``, else ``params``."""
  return params.fast if isinstance(params, optax.LookaheadParams) else params


# flax.linen's boxes (nn.Partitioned) around params, gradients and state leaves.


def through_linen_boxes(update_fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a ``mixed_precision`` ``update`` to take params, gradients and state
  in flax linen boxes (``nn.Partitioned``, e.g. a linen ``TrainState`` with
  ``nn.with_partitioning``) or nnx ``Variable``s (an ``nnx.State`` of them, as
  ``nnx.state(model, nnx.Param)`` gives it): it runs on the unboxed trees, and
  returns the updates boxed like the params and the state boxed like the
  state it got."""

  @functools.wraps(update_fn)
  def update(updates: Any, state: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    # has_linen_boxes inline: every step of every mode passes here.
    meta = sys.modules.get("flax.core.meta")  # flax not imported: no box to see
    if meta is None or params is None:
      return update_fn(updates, state, params, *args, **kwargs)
    nnx = sys.modules.get("flax.nnx")
    # From flax 0.12 an nnx Variable is a pytree node around its value, and
    # init fits each to the state leaf it holds (variables.fit_variables): a
    # compressed moment becomes a NamedTuple of Variables, which the step,
    # checking the state against what init makes of bare params, would refuse.
    boxes = (meta.AxisMetadata,) if nnx is None else (meta.AxisMetadata, nnx.Variable)
    is_box = lambda x: isinstance(x, boxes)  # noqa: E731
    if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
      return update_fn(updates, state, params, *args, **kwargs)
    new_updates, new_state, *rest = update_fn(
      without_linen_boxes(updates, is_box),
      without_linen_boxes(state, is_box),
      without_linen_boxes(params, is_box),
      *args,
      **kwargs,
    )
    return boxed_like(params, new_updates), boxed_like(state, new_state), *rest

  return update


def is_linen_box(x: Any) -> bool:
  """Tells whether ``x`` is a flax linen box (an ``AxisMetadata``); never
  without flax imported, where no box can exist."""
  meta = sys.modules.get("flax.core.meta")
  return meta is not None and isinstance(x, meta.AxisMetadata)


def has_linen_boxes(tree: Any) -> bool:
  """Tells whether ``tree`` holds a flax linen box."""
  return any(is_linen_box(x) for x in jax.tree.leaves(tree, is_leaf=is_linen_box))


def without_linen_boxes(tree: Any, is_box: Callable[[Any], bool] = is_linen_box) -> Any:
  """Returns ``tree`` with every flax linen box (or what ``is_box`` tells)
  replaced by what it holds."""
  return jax.tree.map(lambda x: unboxed(x) if is_box(x) else x, tree, is_leaf=is_box)


def boxed_like(boxed: Any, tree: Any) -> Any:
  """Returns the leaves of ``tree`` (an unboxed tree of ``boxed``'s shape) in
  ``boxed``'s boxes."""
  return jax.tree_util.tree_unflatten(jax.tree.structure(boxed), jax.tree.leaves(tree))


def unboxed(box: Any) -> Any:
  """Returns what a linen box (or an nnx ``Variable``) holds, with no sharding
  constraint (``nn.Partitioned`` applies one under a mesh)."""
  if hasattr(box, "get_value"):  # an nnx Variable
    return box.get_value()
  return box.value if hasattr(box, "value") else box.unbox()
