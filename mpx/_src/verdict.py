"""A step's verdict (every gradient finite as the inner rule receives it) and
the skip it steers (docs/design.md, "One verdict, and who computes it")."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import state_search
from mpx._src import tree as tree_lib
from mpx._src.states import MIXED_PRECISION_STATES


@dataclasses.dataclass(frozen=True)
class Unscaling:
  """What ``loss_scale`` hands the transformation it wraps directly, with the
  raw (still scaled) gradients: how to unscale them, and across which axis to
  agree on the verdict.

  Attributes:
    inverse_scale: float32 scalar, ``1 / loss_scale``.
    scale_at_least_one: whether the scale can never fall below 1 (then
      unscaling only shrinks values and cannot overflow).
    axis_name: the mapped axis (or axes) to reduce the verdict over, or None.
  """

  inverse_scale: jax.Array
  scale_at_least_one: bool
  axis_name: Any = None


# A pytree whose one array is the inverse scale, so that a jitted step takes
# it as an argument (run_if_finite).
jax.tree_util.register_dataclass(
  Unscaling, data_fields=["inverse_scale"], meta_fields=["scale_at_least_one", "axis_name"]
)


class TakesLossScaledGradients(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` that also takes the raw
  loss-scaled gradients: ``update_with_verdict(grads, state, params,
  unscaling, *, step_due=None, **extra_args)`` unscales them with an
  :class:`Unscaling`, decides the step's verdict itself and returns it,
  ``(updates, state, applied)``; a step not ``step_due`` (a scalar bool) is
  neither applied nor counted. ``update`` is the same step with no loss scale.
  :func:`mpx.mixed_precision` returns one; :func:`mpx.loss_scale` hands over
  to its inner transformation only if it is one (decided when it is built, so
  nothing can sit between the two)."""

  # No __slots__: an instance carries update_with_verdict beside optax's fields.
  update_with_verdict: Callable[..., tuple[Any, Any, jax.Array]]

  def __new__(
    cls, init: optax.TransformInitFn, update_with_verdict: Callable[..., tuple[Any, Any, jax.Array]]
  ) -> TakesLossScaledGradients:
    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
      new_updates, new_state, _ = update_with_verdict(updates, state, params, None, **extra_args)
      return new_updates, new_state

    transformation = super().__new__(cls, init, update)
    transformation.update_with_verdict = update_with_verdict
    return transformation

  def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle rebuild by __new__
    return (self.init, self.update_with_verdict)


def received(grad: Any, dtype: Any, unscaling: Unscaling | None) -> Any:
  """Returns a gradient leaf as the inner rule receives it: unscaled (in the wider of
  its dtype and float32) under a loss scale, then cast to ``dtype`` (None:
  kept). Non-floating leaves pass as they are."""
  if not tree_lib.is_floating(grad):
    return grad
  grad = jnp.asarray(grad)
  if unscaling is not None:
    wide = grad.astype(jnp.promote_types(grad.dtype, jnp.float32))
    inverse = jax.lax.convert_element_type(unscaling.inverse_scale, wide.dtype)
    # lax, not `*`: jnp's operators trace as a nested jit at every leaf.
    grad = jax.lax.mul(wide, jax.lax.broadcast_in_dim(inverse, wide.shape, ()))
  return grad if dtype is None else grad.astype(dtype)


def gradients_finite(grads: list[Any], dtypes: list[Any], unscaling: Unscaling | None) -> jax.Array:
  """Returns the verdict: whether every gradient is finite as ``received`` makes it
  with its ``dtypes`` entry, agreed across ``unscaling.axis_name``. Reads the
  raw gradient wherever receiving it cannot overflow: under a scale of at
  least 1, into a dtype of at least the gradient's range."""
  shrinks = unscaling is None or unscaling.scale_at_least_one
  to_check = []
  for grad, dtype in zip(grads, dtypes, strict=True):
    if not tree_lib.is_floating(grad):
      continue
    # As jax holds it: a host float64 gradient without x64 is float32 (1e300
    # is inf) when the rule receives it, and is judged so.
    grad = jnp.asarray(grad)
    narrows = dtype is not None and jnp.finfo(dtype).max < jnp.finfo(grad.dtype).max
    to_check.append(received(grad, dtype, unscaling) if narrows or not shrinks else grad)
  # The sums and folds read leaves whole: on several devices they would
  # gather leaves a mesh splits, so they are XLA:CPU's form on one device.
  finite = tree_lib.by_platform(
    to_check,
    cpu=_single_cpu,
    accelerator=lambda leaves: _all([jnp.isfinite(x).all() for x in leaves]),
    cpu_needs_one_device=True,
  )
  return agreed(finite, None if unscaling is None else unscaling.axis_name)


