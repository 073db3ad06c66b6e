"""``mixed_precision``: high-precision master weights inside the optimizer state.

``update`` is the four steps docs/design.md draws; each leaf's storage kind
(:mod:`mpx._src.storage`) answers what depends on the mode.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import (
  adapters,
  compat,
  full_precision,
  lowering,
  skip,
  state_search,
  storage,
  validation,
  variables,
  verdict,
)
from mpx._src import moments as moments_lib
from mpx._src import tree as tree_lib
from mpx._src.states import MIXED_PRECISION_STATES, LossScaleState


def mixed_precision(
  inner: optax.GradientTransformation,
  dtype: jax.typing.DTypeLike = jnp.float32,
  *,
  masters: str = "full",
  moments: str = "full",
  moment_fields: Sequence[str] | Mapping[str, str] = moments_lib.DEFAULT_FIELDS,
  seed: int = 0,
) -> verdict.TakesLossScaledGradients:
  """Keeps ``dtype`` master weights and runs ``inner`` on them.

  Every floating param narrower than ``dtype`` has a master in the state; the
  inner rule is initialised and updated on the masters (other leaves as they
  are), and the returned updates land each param on its new master's
  rounding. A step whose gradients, as ``inner`` receives them, hold inf or
  NaN is skipped: zero updates, the state unchanged but ``nonfinite_steps``.
  ``mixed_precision`` must wrap the whole rule. The modes, their bytes and
  corner cases: docs/concepts_masters.md, docs/guarantees.md.

  Args:
    inner: the optax rule to run in high precision, e.g. ``optax.adamw(3e-4)``.
    dtype: the floating dtype of the masters and of the inner rule.
    masters: ``"full"`` (a ``dtype`` copy), or for bfloat16 params under
      float32 masters ``"remainder"`` (its low 16 bits) or ``"stochastic"``
      (no master; stochastic rounding).
    moments: ``"full"``, ``"bfloat16"`` or ``"8bit"``: how the inner state's
      leaves under ``moment_fields`` of at least 4096 elements are stored.
    moment_fields: the state fields ``moments`` compresses: a sequence (``nu``
      and ``nu_max`` non-negative, others signed) or a mapping to
      ``"signed"``/``"nonnegative"``, e.g. for ``optax.adan``.
    seed: the seed of the random bits of stochastic rounding (an integer).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`~mpx.MixedPrecisionState` (or its remainder or stochastic
    variant). ``update`` requires ``params`` and forwards extra arguments.

  Raises:
    ValueError: for a bad ``dtype``, ``masters``, ``moments`` or ``seed``, or
      (at ``init``) a param a compact mode cannot hold, naming the leaf.
    TypeError: if ``inner`` is not a gradient transformation.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> tx = mpx.mixed_precision(optax.sgd(1e-3))
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> for _ in range(4):  # 4 steps of 1e-3: each alone is below bf16's ulp
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(state.master_params["w"][0]), 6), float(params["w"][0])
    (0.996, 0.99609375)
    >>> int(state.applied_steps), int(state.nonfinite_steps)
    (4, 0)
  """
  dtype = tree_lib.require_floating_dtype(dtype, "dtype")
  mode = _check_mode(masters, dtype)
  seed = _check_seed(seed)
  moments_format = moments_lib.check_format(moments, moment_fields, seed, dtype)
  validation.check_transformation(inner)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> Any:
    adapters.refuse_fp8_metadata("mixed_precision", params)
    _require_dtype_enabled(dtype)
    sources = full_precision.full_precision_sources()
    paths, flat, treedef = _flatten(params)
    compat.check_float8_supported({getattr(p, "dtype", None) for p in flat})
    stored = [
      mode.kind_for(param, dtype, path).init(param, sources, index, seed)
      for index, (path, param) in enumerate(zip(paths, flat, strict=True))
    ]
    leaves = _Leaves.align(mode, dtype, None, params, treedef.unflatten(stored))
    inner_state = tree_lib.strong_types(inner.init(leaves.tree(leaves.masters(leaves.stored))))
    _refuse_loss_scale_inside(inner_state)
    moments_format.check_fields_exist(inner_state)
    # Two arrays, not one: a step that donates the state donates each buffer once.
    applied_steps, nonfinite_steps = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    flat_inner, inner_treedef = _flatten_leaves(inner_state)
    stored_inner = [
      kind.compress(value, applied_steps)
      for kind, value in zip(moments_format.kinds(inner_state), flat_inner, strict=True)
    ]
    state = mode.state(
      treedef.unflatten(stored),
      applied_steps,
      nonfinite_steps,
      inner_treedef.unflatten(stored_inner),
    )
    return variables.fit_variables(state, moments_format.name, linen_boxes=True)

  def update_fn(
    updates: optax.Updates,
    state: Any,
    params: optax.Params | None,
    unscaling: verdict.Unscaling | None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, Any, jax.Array]:
    # 1. Validate the inputs and line them up leaf by leaf (at trace time).
    leaves, inner_layout = _checked_leaves(
      inner, mode, dtype, moments_format, updates, state, params, unscaling
    )
    # 2. The verdict, on each gradient as the inner rule will receive it.
    finite = verdict.gradients_finite(leaves.grads, leaves.received_dtypes, unscaling)
    # 3. The step on the masters; on a skipped step nothing is written.
    step = functools.partial(_step_on_masters, inner, inner_layout)
    stored_inner, _ = moments_lib.flatten_stored(state.inner_state)
    new, handoffs, applied = skip.run_if_finite(
      finite,
      step,
      _Stored(leaves.stored, stored_inner),
      leaves.without_stored(),
      unscaling,
      state.applied_steps,
      extra_args,
    )
    # 4. After the skip: the param updates (they fuse into optax.apply_updates).
    param_updates = [
      kind.param_update(stored, handoff, param, applied)
      for kind, stored, handoff, param in zip(
        leaves.kinds, new.per_param, handoffs, leaves.params, strict=True
      )
    ]
    new_state = mode.state(
      leaves.tree(new.per_param),
      state.applied_steps + applied.astype(jnp.int32),
      state.nonfinite_steps + jnp.logical_not(applied).astype(jnp.int32),
      inner_layout.tree(new.inner),
    )
    return leaves.tree(param_updates), new_state, applied

  return verdict.TakesLossScaledGradients(init_fn, variables.through_linen_boxes(update_fn))


def _checked_leaves(
  inner: optax.GradientTransformationExtraArgs,
  mode: storage.Mode,
  dtype: Any,
  moments_format: moments_lib.MomentsFormat,
  grads: Any,
  state: Any,
  params: Any,
  unscaling: verdict.Unscaling | None,
) -> tuple[_Leaves, _InnerLayout]:
  """Checks one step's inputs against each other and lines them up leaf by
  leaf; raises a ValueError naming the leaf and the fix."""
  if params is None:
    raise ValueError(
      "mixed_precision needs the current params: call tx.update(grads, opt_state, params)."
    )
  validation.check_state_type("mixed_precision", state, mode.state_type)
  leaves = _Leaves.align(mode, dtype, grads, params, mode.stored(state))
  if unscaling is None:  # no loss_scale to agree the verdict across devices
    validation.check_own_verdict_agrees("mixed_precision", grads, state.applied_steps)
  inner_like = jax.eval_shape(inner.init, leaves.tree(leaves.master_shapes()))
  inner_flat_like, inner_treedef = _flatten_leaves(inner_like)
  inner_layout = _InnerLayout(moments_format.kinds(inner_like), inner_treedef)
  stored_like = [
    kind.stored_like(x) for kind, x in zip(inner_layout.kinds, inner_flat_like, strict=True)
  ]
  validation.check_state_like(
    "mixed_precision", state.inner_state, inner_layout.tree(stored_like), "inner_state/"
  )
  return leaves, inner_layout


def _step_on_masters(
  inner: optax.GradientTransformationExtraArgs,
  inner_layout: _InnerLayout,
  stored: _Stored,
  leaves: _Leaves,
  unscaling: verdict.Unscaling | None,
  applied_steps: jax.Array,
  extra_args: dict[str, Any],
) -> tuple[_Stored, list[Any]]:
  """Runs the inner rule on the master view and commits each leaf.

  Returns ``(new stored, handoffs)``: what the state stores next, and what
  each leaf's ``param_update`` reads after the skip.
  """
  grads = leaves.grads
  inner_state = inner_layout.tree(
    [kind.decompress(s) for kind, s in zip(inner_layout.kinds, stored.inner, strict=True)]
  )
  received = [
    verdict.received(g, d, unscaling) for g, d in zip(grads, leaves.received_dtypes, strict=True)
  ]
  masters = leaves.masters(stored.per_param)
  received_extra = {
    name: leaves.received_like_grads(v) if name == adapters.EXTRA_GRADIENT_ARG else v
    for name, v in extra_args.items()
  }
  inner_updates, new_inner = inner.update(
    leaves.grad_tree(received), inner_state, leaves.tree(masters), **received_extra
  )
  # Per-example gradients (DP-SGD) pass validation only if reduced here.
  validation.check_updates_reduced("mixed_precision", inner_updates, leaves.tree(masters))
  validation.check_state_types_kept("mixed_precision", new_inner, inner_state)
  committed = [
    kind.commit(master, update, s, param, applied_steps)
    for kind, master, update, s, param in zip(
      leaves.kinds,
      masters,
      leaves.treedef.flatten_up_to(inner_updates),
      stored.per_param,
      leaves.params,
      strict=True,
    )
  ]
  new_stored = [c.stored for c in committed]
  handoffs = [c.handoff for c in committed]
  new_inner_flat = inner_layout.treedef.flatten_up_to(new_inner)
  moments_step = _moments_step(applied_steps, inner_layout, new_stored + handoffs, new_inner_flat)
  new_stored_inner = [
    kind.compress(value, moments_step)
    for kind, value in zip(inner_layout.kinds, new_inner_flat, strict=True)
  ]
  return _Stored(new_stored, new_stored_inner), handoffs


class _Stored(NamedTuple):
  """What the state stores, flat: per param leaf, and per inner-state leaf;
  the step's state, kept as it is on a skipped step."""

  per_param: list[Any]
  inner: list[Any]


