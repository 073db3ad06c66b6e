"""A step computes the same bits called eagerly as under ``jax.jit``, and judges a
gradient as the rule receives it, whatever container or dtype it arrives in."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import tree_equal, without_skip_counts

import mpx

MASTERS = ("full", "remainder", "24bit", "stochastic")
MOMENTS = ("full", "bfloat16", "8bit")
MODES = list(itertools.product(MASTERS, MOMENTS))
UNIT = 2.0**-24


def _exponent_gap_step(masters: str, jit: bool) -> tuple[float, float]:
  """One SGD(1.0) step from a master just below 1 (param 1.0; ``1 - 2**-16``, which
  24 bits hold too) to ``-3 * 2**-24``: the float32 update ``-(1 + 3 * 2**-24)``
  rounds, so the param lands on ``-4 * 2**-24`` (docs/concepts_masters.md, "The
  exponent-gap corner")."""
  tx = mpx.mixed_precision(optax.sgd(1.0), masters=masters)
  full = {"w": jnp.array([1 - 2**-16])}  # 24 bits hold it: allow_rounding rounds nothing
  params, state = mpx.init_from_full_precision(tx, full, jnp.bfloat16, allow_rounding=True)
  grads = {"w": jnp.array([1 - 2**-16 + 3 * UNIT])}
  update = jax.jit(tx.update) if jit else tx.update
  updates, state = update(grads, state, params)
  params = optax.apply_updates(params, updates)
  master = mpx.master_params(state, params)["w"][0]
  return float(params["w"][0]) / UNIT, float(master) / UNIT


@pytest.mark.parametrize("masters", ["full", "remainder", "24bit"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_the_exponent_gap_corner_lands_param_and_master_together(masters, jit):
  # Hand-computed: 1 + (-(1 + 2**-22)) = -2**-22, and the master moves there.
  assert _exponent_gap_step(masters, jit) == (-4.0, -4.0)


def _partitioned_modes(skip: str = "step") -> tuple[optax.GradientTransformation, dict, dict]:
  """One transformation holding every masters x moments mode, a group each, on
  leaves large enough to compress, plus a float32 leaf with no master."""
  labels = {f"{m}/{n}": f"{m}/{n}" for m, n in MODES}
  transforms = {
    label: mpx.mixed_precision(
      optax.adamw(1e-2, weight_decay=0.1), masters=m, moments=n, seed=7, skip=skip
    )
    for label, (m, n) in zip(labels, MODES, strict=True)
  }
  rng = np.random.default_rng(0)
  params = {label: jnp.asarray(rng.normal(size=(32, 128)), jnp.bfloat16) for label in labels}
  params["bias"] = jnp.asarray(rng.normal(size=(128,)), jnp.float32)
  labels["bias"] = "bias"
  transforms["bias"] = mpx.mixed_precision(optax.adamw(1e-2))
  return optax.partition(transforms, labels), params, labels


@pytest.mark.slow
@pytest.mark.parametrize("skip", ["step", "leaf"])
def test_eager_and_jitted_steps_compute_the_same_bits_in_every_mode(skip):
  tx, params, _ = _partitioned_modes(skip)
  rng = np.random.default_rng(1)
  state = tx.init(params)
  jitted = jax.jit(tx.update)
  # A few jitted steps first, so the moments and masters hold more than zeros.
  for _ in range(2):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    updates, state = jitted(grads, state, params)
    params = optax.apply_updates(params, updates)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  eager_updates, eager_state = tx.update(grads, state, params)
  jit_updates, jit_state = jitted(grads, state, params)
  assert tree_equal(eager_state, jit_state)
  assert tree_equal(
    optax.apply_updates(params, eager_updates), optax.apply_updates(params, jit_updates)
  )


@pytest.mark.parametrize("moments", ["8bit", "4bit"])
def test_an_eager_init_codes_the_moments_as_the_jitted_one(moments):
  """Eagerly, init codes each compressed moment by one jitted call a leaf;
  under jit the coder is part of init's program. Both store the same bits,
  here for moments that start at adagrad's 0.1 rather than at zero."""
  params = {"w": jnp.ones((16, 256), jnp.bfloat16), "b": jnp.ones((8,), jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.adagrad(0.1), masters="remainder", moments=moments)
  eager, jitted = tx.init(params), jax.jit(tx.init)(params)
  assert float(mpx.inner_state(eager)[0].sum_of_squares["w"][0, 0]) == np.float32(0.1)
  assert tree_equal(eager, jitted)


@pytest.mark.slow
def test_an_eager_init_is_the_jitted_one_in_every_mode():
  tx, params, _ = _partitioned_modes()
  assert tree_equal(tx.init(params), jax.jit(tx.init)(params))


def test_an_eager_float16_step_under_loss_scale_is_the_jitted_one():
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float16)}
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3)), init_scale=2.0**10)
  state = tx.init(params)
  grads = {"w": jnp.asarray(rng.normal(size=(64, 64)) * 2.0**10, jnp.float16)}
  eager = tx.update(grads, state, params)
  jitted = jax.jit(tx.update)(grads, state, params)
  assert tree_equal(eager, jitted)


def _overflowing_host_gradient(tx, params):
  """One step on a host float64 gradient whose first element overflows float32."""
  state = tx.init(params)
  grads = {"w": np.array([1e300, 1.0])}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # numpy's cast to float32
    eager = tx.update(grads, state, params)
    jitted = jax.jit(tx.update)(grads, state, params)
  return state, eager, jitted


@pytest.mark.parametrize(
  "make_tx, dtype",
  [
    (lambda: mpx.loss_scale(optax.adam(0.1)), jnp.float32),
    (lambda: mpx.static_loss_scale(optax.adam(0.1), 4.0), jnp.float32),
    (lambda: mpx.loss_scale(mpx.mixed_precision(optax.adam(0.1))), jnp.float16),
  ],
  ids=["loss_scale", "static_loss_scale", "loss_scale(mixed_precision)"],
)
def test_a_host_float64_gradient_beyond_float32_is_skipped_and_counted(make_tx, dtype):
  if jax.config.jax_enable_x64:
    pytest.skip("with x64 on, the rule receives the gradient in float64, finite")
  params = {"w": jnp.ones(2, dtype)}
  state, eager, jitted = _overflowing_host_gradient(make_tx(), params)
  for updates, new_state in (eager, jitted):
    assert np.all(np.asarray(updates["w"]) == 0)
    assert int(new_state.skipped_steps) == 1
    assert tree_equal(without_skip_counts(new_state.inner_state), state.inner_state)
  assert tree_equal(eager, jitted)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["no master", "master"])
def test_mixed_precision_alone_skips_a_host_float64_gradient_beyond_float32(dtype):
  if jax.config.jax_enable_x64:
    pytest.skip("with x64 on, the rule receives the gradient in float64, finite")
  params = {"w": jnp.ones(2, dtype)}
  state, eager, jitted = _overflowing_host_gradient(mpx.mixed_precision(optax.adam(0.1)), params)
  for updates, new_state in (eager, jitted):
    assert np.all(np.asarray(updates["w"]) == 0)
    assert (int(new_state.applied_steps), int(new_state.nonfinite_steps)) == (0, 1)
    assert tree_equal(new_state.inner_state, state.inner_state)
  assert tree_equal(eager, jitted)