def agreed(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Returns ``finite`` AND-ed over ``axis_name`` (if any), so every replica agrees."""
  if axis_name is None:
    return finite
  return jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)


def all_finite(tree: tree_lib.PyTree) -> jax.Array:
  """Returns a scalar bool array: True iff no floating leaf holds inf or NaN.

  Non-floating leaves (integer counters, booleans) are ignored and an empty
  tree is finite. The result stays on device, so it can steer ``jnp.where`` or
  ``lax.cond`` inside ``jit`` without a host sync. Host values (numpy arrays,
  Python floats) are checked on the host as they are: made a jax array, a
  float64 value would first be narrowed to float32 (1e300 to inf). Device
  arrays are read as a step reads its gradients without a loss scale
  (``gradients_finite``).

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
  on_host = [x for x in leaves if isinstance(x, np.ndarray | np.generic | float)]
  if not all(bool(np.isfinite(x).all()) for x in on_host):
    return jnp.asarray(False)
  on_device = [x for x in leaves if not isinstance(x, np.ndarray | np.generic | float)]
  return gradients_finite(on_device, [None] * len(on_device), None)


def run_if_finite(
  finite: jax.Array,
  step: Callable[..., tuple[Any, Any]],
  state: Any,
  *args: Any,
  select: Callable[[jax.Array, Any, Any], Any] | None = None,
) -> tuple[Any, Any, jax.Array]:
  """Runs ``step(state, *args)`` where ``finite`` holds, else keeps ``state``.

  A ``lax.cond`` where the step is lowered for XLA:CPU (it runs only the
  branch taken), a select elsewhere (XLA:GPU would sync with the host for a
  conditional); both give the same bits. docs/design.md, "Two platforms, one
  step".

  Args:
    finite: scalar bool array.
    step: ``step(state, *args) -> (new_state, outputs)``, keeping the types
      of ``state``.
    state: what ``step`` updates; returned as it is on a skipped step.
    *args: further arguments of ``step`` (pytrees).
    select: ``select(finite, new_state, state)``, the select form's keep (by
      default ``jnp.where`` leaf by leaf).

  Returns:
    ``(new_state, outputs, applied)``: ``step``'s results, or ``state`` and
    zero ``outputs`` on a skipped step. ``applied`` equals ``finite``; on
    CPUs it is an output of the cond, so its uses after the cond do not each
    fuse a copy of the predicate (quadratic in the leaves).
  """
  # Both forms call the one jitted step with the same shapes: the step (the
  # inner rule) is traced once.
  on_arrays, arrays = on_array_arguments(step, args)
  return tree_lib.by_platform(
    finite,
    state,
    arrays,
    cpu=functools.partial(_by_cond, on_arrays),
    accelerator=functools.partial(_by_select, on_arrays, select),
  )


def on_array_arguments(
  fn: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], list[Any]]:
  """Returns ``(on_arrays, arrays)``: ``on_arrays(*leading, arrays)`` computes
  ``fn(*leading, *args)`` as one jitted program with every array of ``args``
  (pytrees) an argument, never a constant.

  Called eagerly, XLA folds constants in ways it never folds arguments
  (``c + (t - c)`` to ``t``), and an eager step would compute other bits than
  the same step under jit; under an outer jit the call is inlined.
  """
  flat, treedef = jax.tree.flatten(args)
  is_array = [isinstance(x, jax.Array | np.ndarray | np.generic) for x in flat]

  @jax.jit
  def on_arrays(*leading_and_arrays: Any) -> Any:
    *leading, arrays = leading_and_arrays
    given = iter(arrays)
    leaves = [next(given) if array else x for x, array in zip(flat, is_array, strict=True)]
    return fn(*leading, *jax.tree.unflatten(treedef, leaves))

  return on_arrays, [x for x, array in zip(flat, is_array, strict=True) if array]


