"""The optimizer step alone: plain Adam vs mpx vs hand-written vs the peers.

Every variant is one jitted ``step(state, grads) -> state`` with its state
donated; :data:`VARIANTS` lists them, :func:`build_cases` builds them on a tree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import mpx
from benchmarks.common import Case
from benchmarks.hand_written import (
  build_hand,
  build_hand_bf16,
  build_hand_check,
  build_hand_cond,
  build_hand_cond_bf16,
  build_hand_cond_flag,
  build_hand_select,
)
from benchmarks.peers import (
  build_apply_if_finite,
  build_flax,
  build_fp32,
  build_jmp,
  build_mpfj,
  load_peers,
)
from benchmarks.probes import CHECK_COPY, ROOF_AXPY, ROOF_COPY, ROOF_ELEMENTS, probes
from benchmarks.trees import (
  BF16,
  F16,
  F32,
  Grads,
  PyTree,
  adam,
  copy_tree,
  is_shape,
  make_arrays,
  make_grads,
  many_leaf_shapes,
  n_params,
  param_shapes,
  with_inf,
)

# What run.py, moments.py, the compile-time benchmarks and their tests import
# from here, the re-exported names of the modules above among them.
__all__ = [
  "BASELINE", "HAND", "HAND_BF16", "HAND_COND", "HAND_COND_BF16", "MPX_BF16", "MPX_REMAINDER",
  "MPX_STOCHASTIC", "HAND_OF", "CHECK_THEN_APPLY", "Variant", "VARIANTS", "build_cases",
  "state_bytes_per_param", "mpx_state_overhead", "adam_state_bytes", "mpx_step",
  "mpx_bf16_state", "build_mpx_bf16", "build_mpx_fp16", "BF16", "Grads", "make_arrays",
  "make_grads", "n_params", "param_shapes", "many_leaf_shapes", "with_inf", "load_peers",
  "probes", "ROOF_ELEMENTS", "ROOF_COPY", "ROOF_AXPY", "CHECK_COPY", "build_fp32",
  "build_hand_bf16", "build_hand_cond", "build_hand_cond_bf16",
]  # fmt: skip

BASELINE = "optax adam fp32"
HAND = "hand-written fp16 (no safety)"
HAND_BF16 = "hand-written bf16 (no safety)"
MPX_BF16 = "mpx bf16"
MPX_REMAINDER = "mpx bf16 remainder"
MPX_STOCHASTIC = "mpx bf16 stochastic"
HAND_COND = "hand + cond"
HAND_COND_BF16 = "hand bf16 + cond"
# The step without safety of each param dtype: what the cost of safety is measured from.
HAND_OF = {"float16": HAND, "bfloat16": HAND_BF16}
# The check-then-apply step of each param dtype (float32 masters, the step in
# lax.cond(mpx.all_finite(grads))): what mpx's speed and compile time are held to.
CHECK_THEN_APPLY = {"float16": HAND_COND, "bfloat16": HAND_COND_BF16}

# Bytes each variant must move per parameter at minimum (docs/benchmarks.md
# derives them): reading and writing param, master and Adam's moments, plus one
# more read of 16-bit gradients for a step that checks before it writes.
MIN_BYTES_FP32 = 28
MIN_BYTES_NO_CHECK = 28
MIN_BYTES_CHECKED = 30
MIN_BYTES_REMAINDER = 28
MIN_BYTES_STOCHASTIC = 24


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
  """How to build one row of the optimizer-step table.

  A variant states what differs from the defaults: an fp16 step that checks
  its gradients (30 B/param at least) and skips a non-finite step.

  Attributes:
    name: row label.
    kind: "baseline", "reference", "mpx" or "peer".
    build: ``build(params32, Grads) -> (fn, state, grads)`` (or ``(fn, state,
      args, bad_args)`` for a step with more arguments), or a string saying why
      the variant is unavailable.
    what: one line for the report.
    param_dtype: dtype of the parameters it trains.
    min_bytes: bytes per parameter it must move at minimum.
    skips: whether it skips non-finite steps (gets one at the end of a run).
    paired: time it, in every round, between two windows of the
      check-then-apply step of its own dtype (:data:`CHECK_THEN_APPLY`).
    pair_with: time it, in every round, between two windows of this variant.
  """

  name: str
  kind: str
  build: Callable[[PyTree, PyTree], Any]
  what: str
  param_dtype: str = "float16"
  min_bytes: int = MIN_BYTES_CHECKED
  skips: bool = True
  paired: bool = False
  pair_with: str | None = None

  @property
  def reference(self) -> str | None:
    """Names the step without safety of its dtype (None for the FP32 baseline)."""
    return HAND_OF.get(self.param_dtype)

  @property
  def check_then_apply(self) -> str | None:
    """Names the check-then-apply step of its dtype (None for the FP32 baseline)."""
    return CHECK_THEN_APPLY.get(self.param_dtype)

  @property
  def timed_next_to(self) -> str | None:
    """Names the variant whose windows it is timed between in every round, if any."""
    return self.pair_with or (self.check_then_apply if self.paired else None)


# --- The mpx steps -------------------------------------------------------------------


def mpx_step(tx: optax.GradientTransformation) -> Callable[[PyTree, PyTree], PyTree]:
  """Builds ``step((params, opt), grads)``: ``tx``'s update, then ``apply_updates``."""

  def step(state, grads):
    params, opt = state
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  return step


