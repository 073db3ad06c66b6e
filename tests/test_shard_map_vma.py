"""`shard_map` with JAX's default `check_vma=True`, in the layouts users write.

- Replicated params (`P()`), the batch split over `data`, and gradients that
  autodiff reduces: `jax.grad` with respect to a replicated param sums its
  per-device contributions.
- FSDP/ZeRO: params, gradients and optimizer state split over `data`; the
  params are all-gathered for the forward pass, and autodiff reduce-scatters
  the gradients.

With `check_vma`, `out_specs=P()` for the loss scale and the counters is
accepted only if JAX proves them identical on every device. And the layouts
that cannot work give an error naming the fix, not one from `lax.cond`'s
branch typing. Runs on the 8 host CPU devices that tests/conftest.py asks for.
"""

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpx

pytestmark = jax_versions.requires_jax("0.6.1", "shard_map's check_vma types (vma)")

STEPS = 4
POISONED = (1, 5)  # (step, device): one device's batch overflows at that step


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) == 8, "tests/conftest.py asks XLA for 8 host devices"
  return Mesh(np.array(jax.devices()), ("data",))


def params_fp16():
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(0.1 * rng.standard_normal((16, 8)), jnp.float16),
    "b": jnp.zeros(8, jnp.float16),
  }


def batches():
  rng = np.random.default_rng(1)
  out = []
  for step in range(STEPS):
    x = rng.standard_normal((32, 16)).astype(np.float16)
    if step == POISONED[0]:
      x[4 * POISONED[1], 0] = np.inf  # rows 4d..4d+3 are device d's
    out.append((jnp.asarray(x), jnp.asarray(rng.standard_normal(32), jnp.float16)))
  return out


def loss_fn(params, x, y):
  out = (x @ params["w"] + params["b"]).astype(jnp.float32).sum(-1)
  return jnp.mean((out - y.astype(jnp.float32)) ** 2)


def make_tx(axis_name="data"):
  return mpx.loss_scale(
    mpx.mixed_precision(optax.adam(1e-2)), init_scale=2.0**4, axis_name=axis_name
  )


def single_device_run():
  tx = make_tx(axis_name=None)
  params = params_fp16()
  state = tx.init(params)
  for x, y in batches():
    grads = jax.grad(lambda p, x=x, y=y, s=state: mpx.scale_loss(loss_fn(p, x, y), s))(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def check_run(params, state, reference):
  ref_params, ref_state = reference
  assert int(state.skipped_steps) == 1 == int(ref_state.skipped_steps)
  assert float(state.loss_scale) == 8.0 == float(ref_state.loss_scale)
  # Per-device means summed in another order than one mean: close, not bitwise.
  masters = mpx.master_params(state, params)
  ref_masters = mpx.master_params(ref_state, ref_params)
  for name in ("w", "b"):
    np.testing.assert_allclose(masters[name], ref_masters[name], rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(masters["b"])).min() > 1e-3  # it moved


def replicated_step(step, mesh, state_specs):
  """``step(params, state, x, y)`` jitted under ``shard_map``: params and
  state replicated, the batch split over ``data``."""
  in_specs = (P(), state_specs, P("data"), P("data"))
  return jax.jit(
    jax_versions.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(P(), state_specs))
  )


@pytest.mark.slow
@pytest.mark.floors
def test_replicated_params_with_gradients_reduced_by_autodiff(mesh):
  tx = make_tx()
  params = params_fp16()
  state = tx.init(params)
  state_specs = jax.tree.map(lambda _: P(), state)

  def step(params, state, x, y):
    def scaled(p):
      return mpx.scale_loss(jax.lax.pmean(loss_fn(p, x, y), "data"), state)

    grads = jax.grad(scaled)(params)  # invariant: autodiff summed the devices' parts
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = replicated_step(step, mesh, state_specs)
  for x, y in batches():
    params, state = step(params, state, x, y)
  check_run(params, state, single_device_run())


def fsdp_setup(mesh, tx):
  param_specs = {"w": P("data"), "b": P()}
  params = jax.device_put(
    params_fp16(), jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs)
  )
  shardings = mpx.zero1_shardings(tx, params, mesh, axis=None)  # the state follows the params
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  state_specs = jax.tree.map(lambda s: s.spec, shardings)
  assert optax.tree.get(state_specs, "master_params") == param_specs

  def step(params, state, x, y):
    def scaled(p):
      whole = {"w": jax.lax.all_gather(p["w"], "data", tiled=True), "b": p["b"]}
      return mpx.scale_loss(jax.lax.pmean(loss_fn(whole, x, y), "data"), state)

    grads = jax.grad(scaled)(params)  # "w": reduce-scattered, varying over "data"
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax_versions.shard_map(
      step,
      mesh=mesh,
      in_specs=(param_specs, state_specs, P("data"), P("data")),
      out_specs=(param_specs, state_specs),
    )
  )
  return step, params, state


