"""``mixed_precision``: master weights inside the optimizer state; its
``update_fn`` is the four steps docs/design.md draws."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import (
  adapters,
  compat,
  full_precision,
  leaf_skip,
  rounding,
  state_search,
  storage,
  two_pass,
  validation,
  variables,
  verdict,
)
from mpx._src import moments as moments_lib
from mpx._src import tree as tree_lib
from mpx._src.states import MIXED_PRECISION_STATES, AccumulationState, LossScaleState


def mixed_precision(
  inner: optax.GradientTransformation,
  dtype: jax.typing.DTypeLike = jnp.float32,
  *,
  masters: str = "full",
  moments: str = "full",
  moment_fields: Sequence[str] | Mapping[str, str] = moments_lib.DEFAULT_FIELDS,
  seed: int = 0,
  skip: str = "step",
) -> verdict.TakesLossScaledGradients:
  """Keeps ``dtype`` master weights and runs ``inner`` on them.

  Every floating param narrower than ``dtype`` has a master; ``inner`` runs on
  the masters (other leaves as they are), and the updates land each param on
  its new master's rounding. A step whose gradients, as ``inner`` receives
  them, hold inf or NaN is skipped: zero updates, the state unchanged but
  ``nonfinite_steps``. Wrap the whole rule. Modes: docs/concepts_masters.md.

  Args:
    inner: the optax rule to run in high precision, e.g. ``optax.adamw(3e-4)``.
    dtype: the floating dtype of the masters and of the inner rule.
    masters: ``"full"`` (a ``dtype`` copy), or for bfloat16 params under
      float32 masters ``"remainder"`` (its low 16 bits), ``"24bit"`` (their
      top 8 bits: :func:`mpx.check_master_precision`) or ``"stochastic"``
      (no master; stochastic rounding).
    moments: ``"full"``, ``"bfloat16"``, ``"8bit"`` or ``"4bit"``: how the
      leaves of 4096 elements or more under ``moment_fields`` are stored; or
      a mapping of fields to formats, e.g. ``{"mu": "8bit", "nu": "4bit"}``.
    moment_fields: the fields ``moments`` compresses: a sequence (``nu`` and
      ``nu_max`` non-negative) or a mapping to ``"signed"``/``"nonnegative"``.
    seed: the seed of the random bits of stochastic rounding (an integer).
    skip: ``"step"`` or ``"leaf"`` (only leaves with a non-finite gradient kept: docs/howto.md).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (state: :class:`~mpx.MixedPrecisionState`
    or a variant); ``update`` requires ``params`` and forwards extra arguments.

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
  if skip not in ("step", "leaf"):
    raise ValueError(f"mixed_precision: skip must be 'step' or 'leaf', got {skip!r}.")
  validation.check_transformation(inner)
  step = _Step(optax.with_extra_args_support(inner), dtype, mode, moments_format, seed, skip)
  return verdict.TakesLossScaledGradients(
    step.init_fn, tree_lib.through_linen_boxes(step.update_fn)
  )


