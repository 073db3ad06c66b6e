"""The optimizer step alone: plain Adam vs mpx vs hand-written vs the peers.

Every variant is one jitted function ``step(state, grads) -> state`` whose
state (parameters, masters, Adam's moments, loss-scale state) is donated, so
XLA may update it in place. The 16-bit variants all do the same job: from
float16 (or bfloat16) gradients, produce the next 16-bit parameters and keep
float32 masters and Adam's float32 moments. The parameters are a realistic
tree of matrices shaped like a small transformer (see :func:`param_shapes`),
not one long vector; a tree of many small matrices (:func:`many_leaf_shapes`)
shows the per-leaf costs.

The mpx variants are also timed, in every round, next to the check-then-apply
step of their own dtype (``Variant.paired``): the hand-written step with
float32 masters inside ``lax.cond(mpx.all_finite(grads))``, which the
compile-time benchmark holds them against too (:data:`CHECK_THEN_APPLY`).
mpx bf16 with remainder masters and with stochastic rounding
(``masters="remainder"``, ``"stochastic"``) are timed next to mpx bf16 with
full float32 masters instead (``Variant.pair_with``): their target is a ratio
to it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx
from benchmarks import peers
from benchmarks.common import Case

PyTree = Any
F32 = jnp.float32
F16 = jnp.float16
BF16 = jnp.bfloat16
SCALE = 2.0**15  # the loss scale the fp16 gradients were made with
LR = 1e-3
BASELINE = "optax adam fp32"
HAND = "hand-written fp16 (no safety)"
HAND_BF16 = "hand-written bf16 (no safety)"
MPX_BF16 = "mpx bf16"
MPX_REMAINDER = "mpx bf16 remainder"
MPX_STOCHASTIC = "mpx bf16 stochastic"
HAND_COND = "hand + cond"
HAND_COND_BF16 = "hand bf16 + cond"
# The hand-written step without safety of each parameter dtype: what the cost
# of safety is measured from.
HAND_OF = {"float16": HAND, "bfloat16": HAND_BF16}
# The check-then-apply step of each parameter dtype (float32 masters, the
# step inside lax.cond(mpx.all_finite(grads))): the baseline the mpx steps'
# speed and compile-time targets are held against, in this benchmark and in
# benchmarks/compile_time.py alike.
CHECK_THEN_APPLY = {"float16": HAND_COND, "bfloat16": HAND_COND_BF16}

# Bytes each variant must move per parameter at minimum (see docs/benchmarks.md):
# read g, master, mu, nu; write param, master, mu, nu. Plain FP32 Adam: 16 read
# (g, p, mu, nu) + 12 written = 28. A 16-bit param with a float32 master:
# 2 + 4 + 8 read + 2 + 4 + 8 written = 28 as well (the old 16-bit param need
# not be read). Skipping a non-finite step needs the finite verdict before any
# byte is written, hence one more read of the 16-bit gradients: 30.
#
# The other storage modes of bf16 masters, derived the same way (checked):
# remainder masters: read g 2, param 2, remainder 2, mu 4, nu 4; write param 2,
# remainder 2, mu 4, nu 4 = 26 (the old param is read: it is half the master),
# + 2 for the check = 28. Stochastic rounding, no master: read g 2, param 2,
# mu 4, nu 4; write param 2, mu 4, nu 4 = 22, + 2 for the check = 24 (the random
# bits come from a counter and a key per leaf, not from memory).
MIN_BYTES_FP32 = 28
MIN_BYTES_NO_CHECK = 28
MIN_BYTES_CHECKED = 30
MIN_BYTES_REMAINDER = 28
MIN_BYTES_STOCHASTIC = 24


# --- The parameter tree ---------------------------------------------------------------


def param_shapes(n_params: int, layers: int = 4) -> dict[str, Any]:
  """A transformer-shaped tree of about ``n_params`` parameters.

  ``layers`` blocks of width ``d`` (qkv ``d x 3d``, attention output ``d x d``,
  MLP ``d x 4d`` and ``4d x d``, two norm scales), a final norm, and an
  embedding whose vocabulary makes up the rest. ``d`` is the largest power of
  two that leaves the embedding at least a quarter of the parameters.
  """
  per_width_sq = 12 * layers
  d = 2 ** max(3, math.floor(math.log2(math.sqrt(0.75 * n_params / per_width_sq)) + 1e-9))
  blocks = layers * (12 * d * d + 2 * d) + d
  vocab = max(1, (n_params - blocks) // d)
  tree: dict[str, Any] = {"embed": {"embedding": (vocab, d)}}
  for i in range(layers):
    tree[f"block_{i}"] = {
      "attn": {"qkv": {"kernel": (d, 3 * d)}, "out": {"kernel": (d, d)}},
      "ln1": {"scale": (d,)},
      "ln2": {"scale": (d,)},
      "mlp": {"up": {"kernel": (d, 4 * d)}, "down": {"kernel": (4 * d, d)}},
    }
  tree["ln_f"] = {"scale": (d,)}
  return tree


def many_leaf_shapes(leaves: int, side: int = 128) -> dict[str, Any]:
  """A tree of ``leaves`` square ``side x side`` matrices, in blocks of ten.

  Per-leaf costs (a kernel launch, a reduction, a branch operand) dominate
  here, where the transformer-shaped trees' few large leaves hide them.
  """
  tree: dict[str, Any] = {}
  for i in range(leaves):
    tree.setdefault(f"block_{i // 10:03d}", {})[f"w{i % 10}"] = (side, side)
  return tree


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple)


def n_params(shapes: PyTree) -> int:
  return sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=_is_shape))


def make_arrays(shapes: PyTree, seed: int = 0) -> tuple[PyTree, PyTree]:
  """Float32 ``(params, grads)`` with the shapes of ``shapes``, on the device.

  Drawn with numpy on the host: jax's threefry would take longer to compile
  for each leaf shape than numpy takes to draw 64M numbers.
  """
  rng = np.random.default_rng(seed)

  def draw(scale):
    return lambda s: jnp.asarray(scale * rng.standard_normal(s, dtype=np.float32))

  params = jax.tree.map(draw(0.02), shapes, is_leaf=_is_shape)
  grads = jax.tree.map(draw(1e-3), shapes, is_leaf=_is_shape)
  return params, grads


@functools.partial(jax.jit, static_argnums=1)
def _copy(tree: PyTree, dtype: Any = None) -> PyTree:
  """A fresh device copy (optionally cast): donated buffers must not be shared."""
  return jax.tree.map(lambda x: jnp.array(x, dtype or x.dtype, copy=True), tree)


def with_inf(grads: PyTree) -> PyTree:
  """``grads`` with its last (smallest) leaf replaced by infs; other leaves shared."""
  leaves, treedef = jax.tree.flatten(grads)
  leaves[-1] = jnp.full_like(leaves[-1], jnp.inf)
  return treedef.unflatten(leaves)


# --- The variants -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
  """How to build one row of the optimizer-step table.

  Attributes:
    name: row label.
    kind: "baseline", "reference", "mpx" or "peer".
    param_dtype: dtype of the parameters it trains.
    min_bytes: bytes per parameter it must move at minimum.
    build: ``build(params32, Grads) -> (fn, state, grads)`` (or ``(fn, state,
      args, bad_args)`` for a step with more arguments), or a string saying why
      the variant is unavailable.
    skips: whether it skips non-finite steps (gets one at the end of a run).
    what: one line for the report.
    paired: time it, in every round, between two windows of the
      check-then-apply step of its own dtype (:data:`CHECK_THEN_APPLY`), for a
      ratio to that step that does not go through the FP32 baseline.
    pair_with: time it, in every round, between two windows of this variant
      instead (the full-master mpx bf16 step for the other storage modes).
  """

  name: str
  kind: str
  param_dtype: str
  min_bytes: int
  build: Callable[[PyTree, PyTree], Any]
  skips: bool
  what: str
  paired: bool = False
  pair_with: str | None = None

  @property
  def reference(self) -> str | None:
    """The hand-written step without safety of its dtype (None for the FP32
    baseline)."""
    return HAND_OF.get(self.param_dtype)

  @property
  def check_then_apply(self) -> str | None:
    """The check-then-apply step of its dtype (None for the FP32 baseline)."""
    return CHECK_THEN_APPLY.get(self.param_dtype)

  @property
  def timed_next_to(self) -> str | None:
    """The variant whose windows it is timed between in every round, if any."""
    return self.pair_with or (self.check_then_apply if self.paired else None)


def _adam() -> optax.GradientTransformation:
  return optax.adam(LR)


# The hand-written steps check with mpx's own helper, so that their rows
# separate the cost of mpx's check from the cost of its way of skipping.
_finite = mpx.all_finite


def leafwise_sum_times_zero(tree: PyTree) -> jax.Array:
  """``x * 0`` is 0, or NaN for inf and NaN: one sum per leaf, in its dtype
  (the formula of ``mpx.all_finite`` when this benchmark was written)."""
  sums = [jnp.sum(x * 0).astype(F32) for x in jax.tree.leaves(tree)]
  return jnp.isfinite(sum(sums))


def leafwise_all_isfinite(tree: PyTree) -> jax.Array:
  """The check jmp, flax and optax use: ``all(isfinite(x))`` per leaf."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def build_fp32(p32, g):
  adam = _adam()

  def step(state, grads):
    params, opt = state
    updates, opt = adam.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  return step, (_copy(p32), adam.init(p32)), g.f32