def mpx_bf16_state(tx, masters, p32):
  """Builds ``(bf16 params, tx's state)`` from the float32 params: the masters
  seeded from them, or (stochastic: no master to seed) the state of their rounding."""
  if masters == "stochastic":
    params = copy_tree(p32, BF16)
    return params, tx.init(params)
  return mpx.init_from_full_precision(tx, copy_tree(p32), BF16)


def build_mpx_bf16(p32, g, masters="full"):
  """Builds ``mixed_precision(adam, masters=masters)`` on bf16 params."""
  tx = mpx.mixed_precision(adam(), masters=masters)
  return mpx_step(tx), mpx_bf16_state(tx, masters, p32), g.bf16


def build_mpx_bf16_remainder(p32, g):
  """Builds mpx bf16 with int16 remainders for masters."""
  return build_mpx_bf16(p32, g, "remainder")


def build_mpx_bf16_stochastic(p32, g):
  """Builds mpx bf16 with stochastic rounding and no masters."""
  return build_mpx_bf16(p32, g, "stochastic")


def build_mpx_fp16(p32, g):
  """Builds ``loss_scale(mixed_precision(adam))`` on fp16 params."""
  tx = mpx.loss_scale(mpx.mixed_precision(adam()))
  params, opt = mpx.init_from_full_precision(tx, copy_tree(p32), F16)
  return mpx_step(tx), (params, opt), g.f16


# --- The table -----------------------------------------------------------------------


VARIANTS = (
  Variant(
    name=BASELINE,
    kind="baseline",
    build=build_fp32,
    what="optax.adam on FP32 params",
    param_dtype="float32",
    min_bytes=MIN_BYTES_FP32,
    skips=False,
  ),
  Variant(
    name=HAND,
    kind="reference",
    build=build_hand,
    what="cast grads to f32, adam on f32 masters, round(master) - param; no check, no scaling",
    min_bytes=MIN_BYTES_NO_CHECK,
    skips=False,
  ),
  Variant(
    name=HAND_BF16,
    kind="reference",
    build=build_hand_bf16,
    what="the same on bf16 params and bf16 grads",
    param_dtype="bfloat16",
    min_bytes=MIN_BYTES_NO_CHECK,
    skips=False,
  ),
  Variant(
    name="hand + cond (flag given)",
    kind="reference",
    build=build_hand_cond_flag,
    what="the hand step inside lax.cond on a bool passed in as an argument: no check",
    min_bytes=MIN_BYTES_NO_CHECK,
  ),
  Variant(
    name="hand + check",
    kind="reference",
    build=build_hand_check,
    what="the hand step plus mpx.all_finite(grads), kept in the state but not acted on",
    skips=False,
  ),
  Variant(
    name=HAND_COND,
    kind="reference",
    build=build_hand_cond,
    what="the hand step inside lax.cond(mpx.all_finite(grads), step, keep): the "
    "check-then-apply step mpx fp16 is held against",
  ),
  Variant(
    name=HAND_COND_BF16,
    kind="reference",
    build=build_hand_cond_bf16,
    what="the same on bf16 params and bf16 grads: the check-then-apply step mpx bf16 is "
    "held against",
    param_dtype="bfloat16",
  ),
  Variant(
    name="hand + select",
    kind="reference",
    build=build_hand_select,
    what="the hand step, then jnp.where(mpx.all_finite(grads), new, old) over params, "
    "masters, state",
  ),
  Variant(
    name=MPX_BF16,
    kind="mpx",
    build=build_mpx_bf16,
    what="mpx.mixed_precision(adam) on bf16 params (full float32 masters)",
    param_dtype="bfloat16",
    paired=True,
  ),
  Variant(
    name=MPX_REMAINDER,
    kind="mpx",
    build=build_mpx_bf16_remainder,
    what='mixed_precision(adam, masters="remainder") on bf16 params: int16 low bits of the '
    "float32 masters",
    param_dtype="bfloat16",
    min_bytes=MIN_BYTES_REMAINDER,
    pair_with=MPX_BF16,
  ),
  Variant(
    name=MPX_STOCHASTIC,
    kind="mpx",
    build=build_mpx_bf16_stochastic,
    what='mixed_precision(adam, masters="stochastic") on bf16 params: no masters, '
    "stochastic rounding",
    param_dtype="bfloat16",
    min_bytes=MIN_BYTES_STOCHASTIC,
    pair_with=MPX_BF16,
  ),
  Variant(
    name="mpx fp16",
    kind="mpx",
    build=build_mpx_fp16,
    what="mpx.loss_scale(mpx.mixed_precision(adam)) on fp16 params, scaled grads",
    paired=True,
  ),
  Variant(
    name="jmp fp16",
    kind="peer",
    build=build_jmp,
    what="jmp.DynamicLossScale, f32 masters by hand, jmp.all_finite + jmp.select_tree",
  ),
  Variant(
    name="flax DynamicScale fp16",
    kind="peer",
    build=build_flax,
    what="flax DynamicScale's unscale/check/scale rule, TrainState, jnp.where skip",
  ),
  Variant(
    name="mixed-precision-for-JAX fp16",
    kind="peer",
    build=build_mpfj,
    what="its DynamicLossScaling + optimizer_update (select_tree) on the f32 model",
  ),
  Variant(
    name="optax.apply_if_finite fp16",
    kind="peer",
    build=build_apply_if_finite,
    what="apply_if_finite(adam) on f32 masters by hand, static scale",
  ),
)