def _by_cond(
  step: Callable[..., tuple[Any, Any]], finite: jax.Array, state: Any, arrays: list[Any]
) -> tuple[Any, Any, jax.Array]:
  # The shapes come from jit's cache: the step is traced once for both.
  # zeros_like keeps the sharding they record, as cond requires of both
  # branches on explicit meshes.
  outputs_like = jax.eval_shape(step, state, arrays)[1]
  return jax.lax.cond(
    finite,
    lambda state, arrays: (*step(state, arrays), jnp.asarray(True)),
    lambda state, _: (state, jax.tree.map(jnp.zeros_like, outputs_like), jnp.asarray(False)),
    state,
    arrays,
  )


def _by_select(
  step: Callable[..., tuple[Any, Any]],
  select: Callable[[jax.Array, Any, Any], Any] | None,
  finite: jax.Array,
  state: Any,
  arrays: list[Any],
) -> tuple[Any, Any, jax.Array]:
  new_state, outputs = step(state, arrays)
  if select is None:
    new_flat, treedef = jax.tree.flatten(new_state)
    kept = [jnp.where(finite, n, o) for n, o in zip(new_flat, jax.tree.leaves(state), strict=True)]
    new_state = jax.tree.unflatten(treedef, kept)
  else:
    new_state = select(finite, new_state, state)
  outputs_flat, outputs_def = jax.tree.flatten(outputs)
  zeroed = [jnp.where(finite, x, jnp.zeros_like(x)) for x in outputs_flat]
  return new_state, jax.tree.unflatten(outputs_def, zeroed), finite


def holds_mixed_precision(inner_state: Any) -> bool:
  """Returns whether ``inner_state`` holds a ``mixed_precision`` state, which records
  its own skips (at trace time: a question about the structure)."""
  return bool(state_search.find_states(inner_state, MIXED_PRECISION_STATES))


def no_skip_counted(old_inner: Any, new_inner: Any) -> jax.Array:
  """Returns whether no ``mixed_precision`` state in ``new_inner`` counted a skip
  since ``old_inner``: the verdicts they computed, as one flag. Comparing
  counts, not a last-step flag, reads a step that never reached them (a
  ``MultiSteps`` accumulation step) as applied."""
  old: list[Any] = state_search.find_states(old_inner, MIXED_PRECISION_STATES)
  new: list[Any] = state_search.find_states(new_inner, MIXED_PRECISION_STATES)
  same = [jnp.equal(a.nonfinite_steps, b.nonfinite_steps) for a, b in zip(old, new, strict=True)]
  return jnp.asarray(np.bool_(True)) if not same else jnp.stack(same).all()


# XLA:CPU's form of the check, on one device (docs/design.md, "The check"):
# it writes no predicate per element, which is a fifth of an fp16 or bf16
# AdamW step's time there (benchmarks/xla_cpu_figures.py).

# float16 leaves are folded _FOLD_WIDTH-fold, twice where that leaves _MIN_FOLD_SIZE.
_FOLD_WIDTH = 16
_MIN_FOLD_SIZE = _FOLD_WIDTH * 1024
# Leaves below _SMALL elements share kernels, _GROUP of one shape at a time.
_GROUP = 16
_SMALL = 1 << 16