def _hand_core(adam):
  """Hand-written mixed precision without safety: cast the gradients to float32,
  Adam on the float32 masters, updates = round(new_master) - param."""

  def core(params, masters, opt, grads):
    grads = jax.tree.map(lambda g: g.astype(F32), grads)
    updates, opt = adam.update(grads, opt, masters)
    masters = optax.apply_updates(masters, updates)
    deltas = jax.tree.map(
      lambda m, p: m.astype(p.dtype).astype(F32) - p.astype(F32), masters, params
    )
    return optax.apply_updates(params, deltas), masters, opt

  return core


def _hand_state(p32, adam, dtype=F16):
  return (_copy(p32, dtype), _copy(p32), adam.init(p32))


def _hand_grads(g, dtype):
  """bf16 gradients as they are; fp16 ones made with the loss scale (the hand
  steps do not unscale: they measure the step's memory traffic, not its use)."""
  return g.bf16 if dtype == BF16 else g.f16


def build_hand(p32, g, dtype=F16):
  adam = _adam()
  core = _hand_core(adam)

  def step(state, grads):
    return core(*state, grads)

  return step, _hand_state(p32, adam, dtype), _hand_grads(g, dtype)


def build_hand_bf16(p32, g):
  return build_hand(p32, g, BF16)


def build_hand_check(p32, g):
  adam = _adam()
  core = _hand_core(adam)

  def step(state, grads):
    # The verdict is kept in the state (so XLA cannot drop it) but not used.
    return (*core(*state[:3], grads), _finite(grads))

  return step, (*_hand_state(p32, adam), jnp.asarray(True)), g.f16