@dataclasses.dataclass(frozen=True)
class _Leaves:
  """One step's params and what is stored for them, lined up leaf for leaf
  (``MaskedNode`` where a param has nothing stored) with each leaf's storage
  kind; and the gradients, lined up with the params they mirror (all of them,
  or ``optax.lookahead``'s fast weights), with their kinds."""

  treedef: Any
  kinds: list[storage.StorageKind]
  params: list[Any]
  stored: list[Any]
  grads: list[Any]
  grad_treedef: Any
  grad_kinds: list[storage.StorageKind]
  grad_shapes: list[tuple[int, ...]]

  @classmethod
  def align(cls, mode: storage.Mode, dtype: Any, grads: Any, params: Any, stored: Any) -> _Leaves:
    """Lines the trees up, checking each against the others (naming the leaf
    and the fix). ``grads`` is None at ``init``."""
    paths, params_flat, treedef = _flatten(params)
    kinds = [mode.kind_for(p, dtype, path) for path, p in zip(paths, params_flat, strict=True)]
    stored_flat = _check_stored(mode, dtype, stored, paths, params_flat, kinds, treedef)
    mirrored = adapters.gradient_params(params)
    if mirrored is params:
      grad_treedef, grad_kinds, grad_params = treedef, kinds, params_flat
    else:
      grad_paths, grad_params, grad_treedef = _flatten(mirrored)
      grad_kinds = [
        mode.kind_for(p, dtype, q) for q, p in zip(grad_paths, grad_params, strict=True)
      ]
    grads_flat: list[Any] = []
    if grads is not None:
      validation.check_grads_match_params("mixed_precision", grads, params)
      grads_flat = grad_treedef.flatten_up_to(grads)
    grad_shapes = [np.shape(p) for p in grad_params]
    return cls(
      treedef, kinds, params_flat, stored_flat, grads_flat, grad_treedef, grad_kinds, grad_shapes
    )

  def without_stored(self) -> _Leaves:
    """Returns these leaves without what is stored: the step receives that as
    its state, so it is passed to the step once."""
    return dataclasses.replace(self, stored=[])

  def tree(self, flat: list[Any]) -> Any:
    return self.treedef.unflatten(flat)

  def grad_tree(self, flat: list[Any]) -> Any:
    return self.grad_treedef.unflatten(flat)

  @property
  def received_dtypes(self) -> list[Any]:
    """Returns the dtype each gradient is received in (None: as it is)."""
    return [kind.master_dtype for kind in self.grad_kinds]

  def received_like_grads(self, value: Any) -> Any:
    """Receives an extra argument shaped like the gradients as they are
    received (``adapters.received_like_grads``); anything else as it is."""
    receive = [
      functools.partial(verdict.received, dtype=k.master_dtype, unscaling=None)
      for k in self.grad_kinds
    ]
    return adapters.received_like_grads(value, self.grad_treedef, self.grad_shapes, receive)

  def masters(self, stored: list[Any]) -> list[Any]:
    """Returns the master view, leaf by leaf: what the inner rule sees."""
    return [k.view(s, p) for k, s, p in zip(self.kinds, stored, self.params, strict=True)]

  def master_shapes(self) -> list[Any]:
    """Returns the master view's shapes and dtypes, without computing it."""
    return [
      p if k.master_dtype is None else jax.ShapeDtypeStruct(np.shape(p), k.master_dtype)
      for k, p in zip(self.kinds, self.params, strict=True)
    ]


