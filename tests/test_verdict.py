"""One verdict per step: computed on each gradient as the inner rule receives
it (unscaled, cast to its master dtype), reduced across ``axis_name``,
recorded in the states, and acted on by every transformation.

Each case below once produced two verdicts that disagreed: a step that
``mixed_precision`` skipped while ``loss_scale`` recorded it as finite (and
grew its scale), replicas that split, a chain that advanced around a skipped
``mixed_precision``, a float64 leaf narrowed through float32.
"""

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from treecheck import skip_recorded, tree_equal

import mpx
from mpx._src import compat

F16_MAX = float(jnp.finfo(jnp.float16).max)  # 65504


def _scale_rule(**overrides):
  # A scale that can back off below 1, so a backoff is visible from 1.0.
  settings = dict(init_scale=1.0, min_scale=2.0**-4, growth_interval=1)
  settings.update(overrides)
  return settings


def _mp_state(state):
  return state.inner_state if isinstance(state, mpx.LossScaleState) else state


# (param dtype, master dtype, gradient dtype, a gradient that overflows only
# when cast to the master dtype, a nearby one that does not)
CAST_CASES = {
  "fp8 e5m2 params, float16 masters, float32 grads": (
    jnp.float8_e5m2,
    jnp.float16,
    jnp.float32,
    7e4,
    6e4,
  ),
  "fp8 e4m3 params, float16 masters, float32 grads": (
    jnp.float8_e4m3fn,
    jnp.float16,
    jnp.float32,
    -1e5,
    -6.5e4,
  ),
}


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
@pytest.mark.parametrize("case", list(CAST_CASES))
@pytest.mark.parametrize("wrapped", ["alone", "under loss_scale"])
def test_a_cast_that_overflows_skips_the_step_and_every_state_records_it(case, wrapped):
  param_dtype, master_dtype, grad_dtype, overflowing, fitting = CAST_CASES[case]
  params = {"w": jnp.ones(4, param_dtype), "b": jnp.zeros(3, jnp.float32)}
  lr = 2.0**-10
  tx = mpx.mixed_precision(optax.sgd(lr), dtype=master_dtype)
  if wrapped == "under loss_scale":
    tx = mpx.loss_scale(tx, **_scale_rule())
  state = tx.init(params)
  step = jax.jit(tx.update)

  grads = {"w": jnp.full(4, overflowing, grad_dtype), "b": jnp.ones(3, jnp.float32)}
  updates, skipped = step(grads, state, params)
  assert all(not np.any(np.asarray(u, np.float32)) for u in jax.tree.leaves(updates))
  mp_before, mp_after = _mp_state(state), _mp_state(skipped)
  assert tree_equal(mp_after.master_params, mp_before.master_params)
  assert tree_equal(mp_after.inner_state, mp_before.inner_state)
  assert (int(mp_after.applied_steps), int(mp_after.nonfinite_steps)) == (0, 1)
  if wrapped == "under loss_scale":
    assert not bool(skipped.last_step_finite)
    assert int(skipped.skipped_steps) == 1 and int(skipped.growth_tracker) == 0
    assert float(skipped.loss_scale) == 0.5  # backed off, not grown

  # The check has teeth the other way: a value that fits is applied, exactly.
  scale = float(skipped.loss_scale) if wrapped == "under loss_scale" else 1.0
  grads = {"w": jnp.full(4, fitting * scale, grad_dtype), "b": jnp.ones(3, jnp.float32)}
  _, applied = step(grads, skipped, params)
  master = _mp_state(applied).master_params["w"]
  received = np.float16(fitting)  # unscaled, then cast to the float16 master
  want = np.float16(1.0) + received * np.float16(-lr)  # float16 arithmetic, as sgd's
  np.testing.assert_array_equal(np.asarray(master), np.full(4, want))
  assert int(_mp_state(applied).applied_steps) == 1
  if wrapped == "under loss_scale":
    assert bool(applied.last_step_finite) and int(applied.skipped_steps) == 1