def build_hand_cond_flag(p32, g):
  adam = _adam()
  core = _hand_core(adam)

  def step(state, grads, finite):
    return jax.lax.cond(finite, lambda s: core(*s, grads), lambda s: s, state)

  args, bad = (g.f16, jnp.asarray(True)), (g.f16, jnp.asarray(False))
  return step, _hand_state(p32, adam), args, bad


def build_hand_cond(p32, g, dtype=F16):
  adam = _adam()
  core = _hand_core(adam)

  def step(state, grads):
    return jax.lax.cond(_finite(grads), lambda s: core(*s, grads), lambda s: s, state)

  return step, _hand_state(p32, adam, dtype), _hand_grads(g, dtype)


def build_hand_cond_bf16(p32, g):
  return build_hand_cond(p32, g, BF16)


def build_hand_select(p32, g):
  adam = _adam()
  core = _hand_core(adam)

  def step(state, grads):
    finite = _finite(grads)
    new = core(*state, grads)
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)

  return step, _hand_state(p32, adam), g.f16


def _mpx_step(tx):
  def step(state, grads):
    params, opt = state
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  return step


def mpx_bf16_state(tx, masters, p32):
  """``(bf16 params, tx's state)`` from the float32 params: masters seeded
  from them, or (stochastic: no master to seed) the state of their rounding."""
  if masters == "stochastic":
    params = _copy(p32, BF16)
    return params, tx.init(params)
  return mpx.init_from_full_precision(tx, _copy(p32), BF16)


