"""A small training loop with fault injection, shared by the reliability tests.

The model is a two-layer tanh MLP (about 170 weights) regressing a fixed
teacher, ``y = sin(x @ v)``, on fresh Gaussian batches. Its kernels and bias
are bf16 or fp16 and get float32 masters; ``norm/scale`` stays float32, so it
is updated in place with no master, as a layer norm would be. The rule inside
``mixed_precision`` is ``clip_by_global_norm`` then AdamW on a warmup-cosine
schedule, so the inner state holds moments and two step counters (Adam's and
the schedule's) that a skipped step must not advance.

No leaf of that model reaches the 4096 elements from which ``mixed_precision
(..., moments=...)`` compresses a moment, so the runs with compressed moments
use the same MLP :data:`WIDE` units wide: its ``dense/kernel`` (8 x 512) is
the one compressed leaf, its ``mu`` and ``nu`` stored as
``Signed8bitMoment`` and ``Nonnegative8bitMoment`` under ``"8bit"`` and as
``Bfloat16Moment`` under ``"bfloat16"`` (see :data:`COMPRESSED`).

A *plan* says, for every step, whether and how to poison it:

- ``SINGLE``: one element of one gradient leaf becomes inf, -inf or NaN;
- ``LEAF``: a whole gradient leaf becomes inf, -inf or NaN;
- ``LOSS``: the loss itself is multiplied by inf, -inf or NaN before it is
  differentiated (an overflow in the forward pass), so every gradient is
  non-finite.

A whole run is one ``lax.scan``, compiled once per configuration and shared by
every seed, by the poisoned run and by its reference. Each step's batch is a
input like the plan, so a reference run can be fed exactly the batches of the
clean steps, in order. A step can also *pin* the
loss scale to a given value before it runs (see ``test_fault_injection``).

The resume scenario (``resume_*``) is shared with ``test_resume``'s fresh
process, ``tests/tools/training_loop_cli.py``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import lowering_forms
import numpy as np
import optax

import mpx
from mpx._src.states import COMPRESSED_MOMENTS

# MPX_LONG=1 selects thousands of steps and more seeds (see docs/guarantees.md).
LONG = os.environ.get("MPX_LONG", "0") not in ("", "0")

NONE, SINGLE, LEAF, LOSS = 0, 1, 2, 3
POISONS = np.array([np.inf, -np.inf, np.nan], np.float32)

IN, HIDDEN, BATCH = 8, 16, 32
# The width of the model with compressed moments: dense/kernel is IN x WIDE =
# 4096 elements (moments.MIN_SIZE) with a last axis of 512 (>= 16: 8-bit codes).
WIDE = 512
TEACHER = np.linspace(-0.6, 0.6, IN, dtype=np.float32)

# Gradient leaves in flattening order (jax sorts dict keys).
LEAF_NAMES = ("dense/bias", "dense/kernel", "norm/scale", "out/kernel")


def init_params(seed: int, dtype, hidden: int = HIDDEN) -> dict:
  """The MLP's params, ``hidden`` units wide.

  The output kernel's scale shrinks as ``1 / sqrt(hidden)`` so that a wide
  model starts from about the same loss (at ``HIDDEN`` the factor is exactly
  1: the default params are bitwise what they always were)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  out_std = 0.3 * (HIDDEN / hidden) ** 0.5
  return {
    "dense": {
      "kernel": (0.5 * jax.random.normal(k1, (IN, hidden))).astype(dtype),
      "bias": jnp.zeros(hidden, dtype),
    },
    "norm": {"scale": jnp.ones(hidden, jnp.float32)},
    "out": {"kernel": (out_std * jax.random.normal(k2, (hidden, 1))).astype(dtype)},
  }