def test_float64_gradient_narrowed_to_float32_masters_is_a_skip():
  with jax_versions.enable_x64():
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(1e-3)), **_scale_rule())
    state = tx.init(params)
    grads = {"w": jnp.full(2, 1e300, jnp.float64)}  # finite in float64, inf in float32
    updates, state = tx.update(grads, state, params)
    assert not np.any(np.asarray(updates["w"]))
    assert int(state.skipped_steps) == 1 and int(state.inner_state.nonfinite_steps) == 1
    assert float(state.loss_scale) == 0.5


@pytest.mark.parametrize("make", ["static_loss_scale", "loss_scale"])
def test_a_leaf_without_a_master_is_never_cast(make):
  """A float64 leaf has no float32 master: it is unscaled in float64, so a
  gradient of 1e300 is applied, as mixed_precision alone applies it."""
  with jax_versions.enable_x64():
    params = {"w": jnp.ones(2, jnp.bfloat16), "big": jnp.ones(2, jnp.float64)}
    mp = mpx.mixed_precision(optax.sgd(1e-300))
    tx = (
      mpx.static_loss_scale(mp, 4.0)
      if make == "static_loss_scale"
      else mpx.loss_scale(mp, init_scale=4.0)
    )
    state = tx.init(params)
    grads = {"w": jnp.ones(2, jnp.bfloat16) * 4, "big": jnp.full(2, 4e300, jnp.float64)}
    updates, state = tx.update(grads, state, params)
    assert bool(state.last_step_finite) and int(state.skipped_steps) == 0
    assert updates["big"].dtype == jnp.float64
    # Independent reference: float64 numpy.
    np.testing.assert_array_equal(np.asarray(updates["big"]), np.full(2, -1e-300 * 1e300))
    alone, _ = mp.update({"w": grads["w"] / 4, "big": grads["big"] / 4}, mp.init(params), params)
    np.testing.assert_array_equal(np.asarray(alone["big"]), np.asarray(updates["big"]))


def _makes_inf_on_second_step() -> optax.GradientTransformation:
  """A stateful rule (it counts) that multiplies the gradients by inf on its
  second step: finite gradients in, inf out."""
  return optax.scale_by_schedule(lambda count: jnp.where(count == 1, jnp.inf, 1.0))


@pytest.mark.parametrize("masters", ["full", "remainder", "stochastic"])
def test_a_rule_before_mixed_precision_that_makes_inf_skips_the_whole_step(masters):
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  inner = optax.chain(
    _makes_inf_on_second_step(), mpx.mixed_precision(optax.sgd(0.1), masters=masters)
  )
  tx = mpx.loss_scale(inner, **_scale_rule())
  state = tx.init(params)
  step = jax.jit(tx.update)
  grads = {"w": jnp.ones(4, jnp.bfloat16)}
  updates, first = step(grads, state, params)
  params = optax.apply_updates(params, updates)
  assert bool(first.last_step_finite) and int(first.inner_state[0].count) == 1

  updates, second = step(grads, first, params)
  assert not np.any(np.asarray(updates["w"]))
  # The chain's count did not advance; the mixed_precision state is as it was
  # but for its count of the skip.
  assert skip_recorded(second.inner_state, first.inner_state)
  assert not bool(second.last_step_finite)
  assert int(second.skipped_steps) == 1
  assert float(second.loss_scale) == float(first.loss_scale) / 2


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
def test_a_partition_rolls_back_every_group_when_one_mixed_precision_skips():
  params = {"low": jnp.ones(4, jnp.float8_e5m2), "full": jnp.ones(2, jnp.float32)}
  inner = optax.partition(
    {
      "low": mpx.mixed_precision(optax.adam(1e-3), dtype=jnp.float16),
      "full": optax.adam(1e-3),
    },
    {"low": "low", "full": "full"},
  )
  tx = mpx.loss_scale(inner, **_scale_rule())
  state = tx.init(params)
  grads = {"low": jnp.full(4, 7e4, jnp.float32), "full": jnp.ones(2, jnp.float32)}
  updates, after = jax.jit(tx.update)(grads, state, params)
  assert all(not np.any(np.asarray(u, np.float32)) for u in jax.tree.leaves(updates))
  assert skip_recorded(after.inner_state, state.inner_state)  # adam's count too
  assert int(after.skipped_steps) == 1 and float(after.loss_scale) == 0.5