def build_mpx_bf16(p32, g, masters="full"):
  tx = mpx.mixed_precision(_adam(), masters=masters)
  return _mpx_step(tx), mpx_bf16_state(tx, masters, p32), g.bf16


def build_mpx_bf16_remainder(p32, g):
  return build_mpx_bf16(p32, g, "remainder")


def build_mpx_bf16_stochastic(p32, g):
  return build_mpx_bf16(p32, g, "stochastic")


def build_mpx_fp16(p32, g):
  tx = mpx.loss_scale(mpx.mixed_precision(_adam()))
  params, opt = mpx.init_from_full_precision(tx, _copy(p32), F16)
  return _mpx_step(tx), (params, opt), g.f16


class Grads(NamedTuple):
  """The gradients the variants consume; not donated, so shared between them.

  Attributes:
    f32: float32 gradients (plain Adam).
    bf16: the same in bfloat16 (mpx bf16, no loss scale).
    f16: float16 gradients of a loss multiplied by ``SCALE`` (every fp16 variant;
      the hand-written ones, which do not unscale, take them as they are).
  """

  f32: PyTree
  bf16: PyTree
  f16: PyTree


@jax.jit
def make_grads(g32: PyTree) -> Grads:
  return Grads(
    f32=g32,
    bf16=jax.tree.map(lambda g: g.astype(BF16), g32),
    f16=jax.tree.map(lambda g: (g * SCALE).astype(F16), g32),
  )


def build_jmp(p32, g):
  """jmp's README recipe: float32 params (our masters) cast to fp16 for compute,
  ``DynamicLossScale``, ``all_finite`` and ``select_tree`` over params and state."""
  jmp, why = peers.optional_import("jmp")
  if jmp is None:
    return why
  adam = _adam()
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")

  def step(state, grads):
    _, masters, opt, loss_scale = state
    grads = policy.cast_to_param(grads)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    updates, new_opt = adam.update(grads, opt, masters)
    new_masters = optax.apply_updates(masters, updates)
    masters, opt = jmp.select_tree(grads_finite, (new_masters, new_opt), (masters, opt))
    return policy.cast_to_compute(masters), masters, opt, loss_scale

  state = (
    _copy(p32, F16),
    _copy(p32),
    adam.init(p32),
    jmp.DynamicLossScale(jnp.asarray(SCALE, F32)),
  )
  return step, state, g.f16


