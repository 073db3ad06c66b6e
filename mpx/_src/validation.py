"""Checks of the transformations' inputs at trace time, each naming the leaf and
the fix (docs/guarantees.md); none costs the compiled step anything."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import state_search
from mpx._src import tree as tree_lib
from mpx._src.states import MIXED_PRECISION_STATES, LossScaleState
from mpx._src.tree import path_text


def positive_int(name: str, value: Any) -> int:
  """Returns a setting that must be an integer from 1 to int32's largest."""
  try:
    as_int = operator.index(value)
  except TypeError as error:
    raise ValueError(f"{name} must be an integer >= 1, got {value!r}.") from error
  if as_int < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {as_int}.")
  if as_int > jnp.iinfo(jnp.int32).max:
    raise ValueError(f"{name} must fit in int32, got {as_int}.")
  return as_int


def check_transformation(inner: Any, name: str = "inner") -> None:
  """Raises a TypeError unless ``inner`` looks like an optax transformation."""
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
      f"{name} must be an optax GradientTransformation (with init and update), "
      f"got {type(inner).__name__}. Did you pass the factory instead of calling "
      "it, e.g. optax.adam instead of optax.adam(1e-3)?"
    )


def check_mixed_precision_inputs(
  grads: Any,
  state: Any,
  params: Any,
  own_verdict: bool,
  init_like: Callable[[Any], Any],
) -> None:
  """Checks one ``mixed_precision`` step's inputs against each other, naming the
  leaf and the fix: the state against ``init_like(params)`` (the abstract
  state ``init`` builds for these params), the gradients against the params,
  and (``own_verdict``: no ``loss_scale`` agrees it) that the gradients vary
  over no mesh axis the counters do not."""
  if params is None:
    raise ValueError(
      "mixed_precision needs the current params: call tx.update(grads, opt_state, params)."
    )
  expected = init_like(params)
  if not isinstance(state, type(expected)):
    raise _wrong_state_type("mixed_precision", state, type(expected))

  # What the state stores per param leaf, against what init would store.
  def stored_mismatch(stored_def, params_def):
    return ValueError(
      "mixed_precision: params do not match the optimizer state (was the state "
      f"made by init on another tree?).\n  state: {stored_def}\n  params: {params_def}"
    )

  field = expected._fields[0]
  params_def: Any = jax.tree.structure(params, is_leaf=tree_lib.is_placeholder)
  flat_expected = params_def.flatten_up_to(getattr(expected, field))
  paired = zip_leaves(getattr(state, field), params, stored_mismatch)
  for (path, got, param), want in zip(paired, flat_expected, strict=True):
    if tree_lib.is_placeholder(want) and not tree_lib.is_placeholder(got):
      # A remainder's or a rounding key's master is float32.
      master = tree_lib.leaf_dtype(got) if tree_lib.is_floating(got) else np.dtype(np.float32)
      raise ValueError(
        f"mixed_precision: param {path_text(path)!r} is {describe(param)}, but the state "
        "holds a master for a narrower param: the params were widened. mpx's updates are "
        f"in {master}, and an apply that adds them without casting back (e.g. "
        "equinox.apply_updates) widens each param. Apply them with optax.apply_updates, "
        "which keeps every param's dtype (with equinox: eqx.partition the model, "
        "optax.apply_updates the arrays, eqx.combine)."
      )
    if tree_lib.is_placeholder(got) and not tree_lib.is_placeholder(want):
      raise ValueError(
        f"mixed_precision: param {path_text(path)!r} is {describe(param)} but the state "
        "holds no master for it (the state was initialised on wider params). "
        "Re-initialise, or use mpx.init_from_full_precision to start "
        "low-precision training from full-precision weights."
      )
    if tree_lib.is_placeholder(want):
      continue
    if np.shape(got) != np.shape(want) and np.shape(want) == np.shape(param):
      hint = ""
      if varying_axes(param):  # a shard of the param inside shard_map
        hint = (
          " Inside shard_map the state must be split like the params: "
          "mpx.zero1_shardings(tx, params, mesh, axis=None) gives its shardings (their "
          ".spec for in_specs and out_specs)."
        )
      raise ValueError(
        f"mixed_precision: param {path_text(path)!r} has shape {list(np.shape(param))} but its "
        f"master has shape {list(np.shape(got))}.{hint}"
      )
    if _layout(got) != _layout(want):
      raise ValueError(
        "mixed_precision: opt_state was not made by this transformation's init (or not "
        f"for these params): at {field}/{path_text(path)}: expected {describe(want)}, got "
        f"{describe(got)} (another masters= mode or master dtype?)."
      )

  check_gradients("mixed_precision", grads, params)
  if own_verdict:
    # FSDP under mixed_precision alone, which has no axis_name to agree the verdict.
    axes = varying_axes(grads)
    loose = axes - varying_axes(state.applied_steps)
    if loose:
      raise ValueError(
        f"mixed_precision: the gradients vary across mesh axis {_axes_text(loose)} "
        "(shard_map), so each device would decide alone whether to skip the step. Agree "
        "the verdict across them: mpx.static_loss_scale(tx, 1.0, axis_name="
        f"{_axes_arg(loose)}) for bfloat16 (a scale of 1 changes nothing else), or "
        f"mpx.loss_scale(tx, axis_name={_axes_arg(loose)}) for float16."
      )
  check_state_like("mixed_precision", state.inner_state, expected.inner_state, "inner_state/")