def test_accumulation_steps_of_multisteps_are_not_read_as_skips():
  params = {"w": jnp.ones(4, jnp.float16)}
  tx = mpx.loss_scale(
    optax.MultiSteps(mpx.mixed_precision(optax.sgd(0.1)), every_k_schedule=3),
    init_scale=8.0,
    growth_interval=100,
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  for i in range(6):
    updates, state = step({"w": jnp.full(4, 8.0, jnp.float16)}, state, params)
    params = optax.apply_updates(params, updates)
    assert bool(state.last_step_finite), i
  assert int(state.skipped_steps) == 0 and int(state.growth_tracker) == 6
  np.testing.assert_allclose(np.asarray(params["w"], np.float32), 1 - 2 * 0.1, rtol=1e-3)


def _split_verdict_case():
  """8 replicas of fp8 params under float16 masters; replica 5 alone gets a
  gradient that overflows float16 only when cast."""
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.sgd(1e-6), dtype=jnp.float16), **_scale_rule(), axis_name="data"
  )
  params = jnp.ones(4, jnp.float8_e5m2)
  local = jnp.ones((8, 4), jnp.float32).at[5, 0].set(7e4)
  return tx, params, local


def _check_all_skipped(updates, states):
  assert not np.any(np.asarray(updates, np.float32))
  assert np.all(np.asarray(states.skipped_steps) == 1)
  assert np.all(~np.asarray(states.last_step_finite))
  assert np.all(np.asarray(states.inner_state.nonfinite_steps) == 1)
  assert np.all(np.asarray(states.loss_scale) == 0.5)


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
def test_the_verdict_after_the_cast_is_agreed_across_axis_name_under_vmap():
  tx, params, local = _split_verdict_case()
  state = tx.init(params)
  # Jitted: eagerly every batched operation would compile on its own.
  update = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), axis_name="data"))
  updates, states = update(local, state, params)
  _check_all_skipped(updates, states)


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")
def test_the_verdict_after_the_cast_is_agreed_across_axis_name_under_shard_map():
  tx, params, local = _split_verdict_case()
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  state = tx.init(params)
  local = jax.device_put(local, NamedSharding(mesh, P("data")))

  def per_device(local, state, params):
    updates, state = tx.update(local[0], state, params)
    return updates[None], jax.tree.map(lambda x: x[None], state)

  fn = jax_versions.shard_map(
    per_device,
    mesh=mesh,
    in_specs=(P("data"), P(), P()),
    out_specs=(P("data"), P("data")),
    check_vma=False,
  )
  updates, states = jax.jit(fn)(local, state, params)
  _check_all_skipped(updates, states)


def test_mixed_precision_alone_counts_applied_and_skipped_steps():
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.adam(1e-3))
  state = tx.init(params)
  step = jax.jit(tx.update)
  pattern = [True, False, True, True, False]
  for finite in pattern:
    grads = {"w": jnp.ones(3, jnp.bfloat16) * (1.0 if finite else jnp.nan)}
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert int(state.applied_steps) == sum(pattern)
  assert int(state.nonfinite_steps) == len(pattern) - sum(pattern)
  assert int(state.inner_state[0].count) == sum(pattern)  # adam's own count agrees


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
def test_a_skip_inside_a_chain_is_agreed_across_axis_name():
  """General path with axis_name: replica 5's mixed_precision alone meets a
  cast overflow behind a clip; every replica rolls back, its own
  mixed_precision state included, and counts the skip."""
  mp = mpx.mixed_precision(optax.sgd(1e-6), dtype=jnp.float16)
  tx = mpx.loss_scale(
    optax.chain(optax.scale_by_schedule(lambda n: 1.0), mp), **_scale_rule(), axis_name="data"
  )
  params = jnp.ones(4, jnp.float8_e5m2)
  local = jnp.ones((8, 4), jnp.float32).at[5, 0].set(7e4)
  state = tx.init(params)
  # Jitted: eagerly every batched operation would compile on its own.
  update = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), axis_name="data"))
  updates, states = update(local, state, params)
  assert not np.any(np.asarray(updates, np.float32))
  assert np.all(np.asarray(states.skipped_steps) == 1)
  assert np.all(np.asarray(states.inner_state[0].count) == 0)  # the chain did not advance
  masters = np.asarray(states.inner_state[1].master_params)
  np.testing.assert_array_equal(masters, np.ones((8, 4), np.float16))