# A pytree of the step's arrays, so that skip.run_if_finite passes them to the
# jitted step as arguments.
jax.tree_util.register_dataclass(
  _Leaves,
  data_fields=["params", "stored", "grads"],
  meta_fields=["treedef", "kinds", "grad_treedef", "grad_kinds", "grad_shapes"],
)


@dataclasses.dataclass(frozen=True)
class _InnerLayout:
  """The inner state's treedef, and the moment kind of each of its leaves."""

  kinds: list[moments_lib.MomentKind]
  treedef: Any

  def tree(self, flat: list[Any]) -> Any:
    return self.treedef.unflatten(flat)


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
  """Returns ``(paths, leaves, treedef)`` with ``optax.MaskedNode`` as a leaf (the
  holes ``optax.partition`` and ``masked`` leave), paths as ``"a/b/0"``."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=tree_lib.no_master)
  paths = [tree_lib.path_str(path) or "<root>" for path, _ in flat]
  return paths, [leaf for _, leaf in flat], treedef


def _flatten_leaves(tree: Any) -> tuple[list[Any], Any]:
  """Flattens ``tree`` as ``jax.tree.flatten``, typed for the treedef's methods."""
  flat, treedef = jax.tree.flatten(tree)
  return flat, treedef


def _check_stored(
  mode: storage.Mode,
  dtype: Any,
  stored: Any,
  paths: list[str],
  params: list[Any],
  kinds: list[storage.StorageKind],
  treedef: Any,
) -> list[Any]:
  """Returns what is stored, flat, after checking it leaf by leaf against what each
  param's kind would store for it at init."""
  stored_flat, stored_def = jax.tree.flatten(stored, is_leaf=tree_lib.no_master)
  if stored_def != treedef:
    raise ValueError(
      "mixed_precision: params do not match the optimizer state (was the state "
      f"made by init on another tree?).\n  state: {stored_def}\n  params: {treedef}"
    )
  for path, s, param, kind in zip(paths, stored_flat, params, kinds, strict=True):
    validation.check_stored_leaf(mode.stored_field, path, s, kind.stored_like(param), param, dtype)
  return stored_flat