@dataclasses.dataclass(frozen=True)
class _Step:
  """One ``mixed_precision`` setting: its ``init_fn`` and ``update_fn`` (the four
  steps docs/design.md draws), and ``init_like``, the abstract state ``init_fn``
  builds."""

  inner: optax.GradientTransformationExtraArgs
  dtype: Any
  mode: storage.Mode
  moments_format: moments_lib.MomentsFormat
  seed: int
  skip: str

  def init_fn(self, params: optax.Params) -> Any:
    """Returns the state for ``params``: what each leaf's kind stores, the
    counts, and the inner rule's state of the masters (its moments stored)."""
    mode, moments_format = self.mode, self.moments_format
    adapters.refuse_fp8_metadata("mixed_precision", params)
    _require_dtype_enabled(self.dtype)
    paths, flat, treedef = _flatten(params)
    compat.check_float8_supported({getattr(p, "dtype", None) for p in flat})
    kinds = [mode.kind_for(p, self.dtype, path) for path, p in zip(paths, flat, strict=True)]
    sources = full_precision.full_precision_sources(flat, kinds)
    stored = [
      storage.initialized(kind, param, sources, index, self.seed)
      for index, (kind, param) in enumerate(zip(kinds, flat, strict=True))
    ]
    masters = [storage.viewed(kind, s, p) for kind, s, p in zip(kinds, stored, flat, strict=True)]
    inner_state = tree_lib.strong_types(self.inner.init(treedef.unflatten(masters)))
    _refuse_wrappers_inside(inner_state)
    # optax's params placeholder (tree_map_params, zero1_shardings) stands for
    # the whole tree: the inner state it makes has no moment fields to find.
    if not variables.is_optax_placeholder(params):
      moments_format.check_fields(inner_state)
    # Two arrays, not one: a step that donates the state donates each buffer once.
    applied_steps, nonfinite_steps = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    if moments_format.compresses:
      inner_state = moments_lib.compressed(moments_format, inner_state, applied_steps)
    state = mode.state(treedef.unflatten(stored), applied_steps, nonfinite_steps, inner_state)
    compressed_as = moments_format.name if moments_format.compresses else None
    return variables.fit_variables(state, compressed_as, linen_boxes=True)

  def update_fn(
    self,
    updates: optax.Updates,
    state: Any,
    params: optax.Params | None,
    unscaling: verdict.Unscaling | None,
    *,
    step_due: jax.Array | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, Any, jax.Array]:
    """Returns ``(param updates, new state, applied)``: one step, or its skip.
    Where ``step_due`` (a scalar bool) is false the step is neither applied
    nor counted as skipped (``accumulate`` between windows)."""
    mode, moments_format = self.mode, self.moments_format
    layer = extra_args.pop(rounding.STACKED_LAYER, None)  # mpx.scan_layers' layer, for no rule
    # 1. Check the inputs against each other, and line them up leaf by leaf
    #    (at trace time; what init would build for these params is the reference).
    validation.check_mixed_precision_inputs(
      updates, state, params, unscaling is None, self.init_like
    )
    # Random bits count applied steps; a layer of mpx.scan_layers' stack draws
    # the stacked leaf's bits for that layer (rounding.StackedCount).
    count = (
      state.applied_steps if layer is None else rounding.StackedCount(state.applied_steps, layer)
    )
    leaves = _Leaves.align(mode, self.dtype, updates, params, getattr(state, mode.stored_field))
    stored = _Stored(leaves.stored, state.inner_state)
    # The step as the accelerator's first pass runs it again for the new 8-
    # and 4-bit moments' block maxima (two_pass.py), old moments read by table;
    # a pytree, so that a jitted step takes its arrays as arguments.
    step_again = jax.tree_util.Partial(
      self._step_on_masters,
      unscaling=unscaling,
      applied_steps=count,
      extra_args=extra_args,
      decompress=functools.partial(moments_lib.decompressed, by_table=True),
    )
    if self.skip == "leaf":
      return self._update_by_leaf(
        state, leaves, stored, params, unscaling, step_due, extra_args, step_again, count
      )
    # 2. The verdict, on each gradient as the inner rule will receive it; with
    #    8- or 4-bit moments, on accelerators, read with their block maxima in
    #    the first of two passes (two_pass.first_pass), which also reads the
    #    24-bit masters' stall check.
    scales = first_stalled = None
    if moments_format.block_scaled:
      finite, scales, first_stalled = tree_lib.by_platform(
        cpu=lambda: (
          verdict.gradients_finite(leaves.grads, leaves.received_dtypes, unscaling),
          # Unread: the stored scales (each block-scaled moment's second
          # field), in the maxima's shapes and dtypes.
          [
            x[1] if isinstance(x, moments_lib.BLOCK_SCALED_TYPES) else None
            for x in jax.tree.leaves(state.inner_state, is_leaf=moments_lib.is_compressed)
          ],
          jnp.zeros((), bool),  # unread
        ),
        accelerator=lambda: two_pass.first_pass(
          moments_format, step_again, stored, leaves, unscaling
        ),
      )
    else:
      finite = verdict.gradients_finite(leaves.grads, leaves.received_dtypes, unscaling)
    # A step not due joins the skip's one select (or cond), not one of its own.
    applies = finite if step_due is None else jnp.logical_and(finite, step_due)
    # 3. The step on the masters; on a skipped step nothing is written.
    step: Callable[..., tuple[_Stored, list[Any]]] = self._step_on_masters
    args: tuple[Any, ...] = (unscaling, count, extra_args)
    if moments_format.compresses:
      step, args = self._step_with_compressed_moments, (*args, scales)
    new, handoffs, applied = verdict.run_if_finite(
      applies,
      step,
      stored,
      dataclasses.replace(leaves, stored=[]),  # the step gets them as its state
      *args,
      select=two_pass.kept if moments_format.block_scaled else None,
    )
    # 4. After the skip: the param updates (they fuse into optax.apply_updates).
    param_updates = [
      kind.param_update(stored, handoff, param, applied)
      for kind, stored, handoff, param in zip(
        leaves.kinds, new.per_param, handoffs, leaves.params, strict=True
      )
    ]
    applied_steps = state.applied_steps + applied.astype(jnp.int32)
    skipped = jnp.logical_not(applied)
    if step_due is not None:
      skipped = jnp.logical_and(step_due, skipped)
    nonfinite_steps = state.nonfinite_steps + skipped.astype(jnp.int32)
    stalled_steps = None
    if mode.counts_stalls:
      stalled_steps = mode.stalled_steps(state, handoffs, first_stalled, applied)
    new_state = mode.state(
      leaves.treedef.unflatten(new.per_param),
      applied_steps,
      nonfinite_steps,
      new.inner,
      stalled_steps,
    )
    return leaves.treedef.unflatten(param_updates), new_state, applied

  def _update_by_leaf(
    self,
    state: Any,
    leaves: _Leaves,
    stored: _Stored,
    params: Any,
    unscaling: verdict.Unscaling | None,
    step_due: jax.Array | None,
    extra_args: dict[str, Any],
    step_again: Callable[..., tuple[_Stored, list[Any]]],
    count: jax.Array | rounding.StackedCount,
  ) -> tuple[optax.Updates, Any, jax.Array]:
    """``update_fn`` with ``skip="leaf"``: the step run on every leaf, then each
    leaf's new master, moments and update kept where its gradient is finite
    (and ``step_due``). No select reads every gradient, so XLA updates each
    leaf as its gradient arrives; on accelerators 8- and 4-bit moments are coded in
    two passes leaf by leaf (``two_pass.maxima_by_leaf``)."""
    if unscaling is not None:
      raise ValueError(
        "loss_scale: a mixed_precision with skip='leaf' cannot be its inner rule. An "
        "overflowing float16 step means the loss scale is too high for the whole step: "
        "loss_scale backs off and skips the step whole. Use skip='step' under loss_scale."
      )
    if leaves.grad_treedef != leaves.treedef:
      raise ValueError(
        "mixed_precision: skip='leaf' needs gradients shaped like the params "
        "(optax.lookahead's are not); use skip='step'."
      )
    finite = leaf_skip.finite_by_leaf(leaves.grads, leaves.received_dtypes)
    flags = finite if step_due is None else [jnp.logical_and(f, step_due) for f in finite]

    def step(
      stored: _Stored,
      leaves: _Leaves,
      applied_steps: jax.Array,
      extra_args: dict[str, Any],
      step_again: Callable[..., tuple[_Stored, list[Any]]],
    ) -> tuple[_Stored, list[Any]]:
      if not self.moments_format.compresses:
        return self._step_on_masters(stored, leaves, None, applied_steps, extra_args)
      scales = None
      if self.moments_format.block_scaled:  # on accelerators, two passes leaf by leaf
        # Unread in XLA:CPU's program (it codes in one pass), where XLA drops it.
        scales = two_pass.maxima_by_leaf(self.moments_format, step_again, stored, leaves)
      return self._step_with_compressed_moments(
        stored, leaves, None, applied_steps, extra_args, scales
      )

    # Called eagerly too, the step computes the jitted step's bits.
    on_arrays, arrays = verdict.on_array_arguments(
      step, (stored, leaves, count, extra_args, step_again)
    )
    new, handoffs = on_arrays(arrays)
    applied = jnp.stack(flags).any()
    per_param = [
      tree_lib.select_tree(*x) for x in zip(flags, new.per_param, stored.per_param, strict=True)
    ]
    handoffs = [leaf_skip.zeroed(f, h) for f, h in zip(flags, handoffs, strict=True)]
    per_param, handoffs = leaf_skip.stalls_read_with(per_param, handoffs)
    paths, _, _ = _flatten(params)
    inner = leaf_skip.kept_by_param(
      new.inner,
      stored.inner,
      paths,
      flags,
      step_due,
      is_leaf=moments_lib.is_compressed,
      select=two_pass.kept if self.moments_format.block_scaled else None,
    )
    param_updates = [
      kind.param_update(s, h, p, f)
      for kind, s, h, p, f in zip(
        leaves.kinds, per_param, handoffs, leaves.params, flags, strict=True
      )
    ]
    touched = jnp.logical_not(jnp.stack(finite).all())
    if step_due is not None:
      touched = jnp.logical_and(step_due, touched)
    stalled_steps = None
    if self.mode.counts_stalls:
      stalled_steps = self.mode.stalled_steps(state, handoffs, None, applied)
    new_state = self.mode.state(
      leaves.treedef.unflatten(per_param),
      state.applied_steps + applied.astype(jnp.int32),
      state.nonfinite_steps + touched.astype(jnp.int32),
      inner,
      stalled_steps,
    )
    return leaves.treedef.unflatten(param_updates), new_state, applied

  def init_like(self, params: Any) -> Any:
    """Returns the abstract state ``init`` builds for params shaped like ``params``."""
    paths, flat, treedef = _flatten(params)
    kinds = [self.mode.kind_for(p, self.dtype, path) for path, p in zip(paths, flat, strict=True)]
    masters_like = [
      p if k.master_dtype is None else jax.ShapeDtypeStruct(np.shape(p), k.master_dtype)
      for k, p in zip(kinds, flat, strict=True)
    ]
    inner_like = jax.eval_shape(self.inner.init, treedef.unflatten(masters_like))
    counter = jax.ShapeDtypeStruct((), jnp.int32)
    if self.moments_format.compresses:
      # What the step's own coder stores, so that the two cannot disagree.
      store = functools.partial(moments_lib.compressed, self.moments_format)
      inner_like = jax.eval_shape(store, inner_like, counter)
    stored_like = [k.stored_like(p) for k, p in zip(kinds, flat, strict=True)]
    return self.mode.state(treedef.unflatten(stored_like), counter, counter, inner_like, counter)

  def _step_on_masters(
    self,
    stored: _Stored,
    leaves: _Leaves,
    unscaling: verdict.Unscaling | None,
    applied_steps: jax.Array,
    extra_args: dict[str, Any],
    decompress: Callable[[Any], Any] | None = None,
  ) -> tuple[_Stored, list[Any]]:
    """Runs the inner rule on the master view and commits each leaf.

    Returns ``(new stored, handoffs)``: what the state stores next (the inner
    state as the inner rule made it), and what each leaf's ``param_update``
    reads after the skip. ``decompress`` reads the stored inner state for the
    inner rule (None: it is stored as the rule made it).
    """
    received = [
      verdict.received(g, d, unscaling)
      for g, d in zip(leaves.grads, leaves.received_dtypes, strict=True)
    ]
    masters = [
      k.view(s, p) for k, s, p in zip(leaves.kinds, stored.per_param, leaves.params, strict=True)
    ]
    inner_state = stored.inner if decompress is None else decompress(stored.inner)
    # optax.lbfgs's grad= is received as the gradients are.
    received_extra = {
      name: adapters.received_like_grads(
        value, leaves.grad_treedef, leaves.grads, leaves.received_dtypes
      )
      if name == adapters.EXTRA_GRADIENT_ARG
      else value
      for name, value in extra_args.items()
    }
    masters_tree = leaves.treedef.unflatten(masters)
    inner_updates, new_inner = self.inner.update(
      leaves.grad_treedef.unflatten(received), inner_state, masters_tree, **received_extra
    )
    validation.check_inner_results(
      "mixed_precision", inner_updates, new_inner, inner_state, masters_tree
    )
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
    return _Stored([c.stored for c in committed], new_inner), [c.handoff for c in committed]

  def _step_with_compressed_moments(
    self,
    stored: _Stored,
    leaves: _Leaves,
    unscaling: verdict.Unscaling | None,
    applied_steps: jax.Array,
    extra_args: dict[str, Any],
    scales: list[jax.Array | None] | None,
  ) -> tuple[_Stored, list[Any]]:
    """Returns :meth:`_step_on_masters`'s results, the inner rule's moments
    read from and stored back in the format's compressed form. ``scales``: what
    the accelerator's program codes 8- and 4-bit moments against
    (``two_pass.first_pass``), or None."""
    new, handoffs = self._step_on_masters(
      stored, leaves, unscaling, applied_steps, extra_args, moments_lib.decompressed
    )
    others = jax.tree.leaves([new.per_param, handoffs])
    store = functools.partial(
      moments_lib.compressed,
      self.moments_format,
      new.inner,
      applied_steps,
      previous=stored.inner,
    )
    if scales is None:
      inner = store(others)
    else:  # the accelerator's second pass; XLA:CPU's program codes in one pass
      second_pass = functools.partial(store, None, scales)
      inner = tree_lib.by_platform(cpu=functools.partial(store, others), accelerator=second_pass)
    return _Stored(new.per_param, inner), handoffs