@pytest.mark.slow  # 10 s; the other shard_map tests here stay quick
@pytest.mark.floors
def test_fsdp_params_grads_and_state_sharded(mesh):
  step, params, state = fsdp_setup(mesh, make_tx())
  for x, y in batches():
    params, state = step(params, state, x, y)
  assert state.inner_state.master_params["w"].sharding.spec == P("data")
  assert state.loss_scale.sharding.spec == P()
  check_run(params, state, single_device_run())


def test_sharded_gradients_without_axis_name_name_it(mesh):
  step, params, state = fsdp_setup(mesh, make_tx(axis_name=None))
  x, y = batches()[0]
  with pytest.raises(ValueError, match=r"vary across mesh axis 'data'.*Pass axis_name='data'"):
    step(params, state, x, y)


@pytest.mark.parametrize("wrap", ["loss_scale", "mixed_precision alone"])
def test_per_device_gradients_of_replicated_params_name_the_fix(mesh, wrap):
  """A state without a `data` axis meets gradients that differ per device:
  each device would step the replicated masters its own way."""
  tx = make_tx() if wrap == "loss_scale" else mpx.mixed_precision(optax.adam(1e-2))
  params = params_fp16()
  state = tx.init(params)
  state_specs = jax.tree.map(lambda _: P(), state)

  def step(params, state, x, y):
    local = jax_versions.varying(params, "data")  # grads of the local loss alone
    grads = jax.grad(lambda p: loss_fn(p, x, y))(local)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = replicated_step(step, mesh, state_specs)
  x, y = batches()[0]
  with pytest.raises(ValueError, match=r"varies across mesh axis 'data'.*jax\.lax\.pmean"):
    step(params, state, x, y)


def test_fsdp_mixed_precision_alone_names_the_fix(mesh):
  # Without loss_scale there is no axis_name to agree the verdict: each device
  # would check its own shard of the gradients and skip alone.
  step, params, state = fsdp_setup(mesh, mpx.mixed_precision(optax.adam(1e-2)))
  x, y = batches()[0]
  with pytest.raises(ValueError, match=r"vary across mesh axis 'data'.*static_loss_scale"):
    step(params, state, x, y)


def test_fsdp_mixed_precision_under_a_static_scale_of_one_with_axis_name(mesh):
  # The fix that error names: a scale of 1 changes nothing but the verdict,
  # which axis_name now agrees across the devices.
  tx = mpx.static_loss_scale(mpx.mixed_precision(optax.adam(1e-2)), 1.0, axis_name="data")
  step, params, state = fsdp_setup(mesh, tx)
  skipped = []
  for x, y in batches():
    params, state = step(params, state, x, y)
    skipped.append(int(state.skipped_steps))
  assert skipped == [0, 1, 1, 1]  # the poisoned step, skipped on every device
  assert float(state.loss_scale) == 1.0
  assert state.inner_state.master_params["w"].sharding.spec == P("data")


def test_split_params_with_a_replicated_state_name_the_fix(mesh):
  # The state must be split like the params: its masters are whole here.
  tx = make_tx()
  param_specs = {"w": P("data"), "b": P()}
  params = jax.device_put(
    params_fp16(), jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs)
  )
  state = tx.init(params)
  state_specs = jax.tree.map(lambda _: P(), state)

  def step(params, state, x, y):
    def scaled(p):
      whole = {"w": jax.lax.all_gather(p["w"], "data", tiled=True), "b": p["b"]}
      return mpx.scale_loss(jax.lax.pmean(loss_fn(whole, x, y), "data"), state)

    updates, state = tx.update(jax.grad(scaled)(params), state, params)
    return optax.apply_updates(params, updates), state

  in_specs = (param_specs, state_specs, P("data"), P("data"))
  step = jax.jit(
    jax_versions.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(param_specs, state_specs))
  )
  x, y = batches()[0]
  with pytest.raises(ValueError, match=r"master has shape \[16, 8\].*zero1_shardings"):
    step(params, state, x, y)
