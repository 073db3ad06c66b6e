"""``mixed_precision``: high-precision master weights inside the optimizer state.

The wrapped (inner) optax rule never sees a low-precision number: it is
initialised and updated on the *master view* of the parameters, i.e. a
``dtype`` master copy for every floating leaf narrower than ``dtype`` and the
parameter itself for every other leaf. The updates returned move each
low-precision parameter exactly onto its rounded master.

One step, top to bottom (see docs/design.md): validate the inputs, align
gradients, params and masters leaf by leaf, check the gradients, run the inner
rule on the masters inside one ``lax.cond`` (masters and moments are then
written in place), and derive the rounded updates after the cond, where they
fuse into ``optax.apply_updates``.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import skip, state_search, validation
from mpx._src import tree as tree_lib
from mpx._src.finite import all_finite
from mpx._src.states import LossScaledGradients, LossScaleState, MixedPrecisionState


class MixedPrecisionTransformation(optax.GradientTransformationExtraArgs):
  """The ``optax.GradientTransformationExtraArgs`` that :func:`mixed_precision`
  returns. Its type is how :func:`mpx.loss_scale` recognises, when it is built,
  a ``mixed_precision`` it wraps directly, and hands it the raw gradients with
  a :class:`~mpx._src.states.LossScaledGradients` (``update``'s
  ``loss_scaled=`` keyword) instead of unscaling them itself."""

  __slots__ = ()


@dataclasses.dataclass(frozen=True)
class _Leaves:
  """Gradients, params and masters of one step, aligned leaf for leaf (holes
  included), with the structure to rebuild trees from lists."""

  treedef: Any
  grads: list[Any]
  params: list[Any]
  masters: list[Any]

  @classmethod
  def align(cls, grads: Any, params: Any, masters: Any) -> _Leaves:
    masters_flat, treedef = jax.tree.flatten(masters, is_leaf=tree_lib.no_master)
    return cls(treedef, treedef.flatten_up_to(grads), treedef.flatten_up_to(params), masters_flat)

  def master_view(self, masters: list[Any]) -> Any:
    """The masters where they exist, the params elsewhere, as a tree."""
    return _master_view(self.treedef.unflatten(masters), self.treedef.unflatten(self.params))


def _master_view(masters: Any, params: Any) -> Any:
  """The masters where they exist, the params elsewhere."""
  return jax.tree.map(
    lambda m, p: p if tree_lib.no_master(m) else m, masters, params, is_leaf=tree_lib.no_master
  )


def mixed_precision(
  inner: optax.GradientTransformation,
  dtype: jax.typing.DTypeLike = jnp.float32,
) -> MixedPrecisionTransformation:
  """Keeps ``dtype`` master weights and runs ``inner`` on them.

  Every floating parameter narrower than ``dtype`` (bf16, fp16, fp8 with the
  default float32) gets a master copy in the optimizer state. Leaves already at
  ``dtype`` or wider are updated directly, with no copy, and never downcast (f64
  stays f64); non-floating leaves are left alone. ``inner`` is initialised and
  updated on the master view, so its whole state is in ``dtype``.

  ``update`` casts the gradients to the master dtype, runs ``inner``, applies
  its updates to the masters and returns, for each low-precision leaf,
  ``round(new_master) - param`` in ``dtype``. Hence
  ``optax.apply_updates(params, updates)`` lands every such leaf exactly on
  ``new_master`` rounded to the leaf's dtype (saturating at its largest finite
  value instead of overflowing to inf). The one exception is the exponent-gap
  corner: when the rounded master is more than ``2**(p_dtype - p_leaf)`` times
  smaller in magnitude than the current parameter (``2**16`` for bf16,
  ``2**13`` for fp16, with ``p`` the significand bits), ``param + update`` is
  itself rounded in ``dtype`` and the parameter lands within two ``dtype``
  ulps of the parameter's old magnitude from the target (a property test
  checks this bound). The master is exact
  regardless, and the next update targets it again.

  A step whose gradients hold inf or NaN returns zero updates and leaves the
  masters and the inner state bitwise unchanged (counts and schedules do not
  advance). Wrap this in :func:`mpx.loss_scale` for fp16, which also backs the
  loss scale off on such steps.

  Args:
    inner: the optax rule to run in high precision, e.g. ``optax.adamw(3e-4)``
      or an ``optax.chain``.
    dtype: the floating dtype of the masters and of the inner rule.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MixedPrecisionState`. Its ``update`` requires ``params`` and
    forwards extra keyword arguments to ``inner``; ``loss_scaled=`` is
    reserved for the :func:`mpx.loss_scale` that wraps it.

  Raises:
    ValueError: if ``dtype`` is not a floating dtype.
    TypeError: if ``inner`` is not a gradient transformation.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> tx = mpx.mixed_precision(optax.sgd(1e-3))
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> for _ in range(4):  # 4 steps of 1e-3: each alone is below bf16's ulp
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(state.master_params["w"][0]), 6)
    0.996
    >>> params["w"].dtype, float(params["w"][0])  # plain bf16 SGD stays at 1.0
    (dtype(bfloat16), 0.99609375)
  """
  dtype = tree_lib.require_floating_dtype(dtype, "dtype")
  validation.check_transformation(inner)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> MixedPrecisionState:
    masters = _make_masters(params, dtype)
    inner_state = inner.init(_master_view(masters, params))
    _refuse_loss_scale_inside(inner_state)
    return MixedPrecisionState(master_params=masters, inner_state=inner_state)

  def update_fn(
    updates: optax.Updates,
    state: MixedPrecisionState,
    params: optax.Params | None = None,
    *,
    loss_scaled: LossScaledGradients | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, MixedPrecisionState]:
    # 1. Validate (at trace time: costs the step nothing).
    _check_update_inputs(updates, state, params, dtype, init_fn)
    # 2. Align gradients, params and masters leaf by leaf.
    leaves = _Leaves.align(updates, params, state.master_params)
    # 3. Check: loss_scale's verdict if it handed one over, else the gradients.
    finite = _step_is_finite(leaves, loss_scaled, dtype)
    # 4. Step on the masters inside one cond: skipped, nothing is written.
    step = _step_on_masters(inner, dtype, leaves, loss_scaled, extra_args)
    (new_masters, new_inner), hole_updates, applied = skip.apply_if_finite(
      finite, step, (leaves.masters, state.inner_state), leaves.grads
    )
    # 5. Rounded updates, after the cond: they fuse into optax.apply_updates.
    hole_updates = iter(hole_updates)
    flat_updates = [
      next(hole_updates) if tree_lib.no_master(m) else _rounded_update(m, p, applied, dtype)
      for m, p in zip(new_masters, leaves.params, strict=True)
    ]
    new_state = MixedPrecisionState(leaves.treedef.unflatten(new_masters), new_inner)
    return leaves.treedef.unflatten(flat_updates), new_state

  return MixedPrecisionTransformation(init_fn, update_fn)


def _needs_master(leaf: Any, dtype: Any) -> bool:
  """Floating leaves narrower than the master dtype get a master copy."""
  return tree_lib.is_floating(leaf) and tree_lib.float_bits(leaf) < jnp.finfo(dtype).bits


def _make_masters(params: Any, dtype: Any) -> Any:
  """A ``dtype`` copy of every param that needs one, ``MaskedNode`` elsewhere."""
  # Checked here, not at construction: x64 may be switched on in between.
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise ValueError(
      f"mixed_precision: dtype {dtype} needs jax_enable_x64 (JAX would truncate "
      f"the masters to {jax.dtypes.canonicalize_dtype(dtype)})."
    )
  seed = _master_seed()

  def make_master(leaf):
    if not _needs_master(leaf, dtype):
      return optax.MaskedNode()
    return jnp.asarray(seed(leaf)).astype(dtype)

  return jax.tree.map(make_master, params)


def _refuse_loss_scale_inside(inner_state: Any) -> None:
  if state_search.find_states(inner_state, LossScaleState):
    raise ValueError(
      "mixed_precision wraps a loss_scale: on an overflow its skip would roll "
      "the loss-scale state back, so the scale could never back off. Nest them "
      "the other way: mpx.loss_scale(mpx.mixed_precision(inner))."
    )


def _check_update_inputs(
  grads: Any,
  state: Any,
  params: Any,
  dtype: Any,
  init_fn: Callable[[Any], MixedPrecisionState],
) -> None:
  """Every input of ``update`` against the others, naming the leaf and the fix."""
  if params is None:
    raise ValueError(
      "mixed_precision needs the current params: call tx.update(grads, opt_state, params)."
    )
  if not isinstance(state, MixedPrecisionState):
    raise TypeError(
      "mixed_precision.update got a state of type "
      f"{type(state).__name__}, not MixedPrecisionState: pass the state made "
      "by this transformation's init."
    )

  def mismatch(masters_def, params_def):
    return ValueError(
      "mixed_precision: params do not match the optimizer state (was the state "
      f"made by init on another tree?).\n  state: {masters_def}\n  params: {params_def}"
    )

  for path, master, param in validation.zip_leaves(state.master_params, params, mismatch):
    if tree_lib.no_master(master) and _needs_master(param, dtype):
      raise ValueError(
        f"mixed_precision: param {path!r} is {validation.describe(param)} but the state "
        "holds no master for it (the state was initialised on wider params). "
        "Re-initialise, or use mpx.init_from_full_precision to start "
        "low-precision training from full-precision weights."
      )
    if not tree_lib.no_master(master) and np.shape(master) != np.shape(param):
      raise ValueError(
        f"mixed_precision: param {path!r} has shape {list(np.shape(param))} but "
        f"its master has shape {list(np.shape(master))}."
      )
  validation.check_state_like("mixed_precision", state, jax.eval_shape(init_fn, params))
  validation.check_grads_match_params("mixed_precision", grads, params)


def _step_is_finite(
  leaves: _Leaves, loss_scaled: LossScaledGradients | None, dtype: Any
) -> jax.Array:
  """Whether to apply the step.

  Under a ``loss_scale`` that handed over, its verdict on the raw gradients,
  else a check of every gradient. Either way, a gradient wider than the masters
  (float64 for float32 masters, an unscaled float32 one for float16 masters)
  is also checked as cast to ``dtype``, which may overflow where it did not.
  """
  to_check = []
  for grad, master in zip(leaves.grads, leaves.masters, strict=True):
    if not tree_lib.is_floating(grad):
      continue
    # Unscaled, a floating gradient is float32: no unscaling op just to ask.
    bits = tree_lib.float_bits(grad) if loss_scaled is None else 32
    if not tree_lib.no_master(master) and bits > jnp.finfo(dtype).bits:
      seen = grad if loss_scaled is None else loss_scaled.unscale(grad)
      to_check.append(jnp.asarray(seen).astype(dtype))
    elif loss_scaled is None:
      to_check.append(grad)
  finite = all_finite(to_check)  # True for an empty list
  return finite if loss_scaled is None else jnp.logical_and(loss_scaled.finite, finite)


def _step_on_masters(
  inner: optax.GradientTransformationExtraArgs,
  dtype: Any,
  leaves: _Leaves,
  loss_scaled: LossScaledGradients | None,
  extra_args: dict[str, Any],
) -> Callable[..., tuple[Any, list[Any]]]:
  """The applied branch: ``step((masters, inner_state), grads)`` returns the
  new masters and inner state, and the updates of the leaves without a master
  (only those leave the cond; the others are derived from the new masters)."""

  def step(state, grads):
    masters, inner_state = state
    # Unscaled and cast here, inside the cond, so the float32 copies fuse into
    # the update instead of entering the cond as buffers.
    if loss_scaled is not None:
      grads = [loss_scaled.unscale(g) for g in grads]
    grads = [
      g if tree_lib.no_master(m) else g.astype(dtype) for g, m in zip(grads, masters, strict=True)
    ]
    inner_updates, new_inner = inner.update(
      leaves.treedef.unflatten(grads), inner_state, leaves.master_view(masters), **extra_args
    )
    validation.check_state_types_kept("mixed_precision", new_inner, inner_state)
    flat_updates = leaves.treedef.flatten_up_to(inner_updates)
    new_masters = [
      m if tree_lib.no_master(m) else _add_in(dtype, m, u)
      for m, u in zip(masters, flat_updates, strict=True)
    ]
    hole_updates = [u for m, u in zip(masters, flat_updates, strict=True) if tree_lib.no_master(m)]
    return (new_masters, new_inner), hole_updates

  return step


def _add_in(dtype: Any, master: jax.Array, update: Any) -> jax.Array:
  """``(master + update).astype(dtype)``; lax where the dtypes agree, since
  ``+`` on tracers traces as a nested jit at every leaf."""
  if jnp.result_type(update) == master.dtype:
    return jax.lax.add(master, update)
  return (master + update).astype(dtype)


def _rounded_update(new_master: jax.Array, param: Any, applied: jax.Array, dtype: Any) -> jax.Array:
  """The update that moves ``param`` onto ``new_master`` rounded to its dtype
  (saturating), zero on a skipped step."""
  param = jnp.asarray(param)
  target = tree_lib.saturating_cast(new_master, param.dtype)
  delta = jax.lax.sub(target.astype(dtype), param.astype(dtype))
  return jax.lax.select(applied, delta, jax.lax.full_like(delta, 0))


def master_params(opt_state: optax.OptState, params: tree_lib.PyTree) -> tree_lib.PyTree:
  """The full-precision view of the model held by ``opt_state``.

  Returns ``params`` with every leaf that has a master in some
  :class:`MixedPrecisionState` of ``opt_state`` (at any depth: chain,
  ``MultiSteps``, ``inject_hyperparams``, ``partition``) replaced by that
  master. Use it for evaluation, export and checkpoints. Where ``opt_state``
  holds no mixed-precision state, ``params`` is returned as is.

  Args:
    opt_state: an optimizer state containing :func:`mixed_precision` states.
    params: the low-precision parameters the state was used with.

  Returns:
    A tree with the structure of ``params``.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(2, jnp.bfloat16), "b": jnp.zeros(2)}
    >>> state = mpx.mixed_precision(optax.adam(1e-3)).init(params)
    >>> {k: str(v.dtype) for k, v in mpx.master_params(state, params).items()}
    {'b': 'float32', 'w': 'float32'}
  """
  result = params
  for state in state_search.find_states(opt_state, MixedPrecisionState):
    try:
      result = _master_view(state.master_params, result)
    except ValueError as error:
      raise ValueError("master_params: params do not match the masters in opt_state.") from error
  return result


# --- Seeding masters from full-precision values (init_from_full_precision) -----------
#
# optax's init(params) has no channel for a second tree, so
# init_from_full_precision publishes, for the one tx.init call it makes, the
# full-precision value of each low-precision leaf it passes in, keyed by that
# leaf's identity: whatever wrappers sit between it and a mixed_precision
# (chain, masked, partition, MultiSteps) hand the same leaf objects down, so
# identity finds the exact source even where the tree was reshaped on the way,
# which key paths would not. See docs/design.md.


class _MasterSources:
  """Full-precision values keyed by the low-precision leaves made from them."""

  def __init__(self, pairs: list[tuple[Any, Any, str]]):
    # Holding the low leaves keeps their ids from being reused meanwhile.
    self._by_id = {id(low): (low, full, path) for low, full, path in pairs}
    self._unused = set(self._by_id)

  def take(self, leaf: Any) -> Any:
    entry = self._by_id.get(id(leaf))
    if entry is None:
      return leaf
    self._unused.discard(id(leaf))
    return entry[1]

  def unused_paths(self) -> list[str]:
    return sorted(self._by_id[i][2] for i in self._unused)


_MASTER_SOURCES: contextvars.ContextVar[_MasterSources | None] = contextvars.ContextVar(
  "mpx_master_sources", default=None
)


def _master_seed() -> Callable[[Any], Any]:
  """What a master is made from: the full-precision source of a leaf while
  init_from_full_precision runs tx.init, else the leaf itself."""
  sources = _MASTER_SOURCES.get()
  return (lambda leaf: leaf) if sources is None else sources.take


def init_from_full_precision(
  tx: optax.GradientTransformation,
  params: tree_lib.PyTree,
  param_dtype: jax.typing.DTypeLike,
  where: tree_lib.LeafPredicate | tree_lib.PyTree | None = None,
) -> tuple[tree_lib.PyTree, optax.OptState]:
  """Starts low-precision training from full-precision weights, losing no bit.

  Casts ``params`` (e.g. FP32 weights restored from a checkpoint) to
  ``param_dtype`` with :func:`mpx.cast_tree` (saturating: a weight beyond the
  fp16 range becomes 65504, not inf) and initialises ``tx`` on the
  result, but seeds every master copy from the *original* value, so each
  master equals the checkpoint bit for bit (``tx.init`` on cast params could
  only recover the rounded value). The inner rules are initialised on those
  exact masters too.

  Args:
    tx: the full transformation, containing one or more
      :func:`mixed_precision` (at any depth).
    params: full-precision parameters.
    param_dtype: the low-precision dtype to train the model in.
    where: which floating leaves to cast, as in :func:`mpx.cast_tree`.

  Returns:
    ``(low_precision_params, opt_state)``.

  Raises:
    ValueError: if some cast leaf gets no master from ``tx`` (no
      ``mixed_precision`` covers it, or its ``dtype`` is not wider than
      ``param_dtype``): its low bits would be lost. The message names the
      leaves.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> full = {"w": jnp.array([1.0 + 2.0**-20])}  # not representable in bf16
    >>> tx = mpx.mixed_precision(optax.adam(1e-3))
    >>> params, state = mpx.init_from_full_precision(tx, full, jnp.bfloat16)
    >>> params["w"].dtype, bool(state.master_params["w"][0] == full["w"][0])
    (dtype(bfloat16), True)
  """
  validation.check_transformation(tx, "tx")
  low = tree_lib.cast_tree(params, param_dtype, where, saturate=True)
  low_with_paths, _ = jax.tree_util.tree_flatten_with_path(low)
  pairs = [
    (low_leaf, full_leaf, tree_lib.path_str(path))
    for (path, low_leaf), full_leaf in zip(low_with_paths, jax.tree.leaves(params), strict=True)
    if low_leaf is not full_leaf
  ]
  sources = _MasterSources(pairs)
  token = _MASTER_SOURCES.set(sources)
  try:
    opt_state = tx.init(low)
  finally:
    _MASTER_SOURCES.reset(token)
  unused = sources.unused_paths()
  if unused:
    raise ValueError(
      f"init_from_full_precision: {len(unused)} leaves cast to "
      f"{np.dtype(param_dtype)} got no master copy from tx, so their "
      f"full-precision bits would be lost: {', '.join(unused[:10])}"
      f"{' ...' if len(unused) > 10 else ''}. Wrap the rule for them in "
      "mpx.mixed_precision with a dtype wider than param_dtype, or keep them "
      "in full precision with `where`."
    )
  return low, opt_state