def _moments_step(
  applied_steps: jax.Array,
  inner_layout: _InnerLayout,
  outputs: list[Any],
  new_inner_flat: list[Any],
) -> jax.Array:
  """Returns the step whose random bits compress the moments: ``applied_steps``,
  plus (XLA:CPU, one device) a zero that orders their writes (``_after``)."""
  if not any(kind.compressed for kind in inner_layout.kinds):
    return applied_steps
  uncompressed = [
    v for v, kind in zip(new_inner_flat, inner_layout.kinds, strict=True) if not kind.compressed
  ]
  return lowering.by_platform(
    applied_steps,
    outputs + uncompressed,
    cpu=lambda steps, others: steps + _after(others),
    accelerator=lambda steps, _: steps,
    # An element of a sharded output would be all-gathered.
    cpu_needs_one_device=True,
  )


def _after(others: list[Any]) -> jax.Array:
  """Returns zero, read from one element of each of the step's other outputs.

  Added to the moments' step, it orders each compressed moment's in-place
  write after the kernels that read the old moment, which XLA:CPU would
  otherwise meet with a copy (docs/design.md, the workaround table).
  """
  firsts = [
    jnp.ravel(x)[:1].astype(jnp.float32)
    for x in others
    if not tree_lib.is_placeholder(x) and np.size(x) >= moments_lib.MIN_SIZE
  ]
  if not firsts:
    return jnp.zeros((), jnp.int32)
  # A reduction, computed once: a scalar made of elementwise ops alone XLA
  # would fuse into every element of every compressed moment.
  return jnp.sum(jnp.isnan(jnp.concatenate(firsts)).astype(jnp.int32))