def build_flax(p32, g):
  """flax ``DynamicScale`` as its docs and ImageNet example use it.

  ``DynamicScale.value_and_grad`` wraps the gradient computation, so the part
  of it that follows the backward pass is reproduced line for line: cast the
  gradients to float32 and divide by the scale, ``all(is_finite)`` leaf by
  leaf, the scale update; then ``TrainState.apply_gradients`` on the float32
  params and ``jnp.where(is_fin, new, old)`` over params and optimizer state,
  as the example does. The fp16 params are the float32 ones cast for compute.
  """
  try:
    from flax.training import train_state
    from flax.training.dynamic_scale import DynamicScale
  except ImportError as error:
    return f"flax not installed ({error.name})"
  adam = _adam()

  def step(state, grads):
    _, ts, ds = state
    grads = jax.tree.map(lambda g: jnp.asarray(g, F32) / ds.scale, grads)
    finite = jnp.array(True)
    for g in jax.tree.leaves(grads):
      finite &= jnp.all(jax.lax.is_finite(g))
    grow = ds.fin_steps == ds.growth_interval
    fin_scale = jnp.where(
      grow & finite, jnp.minimum(ds.scale * ds.growth_factor, jnp.finfo(F32).max), ds.scale
    )
    inf_scale = jnp.maximum(ds.scale * ds.backoff_factor, ds.minimum_scale)
    ds = ds.replace(
      fin_steps=jnp.where(grow | ~finite, 0, ds.fin_steps + 1),
      scale=jnp.where(finite, fin_scale, inf_scale),
    )
    new_ts = ts.apply_gradients(grads=grads)
    select = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    ts = new_ts.replace(
      opt_state=select(new_ts.opt_state, ts.opt_state), params=select(new_ts.params, ts.params)
    )
    return jax.tree.map(lambda p: p.astype(F16), ts.params), ts, ds

  ts = train_state.TrainState.create(apply_fn=None, params=_copy(p32), tx=adam)
  ds = DynamicScale(scale=jnp.asarray(SCALE, F32), fin_steps=jnp.zeros((), jnp.int32))
  return step, (_copy(p32, F16), ts, ds), g.f16


_MPFJ: dict[str, Any] = {}


def build_mpfj(p32, g):
  """mixed-precision-for-JAX: the tail of its ``filter_value_and_grad``
  (``all_finite``, ``DynamicLossScaling.adjust``, ``unscale``), then its
  ``optimizer_update`` (optax update, ``eqx.apply_updates``, ``select_tree``
  over model and state) on the float32 model, cast to fp16 for compute with its
  ``cast_to_half_precision``."""
  module = _MPFJ.get("module")
  if module is None:
    return _MPFJ.get("why", "mixed-precision-for-JAX not loaded")
  mpfj = module
  adam = _adam()

  def step(state, grads):
    _, model, opt, scaling = state
    grads_finite = mpfj.all_finite(grads)
    scaling = scaling.adjust(grads_finite)
    grads = scaling.unscale(grads)
    model, opt = mpfj.optimizer_update(model, adam, opt, grads, grads_finite)
    return mpfj.cast_to_half_precision(model), model, opt, scaling

  scaling = mpfj.DynamicLossScaling(
    loss_scaling=jnp.asarray(SCALE, F32), min_loss_scaling=jnp.asarray(1.0, F32)
  )
  return step, (_copy(p32, F16), _copy(p32), adam.init(p32), scaling), g.f16


def load_peers(install: bool) -> None:
  """Loads mixed-precision-for-JAX (installing it into benchmarks/.vendor)."""
  if "module" in _MPFJ or "why" in _MPFJ:
    return
  module, why = peers.load_mixed_precision_for_jax(install)
  if module is not None:
    _MPFJ["module"] = module
  else:
    _MPFJ["why"] = why


def build_apply_if_finite(p32, g):
  """``optax.apply_if_finite(adam)`` on hand-kept float32 masters; it has no loss
  scale, so the gradients are unscaled by hand with a static one. A skipped
  step returns zero updates, so the masters and fp16 params stay as they were
  without any select."""
  tx = optax.apply_if_finite(_adam(), max_consecutive_errors=5)

  def step(state, grads):
    _, masters, opt = state
    grads = jax.tree.map(lambda g: g.astype(F32) * (1.0 / SCALE), grads)
    updates, opt = tx.update(grads, opt, masters)
    masters = optax.apply_updates(masters, updates)
    return jax.tree.map(lambda m: m.astype(F16), masters), masters, opt

  return step, (_copy(p32, F16), _copy(p32), tx.init(p32)), g.f16