def check_loss_scale_inputs(
  grads: Any,
  state: Any,
  params: Any,
  rule: Any,
  axis_name: Any,
  inner_init: Callable[[Any], Any] | None,
) -> bool:
  """Checks one ``loss_scale`` step's inputs: the state's type, that a concrete
  state could come from ``rule`` (its ``ScaleRule``), that every device
  agrees the verdict (``axis_name``), and, given ``inner_init`` (the
  transformation does not hand the gradients to a ``mixed_precision``, which
  checks them itself), the gradients against the params and the inner state
  against ``inner_init``'s. Returns whether any gradient is per-example."""
  if not isinstance(state, LossScaleState):
    raise _wrong_state_type("loss_scale", state, LossScaleState)
  rule.check_state(state)
  # Gradients varying over an axis that neither axis_name reduces nor the loss
  # scale varies over: each device would skip on its own verdict.
  axes = varying_axes(grads)
  names = () if axis_name is None else axis_name
  reduced = frozenset(names if isinstance(names, tuple | list) else (names,))
  loose = axes - reduced - varying_axes(state.loss_scale)
  if loose:
    raise ValueError(
      f"loss_scale: the gradients vary across mesh axis {_axes_text(loose)} (shard_map), "
      f"but axis_name={axis_name!r} does not reduce the verdict over it and the loss scale "
      "is replicated over it: each device would decide alone whether to skip. Pass "
      f"axis_name={_axes_arg(reduced | loose)} so that every device agrees."
    )
  if params is None or inner_init is None:
    return False
  per_example = check_gradients("loss_scale", grads, params)
  expected = jax.eval_shape(inner_init, params)
  check_state_like("loss_scale", state.inner_state, expected, "inner_state/")
  return per_example


def check_inner_results(
  name: str, updates: Any, new_state: Any, old_state: Any, params: Any = None
) -> None:
  """Checks what the inner rule returned: its state with the types it was
  given, since a skipped step returns the old state, and (given ``params``) an
  update of each floating param's shape (per-example gradients reduced, as
  DP-SGD does)."""

  def updates_mismatch(updates_def, params_def):
    return ValueError(
      f"{name}: the inner rule's updates do not match params.\n  updates: {updates_def}"
      f"\n  params: {params_def}"
    )

  checked = [] if params is None else zip_leaves(updates, params, updates_mismatch)
  for path, update, param in checked:
    if tree_lib.is_floating(param) and np.shape(update) != np.shape(param):
      raise ValueError(
        f"{name}: the gradient of {path_text(path)!r} has leading axes beyond its param's shape "
        f"{list(np.shape(param))}, and the inner rule did not reduce them (its update "
        f"has shape {list(np.shape(update))}). Per-example gradients need a "
        "rule that reduces them, such as optax.contrib.dpsgd; otherwise pass gradients "
        "of the params' shapes."
      )

  def state_mismatch(new_def, old_def):
    return TypeError(
      f"{name}: the inner rule changed the structure of its state from {old_def} to {new_def}."
    )

  for path, new, old in zip_leaves(new_state, old_state, state_mismatch):
    if tree_lib.is_placeholder(new):
      continue
    if _layout(new) != _layout(old):
      raise TypeError(
        f"{name}: the inner rule changed the type of its state at {path_text(path)} from "
        f"{describe(old)} to {describe(new)}. {_changed_type_fix(name, old)}"
      )


