"""``mixed_precision``: high-precision master weights inside the optimizer state.

The wrapped (inner) optax rule never sees a low-precision number: it is
initialised and updated on the *master view* of the parameters, i.e. the
``dtype`` master of every floating leaf narrower than ``dtype`` and the
parameter itself for every other leaf. The updates returned move each
low-precision parameter exactly onto its rounded master. How the masters are
stored (a full copy, an exact 16-bit remainder, or not at all, with stochastic
rounding) is the ``masters`` mode; :mod:`mpx._src.masters` holds what differs.

One step, top to bottom (see docs/design.md): validate the inputs, align
gradients, params and stored masters leaf by leaf, check the gradients, run
the inner rule on the masters inside one ``lax.cond`` (what is stored is then
written in place), and derive the rounded updates after the cond, where they
fuse into ``optax.apply_updates``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import masters as masters_lib
from mpx._src import rounding, skip, state_search, validation
from mpx._src import tree as tree_lib
from mpx._src.finite import all_finite
from mpx._src.masters import MixedPrecisionRemainderState, MixedPrecisionStochasticState
from mpx._src.states import LossScaledGradients, LossScaleState, MixedPrecisionState

_STATE_TYPES = {
  "full": MixedPrecisionState,
  "remainder": MixedPrecisionRemainderState,
  "stochastic": MixedPrecisionStochasticState,
}
_ANY_STATE = tuple(_STATE_TYPES.values())
# The field of each state that holds the param-shaped tree of what is stored
# (masters, remainders or random-bit keys), and the kind that reads it back
# (its ``view``) for every leaf with something stored.
_STORED_FIELD = {
  MixedPrecisionState: "master_params",
  MixedPrecisionRemainderState: "master_remainders",
  MixedPrecisionStochasticState: "rounding_keys",
}
_VIEW_KIND = {
  MixedPrecisionState: masters_lib.Copy(),
  MixedPrecisionRemainderState: masters_lib.Remainder(),
  MixedPrecisionStochasticState: masters_lib.Stochastic(),
}


class MixedPrecisionTransformation(optax.GradientTransformationExtraArgs):
  """The ``optax.GradientTransformationExtraArgs`` that :func:`mixed_precision`
  returns. Its type is how :func:`mpx.loss_scale` recognises, when it is built,
  a ``mixed_precision`` it wraps directly, and hands it the raw gradients with
  a :class:`~mpx._src.states.LossScaledGradients` (``update``'s
  ``loss_scaled=`` keyword) instead of unscaling them itself."""

  __slots__ = ()


def _stored(state: Any) -> Any:
  """The param-shaped tree a state stores: masters, remainders or keys."""
  return getattr(state, _STORED_FIELD[type(state)])


@dataclasses.dataclass(frozen=True)
class _Leaves:
  """One step's params and stored masters, aligned leaf for leaf (``MaskedNode``
  where a param has nothing stored), with each leaf's storage kind and the
  structure to rebuild trees from lists; and the gradients, aligned with the
  params they mirror (all of them, or ``optax.lookahead``'s fast weights)."""

  treedef: Any
  kinds: list[Any]
  params: list[Any]
  stored: list[Any]
  grads: list[Any]
  grad_treedef: Any
  grad_kinds: list[Any]
  grad_params: list[Any]

  @classmethod
  def align(cls, mode: str, dtype: Any, grads: Any, params: Any, stored: Any) -> _Leaves:
    flat, structure = jax.tree_util.tree_flatten_with_path(stored, is_leaf=tree_lib.no_master)
    treedef: Any = structure
    params_flat = treedef.flatten_up_to(params)
    kinds = _kinds(mode, dtype, [path for path, _ in flat], params_flat)
    stored_flat = [s for _, s in flat]
    mirrored = validation.gradient_params(params)
    if mirrored is params:
      grad_treedef, grad_kinds, grad_params = treedef, kinds, params_flat
    else:
      grad_flat, grad_treedef = jax.tree_util.tree_flatten_with_path(mirrored)
      grad_params = [p for _, p in grad_flat]
      grad_kinds = _kinds(mode, dtype, [path for path, _ in grad_flat], grad_params)
    grads_flat = grad_treedef.flatten_up_to(grads)
    return cls(
      treedef, kinds, params_flat, stored_flat, grads_flat, grad_treedef, grad_kinds, grad_params
    )

  def master_view(self, stored: list[Any]) -> Any:
    """The masters where they exist, the params elsewhere, as a tree."""
    view = [
      p if isinstance(k, masters_lib.NoMaster) else k.view(s, p)
      for k, s, p in zip(self.kinds, stored, self.params, strict=True)
    ]
    return self.treedef.unflatten(view)


def _kinds(mode: str, dtype: Any, paths: list[Any], params: list[Any]) -> list[Any]:
  """The storage kind of each param leaf, given its key path (for messages)."""
  return [
    masters_lib.kind_for(mode, p, dtype, tree_lib.path_str(path) or "<root>")
    for path, p in zip(paths, params, strict=True)
  ]


def mixed_precision(
  inner: optax.GradientTransformation,
  dtype: jax.typing.DTypeLike = jnp.float32,
  *,
  masters: str = "full",
  seed: int = 0,
) -> MixedPrecisionTransformation:
  """Keeps ``dtype`` master weights and runs ``inner`` on them.

  Every floating parameter narrower than ``dtype`` (bf16, fp16, fp8 with the
  default float32) has a master in the optimizer state. Leaves already at
  ``dtype`` or wider are updated directly, with no master, and never downcast
  (f64 stays f64); non-floating leaves are left alone. ``inner`` is
  initialised and updated on the master view, so its whole state is in
  ``dtype``.

  ``update`` casts the gradients to the master dtype, runs ``inner``, applies
  its updates to the masters and returns, for each low-precision leaf, the
  update that lands it on its new master's rounding, in ``dtype``:
  ``optax.apply_updates(params, updates)`` puts every such leaf exactly there.

  How masters are stored (``masters``; see docs/concepts_masters.md):

  - ``"full"`` (the default): a ``dtype`` copy, 4 bytes per parameter for
    float32. A float16 (or fp8) param is its master rounded to nearest, ties
    to even, saturating at its largest finite value instead of overflowing to
    inf.
  - ``"remainder"``: for bfloat16 params under float32 masters, only the low
    16 bits of each master (an int16), 2 bytes per parameter: bfloat16 is the
    top half of float32, so the param and its remainder *are* the master. The
    master view is bitwise the float32 master ``"full"`` holds.
  - ``"stochastic"``: no master at all. The bfloat16 param is updated in
    float32 and rounded up or down at random, with probability proportional
    to the distance, so small updates survive in expectation. The random bits
    come from ``seed``, the leaf and element positions and a counter that
    only applied steps advance: no host sync, the same bits under any
    sharding.

  Every bfloat16 param under float32 masters, in ``"full"`` and
  ``"remainder"`` alike, is its master rounded to nearest with ties *away
  from zero* (the rule a 16-bit remainder can encode), and a master beyond the
  bfloat16 range saturates there. Where ``optax.apply_updates`` cannot land
  the param on its target (a target more than ``2**16`` times smaller than
  the param, so the float32 update itself rounds), the master moves to where
  the param lands, so the two modes stay interchangeable bit for bit, whole
  trajectories included; the move is bounded by the float32 rounding of the
  update (a property test checks it). A float16 param in that corner lands
  within two ``dtype`` ulps of its old magnitude from its target (``2**13``
  times smaller) while its master stays exact; the next update targets it
  again.

  ``mixed_precision`` must wrap the *whole* rule: the updates it returns land
  each param on its new master's rounding, so a rule chained after it (say
  ``optax.chain(mpx.mixed_precision(optax.scale_by_adam()),
  optax.scale(-lr))``) would move the params somewhere the masters never go,
  and the masters would follow the unscaled direction. Put every rule inside
  (``mpx.mixed_precision(optax.chain(optax.scale_by_adam(),
  optax.scale(-lr)))``); only :func:`mpx.loss_scale` goes around it. A
  transformation cannot see what is chained after it, but the chain's state
  shows it: :func:`mpx.loss_scale` (at ``init``) and :func:`master_params`
  refuse such a state.

  A step whose gradients hold inf or NaN returns zero updates and leaves the
  stored masters and the inner state bitwise unchanged (counts, schedules and
  the random-bit counter do not advance). Wrap this in :func:`mpx.loss_scale`
  for fp16, which also backs the loss scale off on such steps.

  Args:
    inner: the optax rule to run in high precision, e.g. ``optax.adamw(3e-4)``
      or an ``optax.chain``.
    dtype: the floating dtype of the masters and of the inner rule.
    masters: ``"full"``, ``"remainder"`` or ``"stochastic"``.
    seed: the seed of the random bits in ``"stochastic"`` mode (an integer).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MixedPrecisionState` (``"full"``),
    ``MixedPrecisionRemainderState`` or ``MixedPrecisionStochasticState``.
    Its ``update`` requires ``params`` and forwards extra keyword arguments to
    ``inner``; ``loss_scaled=`` is reserved for the :func:`mpx.loss_scale`
    that wraps it.

  Raises:
    ValueError: if ``dtype`` is not a floating dtype, ``masters`` is not a
      mode, ``"remainder"`` or ``"stochastic"`` is asked with masters other
      than float32, or (at ``init``) such a mode meets a narrow param other
      than bfloat16: the message names the leaf.
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
    >>> tx = mpx.mixed_precision(optax.sgd(1e-3), masters="remainder")
    >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
    >>> state.master_remainders["w"].dtype  # 2 bytes per parameter, not 4
    dtype('int16')
  """
  dtype = tree_lib.require_floating_dtype(dtype, "dtype")
  mode = _check_mode(masters, dtype)
  seed = _check_seed(seed)
  validation.check_transformation(inner)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> Any:
    validation.refuse_fp8_metadata("mixed_precision", params)
    stored = _store(mode, dtype, seed, params)
    leaves = _Leaves.align(mode, dtype, validation.gradient_params(params), params, stored)
    inner_state = inner.init(leaves.master_view(leaves.stored))
    _refuse_loss_scale_inside(inner_state)
    if mode == "full":
      return MixedPrecisionState(master_params=stored, inner_state=inner_state)
    if mode == "remainder":
      return MixedPrecisionRemainderState(master_remainders=stored, inner_state=inner_state)
    return MixedPrecisionStochasticState(stored, jnp.zeros((), jnp.int32), inner_state)

  def update_fn(
    updates: optax.Updates,
    state: Any,
    params: optax.Params | None = None,
    *,
    loss_scaled: LossScaledGradients | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, Any]:
    # 1. Validate (at trace time: costs the step nothing).
    _check_update_inputs(updates, state, params, mode, dtype, init_fn)
    # 2. Align gradients, params and stored masters leaf by leaf.
    leaves = _Leaves.align(mode, dtype, updates, params, _stored(state))
    # 3. Check: loss_scale's verdict if it handed one over, else the gradients.
    finite = _step_is_finite(leaves, loss_scaled, dtype)
    # 4. Step on the masters inside one cond: skipped, nothing is written.
    step = _step_on_masters(inner, dtype, leaves, loss_scaled, extra_args)
    (stored, new_inner, count), outs, applied = skip.apply_if_finite(
      finite, step, (leaves.stored, state.inner_state, _count(state)), leaves.grads
    )
    # 5. Rounded updates, after the cond: they fuse into optax.apply_updates.
    outs = iter(outs)
    flat_updates = []
    for kind, s, p in zip(leaves.kinds, stored, leaves.params, strict=True):
      if isinstance(kind, masters_lib.NoMaster):
        flat_updates.append(next(outs))
      else:
        out = next(outs) if kind.emits_param else None
        flat_updates.append(masters_lib.rounded_update(kind, s, out, p, applied, dtype))
    fields = _stored_fields(state, leaves.treedef.unflatten(stored), count)
    new_state = state._replace(inner_state=new_inner, **fields)
    return leaves.treedef.unflatten(flat_updates), new_state

  return MixedPrecisionTransformation(init_fn, update_fn)


def _check_mode(masters: Any, dtype: Any) -> str:
  if masters not in masters_lib.MODES:
    raise ValueError(
      f"mixed_precision: masters must be one of {', '.join(map(repr, masters_lib.MODES))}, "
      f"got {masters!r}."
    )
  if masters != "full" and jnp.dtype(dtype) != jnp.float32:
    raise ValueError(
      f"mixed_precision: masters={masters!r} works on bfloat16 params under float32 "
      f"masters; dtype is {jnp.dtype(dtype)}. Use masters='full' for other master dtypes."
    )
  return masters


def _check_seed(seed: Any) -> int:
  try:
    return operator.index(seed)
  except TypeError as error:
    raise ValueError(f"mixed_precision: seed must be an integer, got {seed!r}.") from error


def _store(mode: str, dtype: Any, seed: int, params: Any) -> Any:
  """What a mode stores for ``params``: the tree of masters, remainders or
  random-bit keys, with ``MaskedNode`` where a param has nothing stored."""
  # Checked here, not at construction: x64 may be switched on in between.
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise ValueError(
      f"mixed_precision: dtype {dtype} needs jax_enable_x64 (JAX would truncate "
      f"the masters to {jax.dtypes.canonicalize_dtype(dtype)})."
    )
  flat, structure = jax.tree_util.tree_flatten_with_path(params)
  treedef: Any = structure
  source = _master_seed()
  params_flat = [param for _, param in flat]
  kinds = _kinds(mode, dtype, [path for path, _ in flat], params_flat)
  stored = []
  for index, (kind, param) in enumerate(zip(kinds, params_flat, strict=True)):
    if isinstance(kind, masters_lib.NoMaster):
      stored.append(optax.MaskedNode())
    elif isinstance(kind, masters_lib.Stochastic):
      stored.append(jnp.asarray(rounding.leaf_key(seed, index)))
    else:  # only a master takes the full-precision source of its param
      stored.append(kind.store(param, source(param), dtype))
  return treedef.unflatten(stored)


def _count(state: Any) -> jax.Array | None:
  return state.rounding_count if isinstance(state, MixedPrecisionStochasticState) else None


def _stored_fields(state: Any, stored: Any, count: jax.Array | None) -> dict[str, Any]:
  """The fields of ``state`` that hold what a step stores, as ``_replace`` takes them."""
  fields = {_STORED_FIELD[type(state)]: stored}
  return fields if count is None else {**fields, "rounding_count": count}


def refuse_rules_chained_after(name: str, opt_state: Any) -> None:
  """Refuses an ``optax.chain`` that runs a rule after a ``mixed_precision``:
  its updates land each param on its new master's rounding, so any rule after
  it moves the params where the masters never go (docs/concepts.md)."""
  after = state_search.chained_after(opt_state, _ANY_STATE)
  if after:
    raise ValueError(
      f"{name}: an optax.chain runs {len(after)} rule(s) after mpx.mixed_precision. "
      "mixed_precision must wrap the whole rule: its updates land each param on its "
      "master's rounding, and a rule after it would move the params where the masters "
      "never go. Put every rule inside: "
      "mpx.mixed_precision(optax.chain(..., optax.scale(-lr)))."
    )


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
  mode: str,
  dtype: Any,
  init_fn: Callable[[Any], Any],
) -> None:
  """Every input of ``update`` against the others, naming the leaf and the fix."""
  if params is None:
    raise ValueError(
      "mixed_precision needs the current params: call tx.update(grads, opt_state, params)."
    )
  expected_type = _STATE_TYPES[mode]
  if not isinstance(state, expected_type):
    raise TypeError(
      "mixed_precision.update got a state of type "
      f"{type(state).__name__}, not {expected_type.__name__}: pass the state made "
      "by this transformation's init."
    )

  def mismatch(stored_def, params_def):
    return ValueError(
      "mixed_precision: params do not match the optimizer state (was the state "
      f"made by init on another tree?).\n  state: {stored_def}\n  params: {params_def}"
    )

  for path, stored, param in validation.zip_leaves(_stored(state), params, mismatch):
    kind = masters_lib.kind_for(mode, param, dtype, path)
    if isinstance(kind, masters_lib.NoMaster) and not tree_lib.is_placeholder(stored):
      raise ValueError(
        f"mixed_precision: param {path!r} is {validation.describe(param)}, but the state "
        "holds a master for a narrower param: the params were widened. mpx's updates are "
        f"in {jnp.dtype(dtype)}, and an apply that adds them without casting back (e.g. "
        "equinox.apply_updates) widens each param. Apply them with optax.apply_updates, "
        "which keeps every param's dtype (with equinox: eqx.partition the model, "
        "optax.apply_updates the arrays, eqx.combine)."
      )
    if tree_lib.no_master(stored) and not isinstance(kind, masters_lib.NoMaster):
      raise ValueError(
        f"mixed_precision: param {path!r} is {validation.describe(param)} but the state "
        "holds no master for it (the state was initialised on wider params). "
        "Re-initialise, or use mpx.init_from_full_precision to start "
        "low-precision training from full-precision weights."
      )
    has_shape = mode != "stochastic" and not tree_lib.no_master(stored)
    if has_shape and np.shape(stored) != np.shape(param):
      raise ValueError(
        f"mixed_precision: param {path!r} has shape {list(np.shape(param))} but "
        f"its master has shape {list(np.shape(stored))}."
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
  for grad, kind in zip(leaves.grads, leaves.grad_kinds, strict=True):
    if not tree_lib.is_floating(grad):
      continue
    # Unscaled, a floating gradient is float32: no unscaling op just to ask.
    bits = tree_lib.float_bits(grad) if loss_scaled is None else 32
    if not isinstance(kind, masters_lib.NoMaster) and bits > jnp.finfo(dtype).bits:
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
  """The applied branch: ``step((stored, inner_state, count), grads)`` returns
  what is stored next and the inner state (and the random-bit count), and what
  leaves the cond: the updates of leaves without a master, and the new params
  of leaves whose new param is not derivable from what is stored."""

  def step(state, grads):
    stored, inner_state, count = state
    # Unscaled and cast here, inside the cond, so the float32 copies fuse into
    # the update instead of entering the cond as buffers.
    if loss_scaled is not None:
      grads = [loss_scaled.unscale(g) for g in grads]
    grads = [
      g if isinstance(k, masters_lib.NoMaster) else g.astype(dtype)
      for g, k in zip(grads, leaves.grad_kinds, strict=True)
    ]
    view = leaves.master_view(stored)
    extra = {name: _cast_like_grads(value, leaves, dtype) for name, value in extra_args.items()}
    inner_updates, new_inner = inner.update(
      leaves.grad_treedef.unflatten(grads), inner_state, view, **extra
    )
    # Per-example gradients (DP-SGD) pass validation only if reduced here.
    validation.check_updates_reduced("mixed_precision", inner_updates, view)
    validation.check_state_types_kept("mixed_precision", new_inner, inner_state)
    new_stored, outs = [], []
    for kind, s, p, master, update in zip(
      leaves.kinds,
      stored,
      leaves.params,
      leaves.treedef.flatten_up_to(view),
      leaves.treedef.flatten_up_to(inner_updates),
      strict=True,
    ):
      if isinstance(kind, masters_lib.NoMaster):
        new_stored.append(s)
        outs.append(update)
        continue
      bits = None
      if isinstance(kind, masters_lib.Stochastic):
        bits = rounding.random_bits(s, count, np.shape(p))
      s, out = kind.commit(_add_in(dtype, master, update), s, p, bits)
      new_stored.append(s)
      if kind.emits_param:
        outs.append(out)
    new_count = None if count is None else count + 1
    return (new_stored, new_inner, new_count), outs

  return step


def _cast_like_grads(value: Any, leaves: _Leaves, dtype: Any) -> Any:
  """An extra argument shaped like the gradients (L-BFGS's ``grad=``), with
  every leaf that has a master cast to ``dtype`` as the gradients are, so the
  inner rule never sees a low-precision number. Anything else passes as it is."""
  try:
    flat = leaves.grad_treedef.flatten_up_to(value)
  except (ValueError, TypeError):
    return value
  if any(np.shape(v) != np.shape(p) for v, p in zip(flat, leaves.grad_params, strict=True)):
    return value
  cast = [
    v if isinstance(k, masters_lib.NoMaster) or not tree_lib.is_floating(v) else v.astype(dtype)
    for v, k in zip(flat, leaves.grad_kinds, strict=True)
  ]
  return leaves.grad_treedef.unflatten(cast)


def _add_in(dtype: Any, master: jax.Array, update: Any) -> jax.Array:
  """``(master + update).astype(dtype)``; lax where the dtypes agree, since
  ``+`` on tracers traces as a nested jit at every leaf."""
  if jnp.result_type(update) == master.dtype:
    return jax.lax.add(master, update)
  return (master + update).astype(dtype)


def _master_view_of(state: Any, params: Any) -> Any:
  """``params`` with every leaf that ``state`` holds a master for replaced by
  that master, in float32 (or the master dtype)."""
  kind = _VIEW_KIND[type(state)]

  def leaf(s, p):
    return p if tree_lib.no_master(s) else kind.view(s, jnp.asarray(p))

  return jax.tree.map(leaf, _stored(state), params, is_leaf=tree_lib.no_master)


def master_params(opt_state: optax.OptState, params: tree_lib.PyTree) -> tree_lib.PyTree:
  """The full-precision view of the model held by ``opt_state``.

  Returns ``params`` with every leaf that has a master in some
  ``mixed_precision`` state of ``opt_state`` (at any depth: chain,
  ``MultiSteps``, ``inject_hyperparams``, ``partition``) replaced by that
  master, in every storage mode: the float32 copy (``"full"``), the param
  joined with its remainder (``"remainder"``, bitwise the master ``"full"``
  would hold), or the param in float32 (``"stochastic"``, which keeps no
  master). Use it for evaluation, export and checkpoints. Where ``opt_state``
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
  refuse_rules_chained_after("master_params", opt_state)
  result = params
  states: list[Any] = state_search.find_states(opt_state, _ANY_STATE)
  for state in states:
    try:
      result = _master_view_of(state, result)
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
  ``param_dtype`` as their masters round (saturating: a weight beyond the
  fp16 range becomes 65504, not inf; bfloat16 ties away from zero, as
  :func:`mixed_precision` rounds) and initialises ``tx`` on the result, but
  seeds every master from the *original* value, so each master equals the
  checkpoint bit for bit (``tx.init`` on cast params could only recover the
  rounded value), in ``masters="remainder"`` mode too. The inner rules are
  initialised on those exact masters.

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
  param_dtype = tree_lib.require_floating_dtype(param_dtype, "dtype")
  low = tree_lib.map_floating(params, lambda leaf: _cast_for_masters(leaf, param_dtype), where)
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
      "in full precision with `where`. (masters='stochastic' keeps no master: "
      "cast with mpx.cast_tree and call tx.init.)"
    )
  return low, opt_state


def _cast_for_masters(leaf: Any, param_dtype: Any) -> jax.Array:
  """A full-precision leaf as the low-precision param its master rounds to:
  bfloat16 by mpx's ties-away rule (see :mod:`mpx._src.rounding`), any other
  dtype to nearest even, saturating."""
  leaf = jnp.asarray(leaf)
  if jnp.dtype(param_dtype) == jnp.bfloat16 and leaf.dtype != jnp.bfloat16:
    return rounding.round_ties_away(rounding.canonical(leaf.astype(jnp.float32)))
  return tree_lib.saturating_cast(leaf, param_dtype)
