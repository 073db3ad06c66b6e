"""``loss_scale`` hands its skip decision to the ``mixed_precision`` inside it.

Whatever sits between or beside them (a clip before, a stateful rule before,
a plain rule in another partition, ``MultiSteps``; a rule *after* it is
refused, see test_bad_input's B29), a run with poisoned steps must
equal, bit for bit, a run of the same transformation fed only the clean steps:
the hand-over must protect every piece of state, not only the masters. And the
hand-over must deliver what it is for: no float32 buffer of updates or
gradients in the compiled step.
"""

import math

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from treecheck import tree_equal, without_skip_counts

import mpx
from mpx._src import compat

SCALE = 2.0**8


def params_fp16():
  rng = np.random.default_rng(0)
  return {
    "dense": jnp.asarray(0.3 * rng.standard_normal((16, 8)), jnp.float16),
    "norm": jnp.ones(8, jnp.float32),
    "out": jnp.asarray(0.3 * rng.standard_normal(8), jnp.float16),
  }


LABELS = {"dense": "low", "norm": "full", "out": "low"}


def keep_last_update() -> optax.GradientTransformation:
  """Passes updates through and keeps the last one in its state, as
  ``scale_by_optimistic_gradient`` and L-BFGS do: the very gradient objects
  that reach mixed_precision end up in another rule's state."""

  def init(params):
    return {"last": jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)}

  def update(updates, state, params=None):
    del state, params
    return updates, {"last": updates}

  return optax.GradientTransformation(init, update)


TRANSFORMATIONS = {
  "mixed_precision": lambda: mpx.mixed_precision(optax.adam(1e-2)),
  "clip before": lambda: optax.chain(
    optax.clip_by_global_norm(0.5), mpx.mixed_precision(optax.adam(1e-2))
  ),
  "stateful rule before": lambda: optax.chain(
    optax.trace(decay=0.5, accumulator_dtype=jnp.float32), mpx.mixed_precision(optax.adam(1e-2))
  ),
  "rule keeping the last gradient before": lambda: optax.chain(
    keep_last_update(), mpx.mixed_precision(optax.adam(1e-2))
  ),
  "plain rule beside": lambda: optax.partition(
    {"low": mpx.mixed_precision(optax.adam(1e-2)), "full": optax.adam(1e-2)}, LABELS
  ),
  "MultiSteps around": lambda: optax.MultiSteps(mpx.mixed_precision(optax.adam(1e-2)), 2),
  "no mixed_precision": lambda: optax.sgd(1e-2, momentum=0.9, accumulator_dtype=jnp.float32),
}


def gradient_plan(steps, poisoned, seed=0):
  """Scaled gradients per step; ``poisoned`` steps get an inf or NaN somewhere."""
  rng = np.random.default_rng(seed)
  shapes = jax.tree.map(np.shape, params_fp16())
  plan = []
  for t in range(steps):
    grads = {
      k: (SCALE * 0.1 * rng.standard_normal(s)).astype(np.float32 if k == "norm" else np.float16)
      for k, s in shapes.items()
    }
    if t in poisoned:
      leaf = ["dense", "norm", "out"][t % 3]
      flat = grads[leaf].reshape(-1)
      flat[rng.integers(flat.size)] = [np.inf, np.nan, -np.inf][t % 3]
    plan.append(jax.tree.map(jnp.asarray, grads))
  return plan


def jitted_step(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  return step


def run(tx, plan, step):
  """``plan`` fed to ``step`` (``jitted_step(tx)``) from a fresh state."""
  params = params_fp16()
  state = tx.init(params)
  history = []
  for grads in plan:
    params, state, updates = step(params, state, grads)
    history.append((params, state, updates))
  return history


def inner_of(state):
  # Everything but the (static) loss-scale counters and, in a mixed_precision,
  # its count of the skips (a run never fed them has none).
  return without_skip_counts(state.inner_state)


# The quick tier runs each transformation in one form of the skip, the lax.cond
# ("one CPU device") or the select ("GPU form"), those that keep state beside
# mixed_precision's in the select (which computes every new leaf and keeps
# the old); -m slow runs every transformation in every form.
GPU_FORM = {"stateful rule before", "rule keeping the last gradient before", "MultiSteps around"}
FORMS = ("one CPU device", "several devices", "GPU form")  # conftest.py's


@pytest.mark.parametrize(
  ("finite_check_form", "name"),
  [
    pytest.param(
      form,
      name,
      id=f"{form}-{name}",
      marks=()
      if form == ("GPU form" if name in GPU_FORM else "one CPU device")
      else pytest.mark.slow,
    )
    for form in FORMS
    for name in TRANSFORMATIONS
  ],
  indirect=["finite_check_form"],
)
def test_poisoned_steps_leave_every_state_as_if_never_fed(finite_check_form, name):
  tx = mpx.static_loss_scale(TRANSFORMATIONS[name](), SCALE)
  steps, poisoned = 12, {2, 3, 7, 10}
  plan = gradient_plan(steps, poisoned)
  clean = [g for t, g in enumerate(plan) if t not in poisoned]
  step = jitted_step(tx)  # one compilation for both runs
  got, want = run(tx, plan, step), run(tx, clean, step)
  taken = 0
  for t in range(steps):
    params, state, updates = got[t]
    if t in poisoned:
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates)), t
      assert not bool(state.last_step_finite)
    else:
      taken += 1
      assert bool(state.last_step_finite)
    if taken:
      ref_params, ref_state, _ = want[taken - 1]
      assert tree_equal(params, ref_params), (name, t)
      assert tree_equal(inner_of(state), inner_of(ref_state)), (name, t)
  assert int(got[-1][1].skipped_steps) == len(poisoned)