def _changed_type_fix(name: str, old: Any) -> str:
  """Returns the fix for a rule whose state leaf ``old`` changed type in a step."""
  dtype = tree_lib.leaf_dtype(old)
  if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
    return (
      "Integer params reaching a rule such as Adam need optax.masked to keep the rule off them."
    )
  if name == "loss_scale" and tree_lib.is_floating(old) and jnp.finfo(dtype).bits < 32:
    return (
      "loss_scale unscales the gradients of 16-bit params in float32, and the rule "
      "made its state in the params' dtype: wrap the rule in mpx.mixed_precision "
      "(mpx.loss_scale(mpx.mixed_precision(rule))), whose state is float32."
    )
  return "A skipped step returns the old state, so the rule must keep its state's types."


def check_state_like(name: str, state: Any, expected: Any, prefix: str = "") -> None:
  """Checks that ``state`` has the structure, shapes and dtypes (weak types
  aside) of ``expected``, the abstract state this transformation's init builds."""
  intro = f"{name}: opt_state was not made by this transformation's init (or not for these params)"

  def mismatch(state_def, expected_def):
    return ValueError(f"{intro}: expected structure {expected_def}, got {state_def}.")

  for path, got, want in zip_leaves(state, expected, mismatch):
    if tree_lib.is_placeholder(want):
      continue
    if _layout(got) != _layout(want):
      raise ValueError(
        f"{intro}: at {prefix}{path_text(path)}: expected {describe(want)}, got {describe(got)}."
      )


def refuse_rules_chained_after(name: str, opt_state: Any) -> None:
  """Refuses an ``optax.chain`` that runs a rule after a ``mixed_precision``:
  its updates land each param on its new master's rounding, so any rule after
  it moves the params where the masters never go (docs/concepts.md)."""
  after = state_search.chained_after(opt_state, MIXED_PRECISION_STATES)
  if after:
    raise ValueError(
      f"{name}: an optax.chain runs {len(after)} rule(s) after mpx.mixed_precision. "
      "mixed_precision must wrap the whole rule: its updates land each param on its "
      "master's rounding, and a rule after it would move the params where the masters "
      "never go. Put every rule inside: "
      "mpx.mixed_precision(optax.chain(..., optax.scale(-lr)))."
    )


def describe(leaf: Any) -> str:
  """Describes a leaf as ``float32[2, 3]``-style text for error messages."""
  dtype = tree_lib.leaf_dtype(leaf)
  if dtype is None:
    return type(leaf).__name__
  return f"{dtype}{list(np.shape(leaf))}"


def zip_leaves(
  first: Any,
  second: Any,
  mismatch: Callable[[Any, Any], Exception],
) -> Iterator[tuple[tuple[Any, ...], Any, Any]]:
  """Yields ``(key path, leaf of first, leaf of second)`` for two trees of one
  structure, holes (None, ``optax.MaskedNode``) counted as leaves; raises
  ``mismatch(first_treedef, second_treedef)`` if the structures differ."""
  first_def: Any = jax.tree.structure(first, is_leaf=tree_lib.is_placeholder)
  second_def: Any = jax.tree.structure(second, is_leaf=tree_lib.is_placeholder)
  if first_def != second_def:
    raise mismatch(first_def, second_def)
  flat, _ = jax.tree_util.tree_flatten_with_path(first, is_leaf=tree_lib.is_placeholder)
  for (path, a), b in zip(flat, second_def.flatten_up_to(second), strict=True):
    yield path, a, b


def varying_axes(tree: Any) -> frozenset[Any]:
  """Returns the mesh axes any leaf of ``tree`` (a leaf alone, too) varies over
  inside a ``shard_map`` that checks them (``check_vma=True``, its default);
  empty elsewhere.

  Read from ``manual_axis_type.varying`` (jax 0.10) or ``vma`` (0.6.1 to 0.9);
  older types carry none (tests/test_shard_map_vma.py pins each)."""
  axes: set[Any] = set()
  for leaf in jax.tree.leaves(tree):
    try:
      aval = jax.typeof(leaf)
    except TypeError:
      continue
    manual = getattr(aval, "manual_axis_type", None)
    axes.update(getattr(manual, "varying", None) or getattr(aval, "vma", None) or ())
  return frozenset(axes)


def _layout(leaf: Any) -> tuple[tuple[int, ...], Any]:
  """Returns a leaf's shape and dtype (weak types aside), what states compare."""
  return tuple(np.shape(leaf)), tree_lib.leaf_dtype(leaf)


def _axes_text(axes: frozenset[Any]) -> str:
  return ", ".join(repr(a) for a in sorted(axes, key=str))