def batches(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
  """``n`` batches ``(x, y)`` with a leading step axis, from numpy's generator."""
  x = np.random.default_rng(seed).normal(size=(n, BATCH, IN)).astype(np.float32)
  return x, np.sin(x @ TEACHER)[..., None]


EVAL_X, EVAL_Y = (b[0] for b in batches(2**20, 1))  # a fixed held-out batch


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  dtype = params["dense"]["kernel"].dtype
  h = jnp.tanh(x.astype(dtype) @ params["dense"]["kernel"] + params["dense"]["bias"])
  h = h.astype(jnp.float32) * params["norm"]["scale"]
  pred = h @ params["out"]["kernel"].astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def inner_rule() -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(1e-3, 3e-2, 20, 4000, 3e-3)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


class ScaleConfig(NamedTuple):
  """``mpx.loss_scale`` settings, also read by the reference rule."""

  init_scale: float = 2.0**10
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 10
  min_scale: float = 4.0
  max_scale: float = 2.0**12
  hysteresis: int = 1


DEFAULT_CONFIG = ScaleConfig()


def make_tx(
  stack: str,
  config: ScaleConfig = DEFAULT_CONFIG,
  inner=None,
  masters: str = "full",
  moments: str = "full",
):
  """``stack``: "mixed_precision", "static_loss_scale" (scale 2**10) or
  "loss_scale"; ``masters`` and ``moments``: ``mixed_precision``'s storage
  of the masters and of the inner rule's moments."""
  inner = inner_rule() if inner is None else inner
  mp = mpx.mixed_precision(inner, masters=masters, moments=moments)
  if stack == "mixed_precision":
    return mp
  if stack == "static_loss_scale":
    return mpx.static_loss_scale(mp, 2.0**10)
  if stack == "loss_scale":
    return mpx.loss_scale(mp, **config._asdict())
  raise ValueError(stack)


def reference_scales(flags, config: ScaleConfig) -> list[float]:
  """The scale after each step, by the documented rule, in plain Python.

  ``flags[t]`` is True when step t's gradients are finite."""
  c = config
  scale, tracker, streak, out = c.init_scale, 0, 0, []
  for step_finite in flags:
    if step_finite:
      streak, tracker = 0, tracker + 1
      if tracker == c.growth_interval:
        scale, tracker = min(scale * c.growth_factor, c.max_scale), 0
    else:
      tracker, streak = 0, streak + 1
      if streak >= c.hysteresis:
        scale = max(scale * c.backoff_factor, c.min_scale)
    out.append(scale)
  return out


def mp_state(state):
  """The ``mixed_precision`` state, in any storage mode."""
  return state.inner_state if isinstance(state, mpx.LossScaleState) else state


# The compressed nodes of the inner state of the WIDE model, by moments format:
# (field, param path) -> stored type. Every other leaf stays as optax made it.
COMPRESSED = {
  "full": {},
  "bfloat16": {
    ("mu", "dense/kernel"): mpx.Bfloat16Moment,
    ("nu", "dense/kernel"): mpx.Bfloat16Moment,
  },
  "8bit": {
    ("mu", "dense/kernel"): mpx.Signed8bitMoment,
    ("nu", "dense/kernel"): mpx.Nonnegative8bitMoment,
  },
}


def compressed_nodes(inner) -> dict:
  """The compressed moments stored in ``inner`` (a stored inner state, or a
  stack of them), as ``(field, param path) -> type``, for :data:`COMPRESSED`."""
  stored = COMPRESSED_MOMENTS
  flat = jax.tree_util.tree_flatten_with_path(inner, is_leaf=lambda x: isinstance(x, stored))[0]
  found = {}
  for path, node in flat:
    if isinstance(node, stored):
      fields = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
      keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
      found[fields[-1], "/".join(keys)] = type(node)
  return found


def poison_grads(grads: dict, kind, leaf, elem, poison) -> dict:
  """Applies a ``SINGLE`` or ``LEAF`` injection to the gradients (traced)."""
  flat, treedef = jax.tree.flatten(grads)
  out = []
  for i, g in enumerate(flat):
    bad = poison.astype(g.dtype)
    here = jnp.arange(g.size).reshape(g.shape) == elem % g.size
    g = jnp.where((kind == SINGLE) & (leaf == i) & here, bad, g)
    g = jnp.where((kind == LEAF) & (leaf == i), bad, g)
    out.append(g)
  return treedef.unflatten(out)


def train_step(tx, params, state, xs):
  """One training step; ``xs`` holds x, y, kind, leaf, elem, poison, pin, scale."""
  if isinstance(state, mpx.LossScaleState):
    state = state._replace(loss_scale=jnp.where(xs["pin"], xs["scale"], state.loss_scale))
  x, y = xs["x"], xs["y"]

  def scaled_loss(p):
    factor = jnp.where(xs["kind"] == LOSS, xs["poison"], jnp.float32(1.0))
    return mpx.scale_loss(loss_fn(p, x, y) * factor, state)

  grads = jax.grad(scaled_loss)(params)
  grads = poison_grads(grads, xs["kind"], xs["leaf"], xs["elem"], xs["poison"])
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def record(params, state) -> dict:
  """What a run reports after each step."""
  mp = mp_state(state)
  ls = state if isinstance(state, mpx.LossScaleState) else None
  return {
    "params": params,
    # The float32 view of the low-precision leaves (norm/scale has no master),
    # in every storage mode; stochastic's is the params themselves.
    "masters": {k: v for k, v in mpx.master_params(state, params).items() if k != "norm"},
    "inner": mp.inner_state,  # as stored: codes and scales under moments="8bit"
    "inner_decompressed": mpx.inner_state(state),  # as the inner rule sees it
    "scale": mpx.get_loss_scale(state),
    "skipped": jnp.int32(-1) if ls is None else ls.skipped_steps,
    "last_finite": jnp.asarray(True) if ls is None else ls.last_step_finite,
    "eval_loss": loss_fn(params, EVAL_X, EVAL_Y),
  }


def compiled_run(
  stack: str, config: ScaleConfig = DEFAULT_CONFIG, masters: str = "full", moments: str = "full"
):
  """``(tx, run)``; ``run(params, xs)`` returns the records of the initial
  state followed by those after every step (leading axis ``steps + 1``).

  One per configuration and per form of the finite check (the
  ``finite_check_form`` fixture switches it; this cache would otherwise hand
  one form's compiled run to another)."""
  return _compiled_run(stack, config, masters, moments, lowering_forms.current())


@functools.cache
def _compiled_run(stack: str, config: ScaleConfig, masters: str, moments: str, form: str | None):
  del form  # a cache key only
  tx = make_tx(stack, config, masters=masters, moments=moments)

  @jax.jit
  def run(params, xs):
    state = tx.init(params)

    def body(carry, xs):
      params, state = train_step(tx, *carry, xs)
      return (params, state), record(params, state)

    first = record(params, state)
    _, records = jax.lax.scan(body, (params, state), xs)
    return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, records)

  return tx, run