VARIANTS = (
  Variant(
    BASELINE, "baseline", "float32", MIN_BYTES_FP32, build_fp32, False, "optax.adam on FP32 params"
  ),
  Variant(
    HAND,
    "reference",
    "float16",
    MIN_BYTES_NO_CHECK,
    build_hand,
    False,
    "cast grads to f32, adam on f32 masters, round(master) - param; no check, no scaling",
  ),
  Variant(
    HAND_BF16,
    "reference",
    "bfloat16",
    MIN_BYTES_NO_CHECK,
    build_hand_bf16,
    False,
    "the same on bf16 params and bf16 grads",
  ),
  Variant(
    "hand + cond (flag given)",
    "reference",
    "float16",
    MIN_BYTES_NO_CHECK,
    build_hand_cond_flag,
    True,
    "the hand step inside lax.cond on a bool passed in as an argument: no check",
  ),
  Variant(
    "hand + check",
    "reference",
    "float16",
    MIN_BYTES_CHECKED,
    build_hand_check,
    False,
    "the hand step plus mpx.all_finite(grads), kept in the state but not acted on",
  ),
  Variant(
    HAND_COND,
    "reference",
    "float16",
    MIN_BYTES_CHECKED,
    build_hand_cond,
    True,
    "the hand step inside lax.cond(mpx.all_finite(grads), step, keep): the "
    "check-then-apply step mpx fp16 is held against",
  ),
  Variant(
    HAND_COND_BF16,
    "reference",
    "bfloat16",
    MIN_BYTES_CHECKED,
    build_hand_cond_bf16,
    True,
    "the same on bf16 params and bf16 grads: the check-then-apply step mpx bf16 is held against",
  ),
  Variant(
    "hand + select",
    "reference",
    "float16",
    MIN_BYTES_CHECKED,
    build_hand_select,
    True,
    "the hand step, then jnp.where(mpx.all_finite(grads), new, old) over params, masters, state",
  ),
  Variant(
    MPX_BF16,
    "mpx",
    "bfloat16",
    MIN_BYTES_CHECKED,
    build_mpx_bf16,
    True,
    "mpx.mixed_precision(adam) on bf16 params (full float32 masters)",
    paired=True,
  ),
  Variant(
    MPX_REMAINDER,
    "mpx",
    "bfloat16",
    MIN_BYTES_REMAINDER,
    build_mpx_bf16_remainder,
    True,
    'mixed_precision(adam, masters="remainder") on bf16 params: int16 low bits of the '
    "float32 masters",
    pair_with=MPX_BF16,
  ),
  Variant(
    MPX_STOCHASTIC,
    "mpx",
    "bfloat16",
    MIN_BYTES_STOCHASTIC,
    build_mpx_bf16_stochastic,
    True,
    'mixed_precision(adam, masters="stochastic") on bf16 params: no masters, stochastic rounding',
    pair_with=MPX_BF16,
  ),
  Variant(
    "mpx fp16",
    "mpx",
    "float16",
    MIN_BYTES_CHECKED,
    build_mpx_fp16,
    True,
    "mpx.loss_scale(mpx.mixed_precision(adam)) on fp16 params, scaled grads",
    paired=True,
  ),
  Variant(
    "jmp fp16",
    "peer",
    "float16",
    MIN_BYTES_CHECKED,
    build_jmp,
    True,
    "jmp.DynamicLossScale, f32 masters by hand, jmp.all_finite + jmp.select_tree",
  ),
  Variant(
    "flax DynamicScale fp16",
    "peer",
    "float16",
    MIN_BYTES_CHECKED,
    build_flax,
    True,
    "flax DynamicScale's unscale/check/scale rule, TrainState, jnp.where skip",
  ),
  Variant(
    "mixed-precision-for-JAX fp16",
    "peer",
    "float16",
    MIN_BYTES_CHECKED,
    build_mpfj,
    True,
    "its DynamicLossScaling + optimizer_update (select_tree) on the f32 model",
  ),
  Variant(
    "optax.apply_if_finite fp16",
    "peer",
    "float16",
    MIN_BYTES_CHECKED,
    build_apply_if_finite,
    True,
    "apply_if_finite(adam) on f32 masters by hand, static scale",
  ),
)


# --- Probes: bandwidth roofline and the finite check alone ---------------------------