def _axes_arg(axes: frozenset[Any]) -> str:
  """Spells the axes as an ``axis_name`` argument: one name, or a tuple."""
  names = tuple(sorted(axes, key=str))
  return repr(names[0] if len(names) == 1 else names)


def _wrong_state_type(name: str, state: Any, state_type: type) -> TypeError:
  """Returns the error for a state that is not a ``state_type``; a dict gets the
  fix for a checkpoint restored without a target, which is how one arrives."""
  hint = "pass the state made by this transformation's init."
  if isinstance(state, Mapping):
    hint = (
      "a checkpoint restored without a target comes back as dicts: restore it with the "
      "state from tx.init as the target (orbax: checkpointer.restore(path, target))."
    )
  return TypeError(
    f"{name}.update got a state of type {type(state).__name__}, not {state_type.__name__}: {hint}"
  )


def check_gradients(name: str, grads: Any, params: Any) -> bool:
  """Checks that ``grads`` have the structure of ``tree.gradient_params(params)``,
  each floating param a floating gradient of its shape (a broadcastable one
  would broadcast silently) or of it behind per-example axes, varying over no
  mesh axis its param does not (per-device gradients of replicated params
  inside ``shard_map``, which ``lax.cond`` would refuse later naming neither
  the leaf nor the fix); returns whether any are per-example (then
  :func:`check_inner_results` checks the rule reduced them)."""

  def mismatch(grads_def, params_def):
    return ValueError(
      f"{name}: gradients do not match params.\n  gradients: {grads_def}\n  params: {params_def}"
    )

  per_example = False
  for path, grad, param in zip_leaves(grads, tree_lib.gradient_params(params), mismatch):
    if param is None and grad is not None:
      raise ValueError(
        f"{name}: gradient {path_text(path)!r} is {describe(grad)} but its param is None: "
        "pass None there too, as jax.grad does for a None leaf."
      )
    if tree_lib.is_placeholder(param) or not tree_lib.is_floating(param):
      continue  # integer params take integer or float0 gradients
    if not tree_lib.is_floating(grad):
      raise ValueError(
        f"{name}: gradient {path_text(path)!r} is {tree_lib.leaf_dtype(grad)} but its param is "
        f"{tree_lib.leaf_dtype(param)}: the gradient of a floating param must be floating."
      )
    extra = varying_axes(grad) - varying_axes(param)
    if extra:
      axes, arg = _axes_text(extra), _axes_arg(extra)
      raise ValueError(
        f"{name}: gradient {path_text(path)!r} varies across mesh axis {axes} (shard_map) but its "
        "param does not: each device would update its copy of the param and its state its "
        f"own way. Reduce the gradients over {axes} first (jax.lax.pmean(grads, {arg})), or "
        "take jax.grad with respect to the replicated params, which reduces them; or give "
        f"the params and the optimizer state that axis (in_specs P({axes}))."
      )
    grad_shape, shape = np.shape(grad), np.shape(param)
    if grad_shape == shape:
      continue
    if len(grad_shape) > len(shape) and grad_shape[len(grad_shape) - len(shape) :] == shape:
      per_example = True  # allowed if the inner rule reduces the leading axes
      continue
    raise ValueError(
      f"{name}: gradient {path_text(path)!r} has shape {list(grad_shape)} but its param has "
      f"shape {list(shape)}."
    )
  return per_example


# optax's centered RMSprop (scale_by_stddev) divides by sqrt(nu - mu**2 + eps).
# Where the gradient barely varies, nu - mu**2 is far below nu and mu**2, and
# any code's rounding of either (bfloat16's too) makes it negative: a NaN update.
_NEEDS_NU_ABOVE_MU_SQUARED = {"ScaleByRStdDevState": ("mu", "nu")}


def check_field_compressible(state_name: str, field: str, code: str) -> None:
  """Refuses to store ``field`` of a state whose rule needs it exact in ``code``."""
  if field in _NEEDS_NU_ABOVE_MU_SQUARED.get(state_name, ()):
    raise ValueError(
      f"mixed_precision: {state_name}.{field} (optax.rmsprop(centered=True)) cannot be "
      f"stored in {code}: the rule divides by sqrt(nu - mu**2 + eps), and where a "
      "gradient barely varies the rounding of nu or mu makes nu - mu**2 negative (a NaN "
      "update). Keep its moments in float32 (moments='full'), or compress only its "
      "momentum (moments={'trace': '8bit'})."
    )
