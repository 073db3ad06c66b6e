"""What other libraries' rules and layers need of mpx (optax's L-BFGS and SM3,
flax's fp8 layers), kept out of the step."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mpx._src import tree as tree_lib
from mpx._src import verdict
from mpx._src.moment_codes import Sign

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