def _check_mode(masters: Any, dtype: Any) -> storage.Mode:
  if masters not in storage.MODES:
    raise ValueError(
      f"mixed_precision: masters must be one of {', '.join(map(repr, storage.MODES))}, "
      f"got {masters!r}."
    )
  if masters != "full" and jnp.dtype(dtype) != jnp.float32:
    raise ValueError(
      f"mixed_precision: masters={masters!r} works on bfloat16 params under float32 "
      f"masters; dtype is {jnp.dtype(dtype)}. Use masters='full' for other master dtypes."
    )
  return storage.MODES[masters]


def _check_seed(seed: Any) -> int:
  try:
    return operator.index(seed)
  except TypeError as error:
    raise ValueError(f"mixed_precision: seed must be an integer, got {seed!r}.") from error


def _require_dtype_enabled(dtype: Any) -> None:
  # Checked at init, not at construction: x64 may be switched on in between.
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise ValueError(
      f"mixed_precision: dtype {dtype} needs jax_enable_x64 (JAX would truncate "
      f"the masters to {jax.dtypes.canonicalize_dtype(dtype)})."
    )


def _refuse_loss_scale_inside(inner_state: Any) -> None:
  if state_search.find_states(inner_state, LossScaleState):
    raise ValueError(
      "mixed_precision wraps a loss_scale: on an overflow its skip would roll "
      "the loss-scale state back, so the scale could never back off. Nest them "
      "the other way: mpx.loss_scale(mpx.mixed_precision(inner))."
    )


def master_params(opt_state: optax.OptState, params: tree_lib.PyTree) -> tree_lib.PyTree:
  """Returns the full-precision view of the model held by ``opt_state``.

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
  validation.refuse_rules_chained_after("master_params", opt_state)
  result = params
  states: list[Any] = state_search.find_states(opt_state, MIXED_PRECISION_STATES)
  for state in states:
    mode = storage.MODE_OF_STATE[type(state)]
    try:
      result = mode.map_stored(lambda kind, stored, param: kind.view(stored, param), state, result)
    except ValueError as error:
      raise ValueError(
        "master_params: params do not match the masters in opt_state: pass the params "
        "as the state was made for them (under nnx: nnx.as_pure(nnx.state(model, wrt)))."
      ) from error
  return result


def inner_state(opt_state: optax.OptState) -> optax.OptState:
  """Returns the wrapped rule's state as plain optax would hold it.

  Finds the one :func:`mixed_precision` state in ``opt_state`` (at any depth:
  under ``loss_scale``, chain, ``MultiSteps``, ``inject_hyperparams``) and
  returns its ``inner_state`` with every compressed moment (``moments=
  "bfloat16"`` or ``"8bit"``) decompressed to float32; with ``moments="full"``
  it is the ``inner_state`` itself. For inspection, conversion to plain optax
  and checkpoint migration. Works under ``jit``.

  Args:
    opt_state: an optimizer state holding exactly one ``mixed_precision`` state.

  Returns:
    The inner rule's state, with float32 moments.

  Raises:
    ValueError: if ``opt_state`` holds no ``mixed_precision`` state, or several.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.mixed_precision(optax.adam(1e-3), moments="bfloat16")
    >>> state = tx.init({"w": jnp.ones(4096, jnp.bfloat16)})
    >>> state.inner_state[0].mu["w"].values.dtype  # stored compressed
    dtype(bfloat16)
    >>> mpx.inner_state(state)[0].mu["w"].dtype  # as optax.adam holds it
    dtype('float32')
  """
  states: list[Any] = state_search.find_states(opt_state, MIXED_PRECISION_STATES)
  if len(states) != 1:
    raise ValueError(
      f"inner_state: opt_state holds {len(states)} mixed_precision states; pass the "
      "part of it that holds exactly one (e.g. one group of an optax.partition)."
    )
  return moments_lib.decompressed(states[0].inner_state)