@dataclasses.dataclass(frozen=True)
class Probe:
  """A timed case that is not an optimizer: a bandwidth reference or a check.

  Attributes:
    case: the case (its state is donated like the variants').
    group: "roofline" or "check".
    bytes_per_param: bytes it must move per element or parameter.
  """

  case: Case
  group: str
  bytes_per_param: int


ROOF_ELEMENTS = 2**25
ROOF_COPY = "copy x+1 (f32)"
ROOF_AXPY = "axpy y+a*x (f32)"
CHECK_COPY = "fp16 grads x+1 (reference)"
MPX_CHECK = "mpx.all_finite (this checkout)"
CHECKS = {
  MPX_CHECK: mpx.all_finite,
  "isfinite(sum(x*0)) per leaf": leafwise_sum_times_zero,
  "all(isfinite(x)) per leaf (jmp, optax)": leafwise_all_isfinite,
}


def probes(n: int, grads: Grads, checks: bool = True) -> list[Probe]:
  """Bandwidth probes on ``min(n, 2**25)`` float32 elements (128 MiB, far
  beyond any cache): ``x + 1`` in place (copy: 8 bytes per element) and
  ``y + a * x`` in place (axpy: 12 bytes); and, with ``checks``, the finite
  check alone on the fp16 gradients, with ``x + 1`` in place on a copy of them
  (4 bytes per parameter) for reference."""
  n = min(n, ROOF_ELEMENTS)
  x = jnp.full((n,), 1.0, F32)
  out = [
    Probe(Case(ROOF_COPY, lambda s: s + 1.0, jnp.zeros((n,), F32), ()), "roofline", 8),
    Probe(Case(ROOF_AXPY, lambda s, x: s + 1e-3 * x, jnp.zeros((n,), F32), (x,)), "roofline", 12),
  ]
  if not checks:
    return out
  out.append(
    Probe(
      Case(CHECK_COPY, lambda s: jax.tree.map(lambda v: v + 1, s), _copy(grads.f16), ()),
      "check",
      4,
    )
  )
  for name, check in CHECKS.items():
    fn = lambda s, g, check=check: s & check(g)  # noqa: E731
    out.append(Probe(Case(name, fn, jnp.asarray(True), (grads.f16,)), "check", 2))
  return out


def build_cases(
  shapes: PyTree, names: tuple[str, ...] | None = None
) -> tuple[list[tuple[Variant, Case]], dict[str, str], int, Grads]:
  """Builds every available variant on one tree.

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
  del p32, g32
  return built, unavailable, n, grads


def state_bytes_per_param(variant: Variant, case: Case, n: int) -> float:
  """Optimizer-side bytes per parameter: everything in the state but the
  parameters themselves (masters, moments, counters, loss scale)."""
  state = case.state
  leaves = jax.tree.leaves(state)
  total = sum(x.nbytes for x in leaves)
  params = state[0]
  return (total - sum(x.nbytes for x in jax.tree.leaves(params))) / n


# What each storage mode of mixed_precision's state stores per param leaf, by
# field name: found by name, not type or position, so the benchmark reads the
# state whatever module defines it and whatever scalars sit beside.
_STORED_FIELDS = {
  "master_params": "full",
  "master_remainders": "remainder",
  "rounding_keys": "stochastic",
}


def _is_mp_state(x: Any) -> bool:
  fields = getattr(x, "_fields", ())
  return "inner_state" in fields and any(f in fields for f in _STORED_FIELDS)


def mpx_state_overhead(case: Case, n_low: int) -> dict[str, Any]:
  """For an mpx case: bytes of the inner Adam state, of what stands for the
  masters (float32 masters, int16 remainders, or one uint32 key of random bits
  per leaf), and of everything else in its optimizer state, with the shapes of
  what else there is (the test checks it is a few scalars: the loss scale, the
  step counters)."""
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
  """Bytes of plain ``optax.adam``'s state on float32 params of ``shapes``."""
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, F32), shapes, is_leaf=_is_shape)
  state = jax.eval_shape(_adam().init, abstract)
  return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(state)))