class _Stored(NamedTuple):
  """What the state stores: per param leaf (flat), and the inner state (as
  stored); the step's state, kept as it is on a skipped step."""

  per_param: list[Any]
  inner: Any


@dataclasses.dataclass(frozen=True)
class _Leaves:
  """One step's params and what is stored for them, lined up leaf for leaf
  (``MaskedNode`` where a param has nothing stored) with each leaf's storage
  kind; and the gradients, with the dtype each is received in (None: as it
  is). The gradients mirror the params (``tree.gradient_params``: all of
  them, or ``optax.lookahead``'s fast weights)."""

  treedef: Any
  kinds: list[storage.StorageKind]
  params: list[Any]
  stored: list[Any]
  grads: list[Any]
  grad_treedef: Any
  received_dtypes: list[Any]

  @classmethod
  def align(cls, mode: storage.Mode, dtype: Any, grads: Any, params: Any, stored: Any) -> _Leaves:
    """Lines the trees up (checked against each other before)."""
    paths, params_flat, treedef = _flatten(params)
    kinds = [mode.kind_for(p, dtype, path) for path, p in zip(paths, params_flat, strict=True)]
    mirrored = tree_lib.gradient_params(params)
    grad_kinds = kinds
    if mirrored is not params:
      grad_paths, grad_params, _ = _flatten(mirrored)
      grad_kinds = [
        mode.kind_for(p, dtype, q) for q, p in zip(grad_paths, grad_params, strict=True)
      ]
    grad_treedef: Any = jax.tree.structure(mirrored, is_leaf=tree_lib.is_masked_node)
    return cls(
      treedef,
      kinds,
      params_flat,
      treedef.flatten_up_to(stored),
      grad_treedef.flatten_up_to(grads),
      grad_treedef,
      [kind.master_dtype for kind in grad_kinds],
    )