def test_the_verdict_reaches_a_mixed_precision_behind_a_clip():
  # The clip rebuilds the gradients, so mixed_precision checks them itself as
  # well; an overflow that only the clip creates is still caught by it.
  tx = mpx.static_loss_scale(TRANSFORMATIONS["clip before"](), SCALE)
  params = params_fp16()
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, jnp.inf, p.dtype), params)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert tree_equal(new_state.inner_state, state.inner_state)


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
def test_a_wide_finite_gradient_without_a_master_does_not_skip():
  # float16 masters for float8 params; the float32 param has no master and is
  # updated in float32, so 1e5 (beyond float16) is a fine gradient for it.
  params = {"w": jnp.ones(2, jnp.float8_e4m3fn), "n": jnp.ones(2, jnp.float32)}
  grads = {"w": jnp.full(2, 0.5, jnp.float32), "n": jnp.asarray([1e5, 1.0], jnp.float32)}
  tx = mpx.mixed_precision(optax.sgd(1e-6), dtype=jnp.float16)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["n"], [-0.1, -1e-6], rtol=1e-6)


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
@pytest.mark.parametrize("inner_first", [False, True])
def test_a_gradient_that_overflows_narrow_masters_is_skipped(inner_first):
  # loss_scale vouches for the unscaled float32 gradient, not for its cast to
  # float16 masters: mixed_precision must check the cast itself, whether the
  # gradient reaches it directly or behind another rule.
  params = {"a": jnp.ones(2, jnp.float8_e4m3fn), "b": jnp.ones(2, jnp.float8_e4m3fn)}
  grads = {"a": jnp.ones(2, jnp.float32), "b": jnp.asarray([1e5, 1.0], jnp.float32)}
  mp = mpx.mixed_precision(optax.sgd(1e-6), dtype=jnp.float16)
  inner = optax.chain(optax.masked(optax.scale(1.0), {"a": True, "b": False}), mp)
  tx = mpx.static_loss_scale(inner if inner_first else mp, 1.0)
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert all(not np.any(np.asarray(u, np.float32)) for u in jax.tree.leaves(updates))
  assert tree_equal(mpx.master_params(new_state, params), mpx.master_params(state, params))


def test_float64_gradients_that_overflow_float32_are_skipped():
  with jax_versions.enable_x64():
    params = {"w": jnp.ones(2, jnp.float16)}
    grads = {"w": jnp.asarray([1e39, 1.0], jnp.float64)}  # finite, beyond float32
    tx = mpx.static_loss_scale(mpx.mixed_precision(optax.sgd(1e-3)), 2.0)
    state = tx.init(params)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert not np.any(np.asarray(updates["w"]))
    assert int(new_state.skipped_steps) == 1


def compiled_step(tx, params):
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()


# A figure of XLA's cost model as the newest jax compiles it: a release's
# check, for -m slow.
@jax_versions.requires_jax("0.10.2", "older XLA:CPU's figure: docs/design.md")
@pytest.mark.slow
@pytest.mark.xla_cost
@pytest.mark.parametrize(
  ("dtype", "make_tx"),
  [
    (jnp.float16, lambda: mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3)))),
    (jnp.bfloat16, lambda: mpx.mixed_precision(optax.adam(1e-3))),
  ],
)
def test_no_float32_buffer_of_updates_or_gradients_per_step(dtype, make_tx, finite_check_form):
  # Updates computed after the cond fuse into apply_updates, and unscaling
  # fuses into the update inside it: never 4 bytes of scratch per parameter.
  # On one CPU device the check reads the leaves without a predicate per
  # element (sums, folds): under 0.1 byte. With several devices it is the
  # plain isfinite(x).all(), whose predicate is one byte per element.
  if finite_check_form == "GPU form":
    pytest.skip("XLA:CPU's scratch for the GPU form is not a GPU's (see test_gpu_compile.py)")
  shapes = {"a": (256, 512), "b": (512, 256), "c": (512,), "d": (512,)}
  params = {k: jnp.ones(s, dtype) for k, s in shapes.items()}
  n = sum(math.prod(s) for s in shapes.values())
  temp = compiled_step(make_tx(), params).memory_analysis().temp_size_in_bytes
  limit = 0.1 if finite_check_form == "one CPU device" else 1.1
  assert temp <= limit * n, f"{temp / n:.3f} bytes of scratch per parameter"
