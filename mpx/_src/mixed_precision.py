"""``mixed_precision``: high-precision master weights inside the optimizer state.

The wrapped (inner) optax rule never sees a low-precision number: it is
initialised and updated on the *master view* of the parameters (the master of
every floating leaf narrower than ``dtype``, the parameter itself elsewhere).
Each parameter leaf has a storage kind (:mod:`mpx._src.storage`), a whole
strategy for what is stored, what the inner rule sees, what a step writes and
which update moves the parameter; this module runs one step over all leaves
without asking which kinds they are.

One step, top to bottom (docs/design.md draws it):

1. validate the inputs and line up gradients, params and what is stored,
   leaf by leaf (at trace time);
2. the verdict: every gradient finite as the inner rule will receive it;
3. inside one ``lax.cond`` on the verdict: receive the gradients (unscale,
   cast), run the inner rule on the master view, and commit each leaf's new
   master; on a skipped step nothing is written;
4. after the cond: each param's update, which fuses into
   ``optax.apply_updates``, and the state with the step counted.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import (
  compat,
  full_precision,
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

  Every floating parameter narrower than ``dtype`` (bf16, fp16, fp8 under the
  default float32) has a master in the optimizer state; wider or equal leaves
  are updated in place and never cast, and non-floating leaves are left alone.
  ``inner`` is initialised and updated on the master view, so its whole state
  is in ``dtype``. ``update`` runs ``inner`` on the gradients cast to
  ``dtype``, applies its updates to the masters, and returns updates with
  which ``optax.apply_updates`` lands each low-precision param exactly on its
  new master's rounding.

  How masters are stored (``masters``; docs/concepts_masters.md):

  - ``"full"``: a ``dtype`` copy, 4 bytes per parameter for float32.
  - ``"remainder"``: bfloat16 params under float32 masters only; the low 16
    bits of each master (2 bytes per parameter), bitwise the master ``"full"``
    keeps.
  - ``"stochastic"``: bfloat16 params under float32 masters only; no master:
    the param is updated in float32 and rounded at random (unbiased), with
    bits from ``seed``, the element's position and the count of applied steps.

  A bfloat16 param under float32 masters is its master rounded to nearest,
  ties away from zero; any other is rounded to nearest even. Both saturate.

  How the inner rule's moments are stored (``moments``, float32 masters
  only; docs/concepts_masters.md), for every leaf of at least 4096 elements
  under a field named in ``moment_fields`` (Adam's ``mu`` and ``nu``,
  momentum's ``trace``):

  - ``"full"``: as the rule makes them (4 bytes per element).
  - ``"bfloat16"``: 2 bytes per element.
  - ``"8bit"``: a byte per element plus a float32 scale per block of at most
    256 along the last axis (about 1.02 bytes); second moments (``nu``) in a
    code that never turns a positive value into zero. A leaf whose last axis
    is shorter than 16 is stored in bfloat16.

  Both round stochastically (unbiased), with bits from ``seed`` and the count
  of applied steps. The rule still runs in float32 on the decompressed
  moments; :func:`mpx.inner_state` gives its state back in float32.

  A step is skipped when a gradient, as ``inner`` would receive it (unscaled
  and cast to ``dtype``), holds inf or NaN: zero updates, the masters and the
  inner state bitwise unchanged, and ``nonfinite_steps`` counts it. Under
  :func:`mpx.loss_scale`, which hands over the raw scaled gradients, that is
  the step's one verdict, agreed across its ``axis_name``.

  ``mixed_precision`` must wrap the whole rule: a rule chained after it would
  move the params where the masters never go (refused where the state shows
  it). Corner cases: docs/guarantees.md.

  Args:
    inner: the optax rule to run in high precision, e.g. ``optax.adamw(3e-4)``.
    dtype: the floating dtype of the masters and of the inner rule.
    masters: ``"full"``, ``"remainder"`` or ``"stochastic"``.
    moments: ``"full"``, ``"bfloat16"`` or ``"8bit"``.
    moment_fields: the names of the state fields whose leaves ``moments``
      compresses. A sequence takes ``nu`` and ``nu_max`` as second moments
      (non-negative) and other names as signed; a mapping names each one's
      kind, e.g. ``{"m": "signed", "v": "signed", "n": "nonnegative"}`` for
      ``optax.adan``.
    seed: the seed of the random bits of ``"stochastic"`` masters and of
      compressed moments (an integer).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`~mpx.MixedPrecisionState`, ``MixedPrecisionRemainderState`` or
    ``MixedPrecisionStochasticState``. ``update`` requires ``params`` and
    forwards extra keyword arguments to ``inner``.

  Raises:
    ValueError: for a non-floating ``dtype``, an unknown ``masters``, a
      compact mode with masters other than float32, or (at ``init``) a compact
      mode meeting a narrow param other than bfloat16, naming the leaf.
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
    validation.refuse_fp8_metadata("mixed_precision", params)
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
    applied, nonfinite = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    flat_inner, inner_treedef = _flatten_leaves(inner_state)
    stored_inner = [
      kind.compress(value, applied)
      for kind, value in zip(moments_format.kinds(inner_state), flat_inner, strict=True)
    ]
    state = mode.state(
      treedef.unflatten(stored), applied, nonfinite, inner_treedef.unflatten(stored_inner)
    )
    return variables.fit_variables(state)

  def update_fn(
    updates: optax.Updates,
    state: Any,
    params: optax.Params | None = None,
    *,
    unscaling: verdict.Unscaling | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, Any]:
    # 1. Validate and line up the leaves (at trace time: costs the step nothing).
    if params is None:
      raise ValueError(
        "mixed_precision needs the current params: call tx.update(grads, opt_state, params)."
      )
    validation.check_state_type("mixed_precision", state, mode.state_type)
    leaves = _Leaves.align(mode, dtype, updates, params, mode.stored(state))
    if unscaling is None:  # no loss_scale to agree the verdict across devices
      validation.check_own_verdict_agrees("mixed_precision", updates, state.applied_steps)
    inner_like = jax.eval_shape(inner.init, leaves.tree(leaves.master_shapes()))
    inner_kinds = moments_format.kinds(inner_like)
    inner_flat_like, inner_treedef = _flatten_leaves(inner_like)
    stored_like = [k.stored_like(x) for k, x in zip(inner_kinds, inner_flat_like, strict=True)]
    validation.check_state_like(
      "mixed_precision", state.inner_state, inner_treedef.unflatten(stored_like), "inner_state/"
    )
    # 2. The verdict, on each gradient as the inner rule will receive it.
    received_dtypes = [kind.master_dtype for kind in leaves.grad_kinds]
    finite = verdict.gradients_finite(leaves.grads, received_dtypes, unscaling)

    # 3. The step on the masters, inside one cond: skipped, nothing is written.
    def apply(carry: tuple[list[Any], list[Any]], grads: list[Any]) -> tuple[Any, list[Any]]:
      stored, stored_inner = carry
      inner_state = inner_treedef.unflatten(
        [k.decompress(s) for k, s in zip(inner_kinds, stored_inner, strict=True)]
      )
      grads = [
        verdict.received(g, d, unscaling) for g, d in zip(grads, received_dtypes, strict=True)
      ]
      masters = leaves.masters(stored)
      extra = {k: _received_like_grads(v, leaves) for k, v in extra_args.items()}
      inner_updates, new_inner = inner.update(
        leaves.grad_tree(grads), inner_state, leaves.tree(masters), **extra
      )
      # Per-example gradients (DP-SGD) pass validation only if reduced here.
      validation.check_updates_reduced("mixed_precision", inner_updates, leaves.tree(masters))
      validation.check_state_types_kept("mixed_precision", new_inner, inner_state)
      committed = [
        kind.commit(master, update, s, param, state.applied_steps)
        for kind, master, update, s, param in zip(
          leaves.kinds,
          masters,
          leaves.treedef.flatten_up_to(inner_updates),
          stored,
          leaves.params,
          strict=True,
        )
      ]
      new_stored = [s for s, _ in committed]
      handed_out = [out for _, out in committed]  # what each leaf's param_update reads
      new_inner_flat = inner_treedef.flatten_up_to(new_inner)
      count = state.applied_steps
      if jax.device_count() == 1 and any(k.compressed for k in inner_kinds):
        kept = [v for v, k in zip(new_inner_flat, inner_kinds, strict=True) if not k.compressed]
        # An XLA:CPU ordering (see _after); other platforms order the writes themselves.
        zero = jax.lax.platform_dependent(
          new_stored + handed_out + kept, cpu=_after, default=lambda _: jnp.zeros((), jnp.int32)
        )
        count = count + zero
      new_stored_inner = [
        kind.compress(value, count) for kind, value in zip(inner_kinds, new_inner_flat, strict=True)
      ]
      return (new_stored, new_stored_inner), handed_out

    stored_inner, _ = moments_lib.flatten_stored(state.inner_state)
    (stored, new_stored_inner), handed_out, applied = skip.apply_if_finite(
      finite, apply, (leaves.stored, stored_inner), leaves.grads
    )
    # 4. The param updates, after the cond: they fuse into optax.apply_updates.
    param_updates = [
      kind.param_update(s, out, param, applied)
      for kind, s, out, param in zip(leaves.kinds, stored, handed_out, leaves.params, strict=True)
    ]
    new_state = mode.state(
      leaves.treedef.unflatten(stored),
      state.applied_steps + applied.astype(jnp.int32),
      state.nonfinite_steps + jnp.logical_not(applied).astype(jnp.int32),
      inner_treedef.unflatten(new_stored_inner),
    )
    return leaves.tree(param_updates), new_state

  return verdict.TakesLossScaledGradients(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class _Leaves:
  """One step's params and what is stored for them, lined up leaf for leaf
  (``MaskedNode`` where a param has nothing stored) with each leaf's storage
  kind; and the gradients, lined up with the params they mirror (all of them,
  or ``optax.lookahead``'s fast weights), with their kinds."""

  treedef: Any
  kinds: list[Any]
  params: list[Any]
  stored: list[Any]
  grads: list[Any]
  grad_treedef: Any
  grad_kinds: list[Any]
  grad_params: list[Any]

  @classmethod
  def align(cls, mode: storage.Mode, dtype: Any, grads: Any, params: Any, stored: Any) -> _Leaves:
    """Lines the trees up, checking each against the others (naming the leaf
    and the fix). ``grads`` is None at ``init``."""
    paths, params_flat, treedef = _flatten(params)
    kinds = [mode.kind_for(p, dtype, path) for path, p in zip(paths, params_flat, strict=True)]
    stored_flat = _check_stored(mode, dtype, stored, paths, params_flat, kinds, treedef)
    mirrored = validation.gradient_params(params)
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
    return cls(
      treedef, kinds, params_flat, stored_flat, grads_flat, grad_treedef, grad_kinds, grad_params
    )

  def tree(self, flat: list[Any]) -> Any:
    return self.treedef.unflatten(flat)

  def grad_tree(self, flat: list[Any]) -> Any:
    return self.grad_treedef.unflatten(flat)

  def masters(self, stored: list[Any]) -> list[Any]:
    """The master view, leaf by leaf: what the inner rule sees."""
    return [k.view(s, p) for k, s, p in zip(self.kinds, stored, self.params, strict=True)]

  def master_shapes(self) -> list[Any]:
    """The master view's shapes and dtypes, without computing it."""
    return [
      p if k.master_dtype is None else jax.ShapeDtypeStruct(np.shape(p), k.master_dtype)
      for k, p in zip(self.kinds, self.params, strict=True)
    ]


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
  """``(paths, leaves, treedef)`` with ``optax.MaskedNode`` as a leaf (the
  holes ``optax.partition`` and ``masked`` leave), paths as ``"a/b/0"``."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=tree_lib.no_master)
  paths = [tree_lib.path_str(path) or "<root>" for path, _ in flat]
  return paths, [leaf for _, leaf in flat], treedef


def _flatten_leaves(tree: Any) -> tuple[list[Any], Any]:
  """``jax.tree.flatten``, typed for the treedef's methods."""
  flat, treedef = jax.tree.flatten(tree)
  return flat, treedef


def _check_stored(
  mode: storage.Mode,
  dtype: Any,
  stored: Any,
  paths: list[str],
  params: list[Any],
  kinds: list[Any],
  treedef: Any,
) -> list[Any]:
  """What is stored, flat, after checking it leaf by leaf against what each
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


def _after(others: list[Any]) -> jax.Array:
  """Zero, computed from one element of each of the step's other outputs.

  Each compressed moment is written over its old value (the cond's output
  aliases its input), which every kernel that recomputes the new moment
  reads too. XLA orders such a write after those reads only when it depends
  on them; otherwise it writes a copy (bfloat16 moments: 8 bytes per
  parameter more each step). Adding this to the count of the moments'
  random bits makes their compression depend on every other output. It is
  zero while they are not NaN (an applied step's never are, short of the
  rule's own NaN), and costs a read of one element of each output as large
  as a compressed leaf can be (smaller ones are not worth a kernel each: at
  worst XLA copies a moment read by one of them). Only in a process
  with one device: where the state may be sharded, an element of a sharded
  output would be gathered across devices (XLA all-gathers the whole leaf
  for it). An ``optimization_barrier`` instead leaves the copies in place.
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


def _received_like_grads(value: Any, leaves: _Leaves) -> Any:
  """An extra argument shaped like the gradients (L-BFGS's ``grad=``), with
  each leaf received as its gradient is, so the inner rule never sees a
  low-precision number. Anything else passes as it is."""
  try:
    flat = leaves.grad_treedef.flatten_up_to(value)
  except (ValueError, TypeError):
    return value
  if any(np.shape(v) != np.shape(p) for v, p in zip(flat, leaves.grad_params, strict=True)):
    return value
  received = [
    verdict.received(v, k.master_dtype, None) for v, k in zip(flat, leaves.grad_kinds, strict=True)
  ]
  return leaves.grad_tree(received)


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
  validation.refuse_rules_chained_after("master_params", opt_state)
  result = params
  states: list[Any] = state_search.find_states(opt_state, MIXED_PRECISION_STATES)
  for state in states:
    mode = storage.MODE_OF_STATE[type(state)]

    def view(stored: Any, param: Any, mode: storage.Mode = mode) -> Any:
      if tree_lib.no_master(stored):
        return param
      return mode.kind_of_stored(stored, param).view(stored, jnp.asarray(param))

    try:
      result = jax.tree.map(view, mode.stored(state), result, is_leaf=tree_lib.no_master)
    except ValueError as error:
      raise ValueError(
        "master_params: params do not match the masters in opt_state: pass the params "
        "as the state was made for them (under nnx: nnx.as_pure(nnx.state(model, wrt)))."
      ) from error
  return result


def inner_state(opt_state: optax.OptState) -> optax.OptState:
  """The wrapped rule's state as plain optax would hold it.

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