def make_xs(x, y, kind=None, leaf=None, elem=None, poison=None, pin=None, scale=None) -> dict:
  n = len(x)

  def arr(value, default, dtype):
    return np.asarray(np.full(n, default) if value is None else value, dtype)

  return {
    "x": np.asarray(x, np.float32),
    "y": np.asarray(y, np.float32),
    "kind": arr(kind, NONE, np.int32),
    "leaf": arr(leaf, 0, np.int32),
    "elem": arr(elem, 0, np.int32),
    "poison": arr(poison, 1.0, np.float32),
    "pin": arr(pin, False, np.bool_),
    "scale": arr(scale, 1.0, np.float32),
  }


def random_plan(seed: int, steps: int, rate: float, burst: int) -> dict:
  """Injections at random steps with random kinds, leaves, elements and
  poisons, plus one burst of ``burst`` consecutive injected steps."""
  rng = np.random.default_rng(seed)
  injected = rng.random(steps) < rate
  start = rng.integers(steps // 4, steps // 2)
  injected[start : start + burst] = True
  kind = np.where(injected, rng.integers(SINGLE, LOSS + 1, steps), NONE)
  return make_xs(
    *batches(seed, steps),
    kind=kind,
    # A clean step gets the inputs of a step of the reference run that never
    # took the poisoned ones (make_xs's defaults): XLA:CPU compiles the GPU
    # form's step so that a clean step's leaf and element, though no select
    # takes them, can move the update by an ulp.
    leaf=np.where(injected, rng.integers(0, len(LEAF_NAMES), steps), 0),
    elem=np.where(injected, rng.integers(0, 2**20, steps), 0),
    poison=np.where(injected, rng.choice(POISONS, steps), 1.0),
  )


def floating_leaves(tree) -> list[np.ndarray]:
  leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
  return [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]


def all_finite_np(tree) -> bool:
  """numpy's verdict (bf16 leaves are upcast), independent of mpx.all_finite."""
  return all(np.isfinite(x.astype(np.float32)).all() for x in floating_leaves(tree))


# --- The resume scenario (test_resume.py and its fresh process). ---

RESUME_SEED = 3


class ResumeMode(NamedTuple):
  """A storage mode the resume test runs: the params' dtype, the masters, the
  moments and the model's width (the wide one has compressed moments)."""

  dtype: Any
  masters: str = "full"
  moments: str = "full"
  hidden: int = HIDDEN


# By name, the MODE of the fresh process; remainder and stochastic are bf16 only.
RESUME_MODES = {
  "full": ResumeMode(jnp.float16),
  "remainder": ResumeMode(jnp.bfloat16, "remainder"),
  "stochastic": ResumeMode(jnp.bfloat16, "stochastic"),
  "remainder-8bit": ResumeMode(jnp.bfloat16, "remainder", "8bit", WIDE),
  "stochastic-bfloat16": ResumeMode(jnp.bfloat16, "stochastic", "bfloat16", WIDE),
}
RESUME_STEPS = 400 if LONG else 44
# Non-default everywhere, so a lost setting would change the trajectory.
RESUME_CONFIG = ScaleConfig(
  init_scale=2.0**6,
  growth_factor=4.0,
  backoff_factor=0.25,
  growth_interval=3,
  min_scale=2.0,
  max_scale=2.0**10,
  hysteresis=2,
)
ADJUST_STEP, ADJUSTED_LR = 20, 5e-3  # mpx.adjust(learning_rate=...) before this step


def resume_tx(mode: str = "full"):
  inner = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(optax.adamw)(learning_rate=3e-2, weight_decay=1e-3),
    optax.scale_by_schedule(optax.cosine_decay_schedule(1.0, 1000, 0.1)),
  )
  m = RESUME_MODES[mode]
  return make_tx("loss_scale", RESUME_CONFIG, inner=inner, masters=m.masters, moments=m.moments)