def _single_cpu(on_device: list[jax.Array]) -> jax.Array:
  """Returns the single-CPU form: sums where they prove finiteness (leaves of
  float32's range or more: bfloat16, float32, float64), folded flags for the
  narrower dtypes."""
  wide: list[jax.Array] = []
  narrow: list[jax.Array] = []
  for x in on_device:
    (wide if float(jnp.finfo(x.dtype).max) > 2.0**100 else narrow).append(x)
  finite = _all([_folded_finite(group) for group in _groups(narrow, None)])
  if not wide:
    return finite
  # The sums of the leaves prove them finite unless one overflows: then (taken
  # only when some sum is inf or NaN) the sums of ``x - x``, NaN exactly where
  # an element is not finite, decide.
  return finite & jax.lax.cond(
    _sums_finite(wide, jnp.asarray, _SMALL),
    functools.partial(jnp.asarray, True),
    functools.partial(_sums_finite, wide, _minus_itself, None),
  )


def _minus_itself(x: jax.Array) -> jax.Array:
  """Returns ``x - x``: zero where ``x`` is finite, NaN elsewhere (lax: no nested jit)."""
  return jax.lax.sub(x, x)


def _all(flags: list[jax.Array]) -> jax.Array:
  """Returns the AND of scalar flags, stacked behind an optimization barrier:
  without it XLA fuses every leaf's reduction into the one fusion that
  combines them, and its fusion pass scans that fusion once per reduction
  (compile time quadratic in the leaves)."""
  if not flags:
    return jnp.asarray(True)
  if len(flags) == 1:
    return flags[0]
  return jax.lax.optimization_barrier(jnp.stack(flags)).all()


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


def _sums_finite(
  leaves: list[jax.Array], term: Callable[[jax.Array], jax.Array], below: int | None
) -> jax.Array:
  """Returns whether every group's sum of ``term(x)``, added elementwise over
  the group's leaves in float32 or wider, is finite (a non-finite term makes
  it non-finite): one ``isfinite`` per dtype over the sums, stacked behind a
  barrier."""
  sums = []
  for group in _groups(leaves, below):
    dtype = jnp.promote_types(group[0].dtype, jnp.float32)
    total = term(group[0]).astype(dtype)
    for x in group[1:]:
      total = jax.lax.add(total, term(x).astype(dtype))  # lax: no nested jit per leaf
    sums.append(jnp.sum(total))
  if len(sums) <= 1:
    return _all([jnp.isfinite(v) for v in sums])
  by_dtype: dict[Any, list[jax.Array]] = {}
  for value in sums:
    by_dtype.setdefault(jnp.dtype(value.dtype), []).append(value)
  return _all(
    [jnp.isfinite(jax.lax.optimization_barrier(jnp.stack(v))).all() for v in by_dtype.values()]
  )


def _folded_finite(group: list[jax.Array]) -> jax.Array:
  """Returns ``isfinite(x).all()`` over a group of leaves of one shape, AND-ing
  ``_FOLD_WIDTH`` blocks of the group's leaves elementwise before reducing
  (twice for a large leaf)."""
  flats = [jnp.reshape(x, -1) for x in group]
  blocks = max(1, _FOLD_WIDTH // len(flats))
  block = flats[0].size // blocks
  if block == 0:  # fewer elements than blocks
    return functools.reduce(operator.and_, [jnp.isfinite(flat) for flat in flats]).all()
  # isfinite is applied per block: XLA leaves one isfinite over the whole leaf
  # unfused, writing a predicate per element.
  parts = [jnp.isfinite(flat[i * block : (i + 1) * block]) for flat in flats for i in range(blocks)]
  folded = functools.reduce(operator.and_, parts)
  ok = jnp.asarray(True)
  if blocks * block < flats[0].size:  # fewer than `blocks` elements past the last block
    rests = [jnp.isfinite(flat[blocks * block :]) for flat in flats]
    ok = functools.reduce(operator.and_, rests).all()
  if folded.size >= _MIN_FOLD_SIZE:
    inner = folded.size // _FOLD_WIDTH
    ok &= folded[_FOLD_WIDTH * inner :].all()
    folded = functools.reduce(
      operator.and_, [folded[i * inner : (i + 1) * inner] for i in range(_FOLD_WIDTH)]
    )
  return ok & folded.all()