# A pytree of the step's arrays, so that verdict.run_if_finite passes them to
# the jitted step as arguments.
jax.tree_util.register_dataclass(
  _Leaves,
  data_fields=["params", "stored", "grads"],
  meta_fields=["treedef", "kinds", "grad_treedef", "received_dtypes"],
)


def _flatten(tree: Any) -> tuple[list[tuple[Any, ...]], list[Any], Any]:
  """Returns ``(key paths, leaves, treedef)`` with ``optax.MaskedNode`` as a leaf
  (the holes ``optax.partition`` and ``masked`` leave)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=tree_lib.is_masked_node)
  return [path for path, _ in flat], [leaf for _, leaf in flat], treedef


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


def _refuse_wrappers_inside(inner_state: Any) -> None:
  if state_search.find_states(inner_state, AccumulationState):
    raise ValueError(
      "mixed_precision wraps an mpx.accumulate: every micro-batch would run "
      "mixed_precision's whole step for nothing, and mpx.accumulate_gradients would "
      "bypass its verdict. Nest them the other way: "
      "mpx.accumulate(mpx.mixed_precision(inner), k)."
    )
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
  # A flax linen box around a param (nn.Partitioned) may hold an unboxed
  # stored leaf (a rounding key): the masters are read unboxed, then boxed
  # like the params.
  boxed = params if tree_lib.has_linen_boxes(params) else None
  if boxed is not None:
    params, opt_state = tree_lib.without_linen_boxes((params, opt_state))
  result = params
  states: list[Any] = state_search.find_states(opt_state, MIXED_PRECISION_STATES)
  for state in states:
    mode = storage.MODE_OF_STATE[type(state)]
    try:
      result = mode.map_stored(storage.viewed, state, result)
    except ValueError as error:
      raise ValueError(
        "master_params: params do not match the masters in opt_state: pass the params "
        "as the state was made for them (under nnx: nnx.as_pure(nnx.state(model, wrt)))."
      ) from error
  return result if boxed is None else tree_lib.boxed_like(boxed, result)


def inner_state(opt_state: optax.OptState) -> optax.OptState:
  """Returns the wrapped rule's state as plain optax would hold it.

  Finds the one :func:`mixed_precision` state in ``opt_state`` (at any depth:
  under ``loss_scale``, chain, ``MultiSteps``, ``inject_hyperparams``) and
  returns its ``inner_state`` with every compressed moment (``moments=
  "bfloat16"``, ``"8bit"`` or ``"4bit"``) decompressed to float32; with ``moments="full"``
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
