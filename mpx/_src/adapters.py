"""What other libraries' rules and layers need of mpx (optax's lookahead, L-BFGS
and SM3; flax's fp8 layers and linen boxes), kept out of the step."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from mpx._src import tree as tree_lib
from mpx._src import verdict
from mpx._src.moment_codes import Sign

# optax.lookahead: the gradients mirror the fast weights of LookaheadParams.


def gradient_params(params: Any) -> Any:
  """Returns the part of ``params`` that gradients mirror: the fast weights of
  ``optax.lookahead``'s ``LookaheadParams``, else ``params``."""
  return params.fast if isinstance(params, optax.LookaheadParams) else params


# optax.lbfgs: extra arguments computed from the (scaled) loss like the
# gradients; "grad" is shaped like them.
EXTRA_ARGS_FROM_THE_LOSS = ("value", "grad")
EXTRA_GRADIENT_ARG = "grad"


def received_like_grads(value: Any, grad_treedef: Any, grads: list[Any], dtypes: list[Any]) -> Any:
  """Receives an extra argument shaped like the gradients (L-BFGS's ``grad=``)
  leaf by leaf in the dtype each gradient is received in (``dtypes``), so the
  inner rule never sees a low-precision number. Anything else passes as it is."""
  try:
    flat = grad_treedef.flatten_up_to(value)
  except (ValueError, TypeError):
    return value
  if any(np.shape(v) != np.shape(g) for v, g in zip(flat, grads, strict=True)):
    return value
  received = [verdict.received(v, d, None) for v, d in zip(flat, dtypes, strict=True)]
  return grad_treedef.unflatten(received)


# optax's scale_by_sm3 keeps its accumulators of squares in ``mu`` and its
# momentum in ``nu``, against the naming rule the compressed moments follow.
KNOWN_SIGNS: dict[tuple[str, str], Sign] = {
  ("ScaleBySM3State", "mu"): "nonnegative",
  ("ScaleBySM3State", "nu"): "signed",
}

# optax's centered RMSprop (scale_by_stddev) divides by sqrt(nu - mu**2 + eps).
# Where the gradient barely varies, nu - mu**2 is far below nu and mu**2, and
# any code's rounding of either (bfloat16's too) makes it negative: a NaN update.
_NEEDS_NU_ABOVE_MU_SQUARED = {"ScaleByRStdDevState": ("mu", "nu")}


def refuse_compressed(state_name: str, field: str, code: str) -> None:
  """Refuses to store ``field`` of a state whose rule needs it exact in ``code``."""
  if field in _NEEDS_NU_ABOVE_MU_SQUARED.get(state_name, ()):
    raise ValueError(
      f"mixed_precision: {state_name}.{field} (optax.rmsprop(centered=True)) cannot be "
      f"stored in {code}: the rule divides by sqrt(nu - mu**2 + eps), and where a "
      "gradient barely varies the rounding of nu or mu makes nu - mu**2 negative (a NaN "
      "update). Keep its moments in float32 (moments='full'), or compress only its "
      "momentum (moments={'trace': '8bit'})."
    )


# flax.linen's fp8 layers keep their scales and amax histories in this
# collection; its "gradients" are their new values.
FP8_COLLECTION = "_overwrite_with_gradient"


def refuse_fp8_metadata(name: str, params: Any) -> None:
  """Refuses flax fp8 metadata among the params: an optimizer would step on
  the new values that come as their "gradients", and a skip would drop them."""
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    if any(getattr(key, "key", None) == FP8_COLLECTION for key in path):
      raise ValueError(
        f"{name}: the params hold flax's {FP8_COLLECTION!r} collection (fp8 scales "
        "and amax histories, at "
        f"{tree_lib.path_str(path)!r}). Their 'gradients' are new values, not "
        "gradients: give the optimizer variables['params'] only, and take the new "
        "values when the step is applied (flax's TrainState splits the collection "
        "off; see 'Train flax fp8 layers' in docs/howto.md for the skip-safe recipe)."
      )


# flax.linen's boxes (nn.Partitioned) around params, gradients and state leaves.


def through_linen_boxes(update_fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a ``mixed_precision`` ``update`` to take params, gradients and state
  in flax linen boxes (``nn.Partitioned``, e.g. a linen ``TrainState`` with
  ``nn.with_partitioning``): it runs on the unboxed trees, and returns the
  updates boxed like the params and the state boxed like the state it got."""

  @functools.wraps(update_fn)
  def update(updates: Any, state: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    # has_linen_boxes inline: every step of every mode passes here.
    meta = sys.modules.get("flax.core.meta")  # flax not imported: no box to see
    if meta is None or params is None:
      return update_fn(updates, state, params, *args, **kwargs)
    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
      return update_fn(updates, state, params, *args, **kwargs)
    new_updates, new_state, *rest = update_fn(
      without_linen_boxes(updates),
      without_linen_boxes(state),
      without_linen_boxes(params),
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


def without_linen_boxes(tree: Any) -> Any:
  """Returns ``tree`` with every flax linen box replaced by what it holds."""
  return jax.tree.map(lambda x: unboxed(x) if is_linen_box(x) else x, tree, is_leaf=is_linen_box)


def boxed_like(boxed: Any, tree: Any) -> Any:
  """Returns the leaves of ``tree`` (an unboxed tree of ``boxed``'s shape) in
  ``boxed``'s boxes."""
  return jax.tree_util.tree_unflatten(jax.tree.structure(boxed), jax.tree.leaves(tree))


def unboxed(box: Any) -> Any:
  """Returns what a linen box holds, with no sharding constraint (``nn.Partitioned``
  applies one under a mesh)."""
  return box.value if hasattr(box, "value") else box.unbox()