def build_cases(
  shapes: PyTree, names: tuple[str, ...] | None = None
) -> tuple[list[tuple[Variant, Case]], dict[str, str], int, Grads]:
  """Builds every available variant (or those in ``names``) on one tree.

  Returns:
    ``(built, unavailable, n, grads)``: (variant, case) pairs, the reason each
    missing variant is unavailable, the parameter count, and the gradients.
  """
  p32, g32 = make_arrays(shapes)
  grads = make_grads(g32)
  n = n_params(shapes)
  built, unavailable = [], {}
  bad = {}  # one inf-poisoned copy per gradient tree, shared too
  for variant in VARIANTS:
    if names is not None and variant.name not in names:
      continue
    made = variant.build(p32, grads)
    if isinstance(made, str):
      unavailable[variant.name] = made
      continue
    if len(made) == 4:
      fn, state, args, bad_args = made
    else:
      fn, state, g = made
      args = (g,)
      if variant.skips and id(g) not in bad:
        bad[id(g)] = (with_inf(g),)
      bad_args = bad[id(g)] if variant.skips else None
    built.append((variant, Case(variant.name, fn, state, args, bad_args)))
  return built, unavailable, n, grads


# --- State sizes ---------------------------------------------------------------------


def state_bytes_per_param(variant: Variant, case: Case, n: int) -> float:
  """Counts the state's bytes per parameter beyond the parameters themselves."""
  total = sum(x.nbytes for x in jax.tree.leaves(case.state))
  return (total - sum(x.nbytes for x in jax.tree.leaves(case.state[0]))) / n


# What each storage mode of mixed_precision's state stores per param leaf, by
# field name: found by name, so whatever module defines the state.
_STORED_FIELDS = {
  "master_params": "full",
  "master_remainders": "remainder",
  "rounding_keys": "stochastic",
}


def _is_mp_state(x: Any) -> bool:
  fields = getattr(x, "_fields", ())
  return "inner_state" in fields and any(f in fields for f in _STORED_FIELDS)


def mpx_state_overhead(case: Case, n_low: int) -> dict[str, Any]:
  """Splits an mpx case's optimizer-state bytes into masters, Adam's, and the rest.

  The masters are what stands for them in the mode (float32 masters, int16
  remainders, or a key per leaf); ``other_shapes`` lists the rest's shapes.
  """
  _, opt = case.state
  (mp_state,) = [x for x in jax.tree.leaves(opt, is_leaf=_is_mp_state) if _is_mp_state(x)]
  (field,) = [f for f in _STORED_FIELDS if f in mp_state._fields]
  masters, inner = getattr(mp_state, field), mp_state.inner_state
  counted = {id(x) for x in jax.tree.leaves((masters, inner))}
  leaves = jax.tree.leaves(opt)
  others = [x for x in leaves if id(x) not in counted]
  return {
    "mode": _STORED_FIELDS[field],
    "total": int(sum(x.nbytes for x in leaves)),
    "masters": int(sum(x.nbytes for x in jax.tree.leaves(masters))),
    "inner": int(sum(x.nbytes for x in jax.tree.leaves(inner))),
    "other": int(sum(x.nbytes for x in others)),
    "other_shapes": [list(np.shape(x)) for x in others],
    "low_precision_params": int(n_low),
  }


def adam_state_bytes(shapes: PyTree) -> int:
  """Counts the bytes of plain ``optax.adam``'s state on float32 params of ``shapes``."""
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, F32), shapes, is_leaf=is_shape)
  state = jax.eval_shape(adam().init, abstract)
  return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(state)))