def resume_plan() -> dict:
  """Single skips, a burst to the floor, long clean runs to the cap."""
  injected = np.zeros(RESUME_STEPS, bool)
  for start in range(0, RESUME_STEPS, 44):
    for offset in (4, 12, 13, 14, 15, 16, 17, 18, 25, 31, 32):
      if start + offset < RESUME_STEPS:
        injected[start + offset] = True
  steps = np.arange(RESUME_STEPS)
  return make_xs(
    *batches(RESUME_SEED, RESUME_STEPS),
    kind=np.where(injected, 1 + steps % 3, NONE),
    leaf=steps % len(LEAF_NAMES),
    elem=steps * 7,
    poison=np.where(injected, POISONS[steps % 3], 1.0),
  )


@functools.cache
def resume_step(mode: str = "full"):
  tx = resume_tx(mode)
  return jax.jit(lambda params, state, xs: train_step(tx, params, state, xs))


def resume_params(mode: str = "full") -> dict:
  """The initial params of the resume run in ``mode``."""
  m = RESUME_MODES[mode]
  return init_params(RESUME_SEED, m.dtype, m.hidden)


def resume_train(params, state, start: int, stop: int, mode: str = "full") -> list:
  """Steps ``start .. stop - 1``; returns ``(params, opt_state)`` after each."""
  step, plan = resume_step(mode), resume_plan()
  out = []
  for t in range(start, stop):
    if t == ADJUST_STEP:
      state = mpx.adjust(state, learning_rate=ADJUSTED_LR)
    params, state = step(params, state, {k: v[t] for k, v in plan.items()})
    out.append((params, state))
  return out


def resume_template(mode: str = "full"):
  """The abstract ``{"params", "opt_state"}`` tree a fresh process restores into."""
  params = resume_params(mode)
  tx = resume_tx(mode)
  return jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params)
