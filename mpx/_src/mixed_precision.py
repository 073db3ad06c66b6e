"""``mixed_precision``: high-precision master weights inside the optimizer state.

The wrapped (inner) optax rule never sees a low-precision number: it is
initialised and updated on the *master view* of the parameters, i.e. a
``dtype`` master copy for every floating leaf narrower than ``dtype`` and the
parameter itself for every other leaf. The updates returned move each
low-precision parameter exactly onto its rounded master.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import base, skip_step, state_search
from mpx._src import tree as tree_lib
from mpx._src import verdict as verdict_lib
from mpx._src.base import check_transformation
from mpx._src.loss_scale import LossScaleState

PyTree = Any


class MixedPrecisionState(NamedTuple):
  """State of :func:`mixed_precision`.

  Attributes:
    master_params: the parameter tree with a ``dtype`` master copy at every
      floating leaf narrower than ``dtype`` and ``optax.MaskedNode()`` at every
      other leaf (those are updated in place, with no copy). The masters are
      the true weights; the low-precision parameters are their rounding.
    inner_state: the wrapped rule's state, built on the master view, so all of
      its floating leaves (Adam's moments, injected hyperparameters) are in
      ``dtype`` or wider.
  """

  master_params: PyTree
  inner_state: optax.OptState


def _is_hole(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _master_view(masters: PyTree, params: PyTree) -> PyTree:
  """The masters where they exist, the parameters elsewhere."""
  return jax.tree.map(lambda m, p: p if _is_hole(m) else m, masters, params, is_leaf=_is_hole)


class _MasterSources:
  """Full-precision values to seed masters from, keyed by the identity of the
  low-precision leaf that ``init`` will receive (see ``init_from_full_precision``)."""

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


@contextlib.contextmanager
def _seeding_masters(sources: _MasterSources) -> Iterator[None]:
  token = _MASTER_SOURCES.set(sources)
  try:
    yield
  finally:
    _MASTER_SOURCES.reset(token)


def _check_matches_state(masters: PyTree, params: PyTree, needs_master) -> None:
  """Trace-time check that ``params`` belong to the state holding ``masters``."""
  master_def = jax.tree.structure(masters, is_leaf=_is_hole)
  param_def = jax.tree.structure(params, is_leaf=_is_hole)
  if master_def != param_def:
    raise ValueError(
      "mixed_precision: params do not match the optimizer state (was the state "
      f"made by init on another tree?).\n  state: {master_def}\n  params: {param_def}"
    )
  flat_masters = jax.tree_util.tree_flatten_with_path(masters, is_leaf=_is_hole)[0]
  flat_params = jax.tree.leaves(params, is_leaf=_is_hole)
  for (path, master), param in zip(flat_masters, flat_params, strict=True):
    where = tree_lib.path_str(path) or "<root>"
    if _is_hole(master):
      if needs_master(param):
        raise ValueError(
          f"mixed_precision: param {where!r} is {base.describe(param)} but the state "
          "holds no master for it (the state was initialised on wider params). "
          "Re-initialise, or use mpx.init_from_full_precision to start "
          "low-precision training from full-precision weights."
        )
    elif np.shape(master) != np.shape(param):
      raise ValueError(
        f"mixed_precision: param {where!r} has shape {list(np.shape(param))} but "
        f"its master has shape {list(np.shape(master))}."
      )


def _finite_flag(
  flat_grads: list[Any],
  flat_masters: list[Any],
  outer: verdict_lib.Verdict | None,
  dtype: Any,
) -> Any:
  """Whether to apply the step: the enclosing verdict, if any, and a check of
  every gradient leaf it does not vouch for.

  A gradient with a master is checked as cast to ``dtype`` when it is wider
  (a float64 gradient may overflow float32 masters, a float32 one float16
  masters), even if the enclosing verdict covers it: that verdict was made
  before the cast. Leaves without a master are never cast, so never checked cast.
  """
  to_check = []
  for grad, master in zip(flat_grads, flat_masters, strict=True):
    if not tree_lib.is_floating(grad):
      continue
    if not _is_hole(master) and tree_lib.float_bits(grad) > jnp.finfo(dtype).bits:
      to_check.append(jnp.asarray(grad).astype(dtype))
    elif outer is None or not outer.covers(grad):
      to_check.append(grad)
  finite = tree_lib.all_finite(to_check)  # True for an empty list
  return finite if outer is None else jnp.logical_and(outer.finite, finite)


def _update_to(new_master: jax.Array, param: Any, finite: jax.Array, dtype: Any) -> jax.Array:
  """The update that moves ``param`` onto ``new_master`` rounded to its dtype
  (saturating), zero on a skipped step. Computed outside the cond from the
  (in-place) new master, it fuses into ``optax.apply_updates``."""
  param = jnp.asarray(param)
  target = tree_lib.saturating_cast(new_master, param.dtype)
  delta = target.astype(dtype) - param.astype(dtype)
  return jnp.where(finite, delta, jnp.zeros_like(delta))


def mixed_precision(
  inner: optax.GradientTransformation,
  dtype: jax.typing.DTypeLike = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
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
    forwards extra keyword arguments to ``inner``.

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
  check_transformation(inner)
  inner = optax.with_extra_args_support(inner)
  master_bits = jnp.finfo(dtype).bits

  def needs_master(leaf: Any) -> bool:
    return tree_lib.is_floating(leaf) and tree_lib.float_bits(leaf) < master_bits

  def init_fn(params: PyTree) -> MixedPrecisionState:
    # Checked here, not at construction: x64 may be switched on in between.
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
      raise ValueError(
        f"mixed_precision: dtype {dtype} needs jax_enable_x64 (JAX would truncate "
        f"the masters to {jax.dtypes.canonicalize_dtype(dtype)})."
      )
    sources = _MASTER_SOURCES.get()

    def make_master(leaf):
      if not needs_master(leaf):
        return optax.MaskedNode()
      if sources is not None:
        leaf = sources.take(leaf)
      return jnp.asarray(leaf).astype(dtype)

    masters = jax.tree.map(make_master, params)
    inner_state = inner.init(_master_view(masters, params))
    if state_search.find_states(inner_state, LossScaleState):
      raise ValueError(
        "mixed_precision wraps a loss_scale: on an overflow its skip would roll "
        "the loss-scale state back, so the scale could never back off. Nest them "
        "the other way: mpx.loss_scale(mpx.mixed_precision(inner))."
      )
    return MixedPrecisionState(master_params=masters, inner_state=inner_state)

  def update_fn(updates, state, params=None, **extra_args):
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
    masters = state.master_params
    _check_matches_state(masters, params, needs_master)
    base.check_state_like("mixed_precision", state, jax.eval_shape(init_fn, params))
    base.check_grads_match_params("mixed_precision", updates, params)

    # Flattened with holes as leaves, masters, params and grads align leaf for leaf.
    flat_masters, treedef = jax.tree.flatten(masters, is_leaf=_is_hole)
    flat_params = treedef.flatten_up_to(params)
    flat_grads = treedef.flatten_up_to(updates)
    outer = verdict_lib.enclosing()
    finite = _finite_flag(flat_grads, flat_masters, outer, dtype)

    # Grads that an enclosing loss_scale unscaled are rebuilt from the raw ones
    # inside the branch, so that the unscaling fuses into the update instead of
    # entering the cond as a materialised float32 copy.
    sources = [None if outer is None else outer.source(g) for g in flat_grads]
    operand_grads = [
      g if src is None else src[0] for g, src in zip(flat_grads, sources, strict=True)
    ]

    def step(operand_grads, inner_state, flat_masters):
      grads = [
        g if src is None else src[1](g) for g, src in zip(operand_grads, sources, strict=True)
      ]
      # Cast inside the step, so the copy in the master dtype fuses into the update.
      grads = [
        g if _is_hole(m) else g.astype(dtype) for g, m in zip(grads, flat_masters, strict=True)
      ]
      view = [p if _is_hole(m) else m for m, p in zip(flat_masters, flat_params, strict=True)]
      with verdict_lib.published(None):  # nothing inside answers to an outer loss_scale
        inner_updates, new_inner = inner.update(
          treedef.unflatten(grads), inner_state, treedef.unflatten(view), **extra_args
        )
      flat_updates = treedef.flatten_up_to(inner_updates)
      new_masters = [
        m if _is_hole(m) else (m + u).astype(dtype)
        for m, u in zip(flat_masters, flat_updates, strict=True)
      ]
      # Only the updates of leaves without a master leave the cond; the others
      # are derived from the new masters below.
      hole_updates = [u for m, u in zip(flat_masters, flat_updates, strict=True) if _is_hole(m)]
      return hole_updates, new_masters, new_inner

    hole_updates, new_flat_masters, new_inner = skip_step.unless_finite(
      "mixed_precision",
      finite,
      step,
      (operand_grads, state.inner_state, flat_masters),
      keep=lambda ops: (ops[2], ops[1]),
    )
    hole_updates = iter(hole_updates)
    flat_out = [
      next(hole_updates) if _is_hole(m) else _update_to(m, p, finite, dtype)
      for m, p in zip(new_flat_masters, flat_params, strict=True)
    ]
    out_updates = treedef.unflatten(flat_out)
    new_state = MixedPrecisionState(
      master_params=treedef.unflatten(new_flat_masters), inner_state=new_inner
    )
    if outer is not None:
      outer.guard_state(new_state)
      outer.guard_updates(out_updates)
    return out_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def master_params(opt_state: optax.OptState, params: PyTree) -> PyTree:
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


def init_from_full_precision(
  tx: optax.GradientTransformation,
  params: PyTree,
  param_dtype: jax.typing.DTypeLike,
  where: tree_lib.LeafPredicate | PyTree | None = None,
) -> tuple[PyTree, optax.OptState]:
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
  check_transformation(tx, "tx")
  low = tree_lib.cast_tree(params, param_dtype, where, saturate=True)
  low_with_paths, _ = jax.tree_util.tree_flatten_with_path(low)
  pairs = [
    (low_leaf, full_leaf, tree_lib.path_str(path))
    for (path, low_leaf), full_leaf in zip(low_with_paths, jax.tree.leaves(params), strict=True)
    if low_leaf is not full_leaf
  ]
  sources = _MasterSources(pairs)
  with _seeding_masters(sources):
    opt_state = tx.init(low)
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
