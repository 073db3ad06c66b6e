"""fp8 params under ``mixed_precision``, end to end, with the apply step the docs give.

``optax.apply_updates`` adds each update to its param with JAX's implicit type
promotion, which the float8 types refuse (float8 + float32 raises
``TypePromotionError``). docs/howto.md ("Train fp8 params") tells users to
widen the param to the update's dtype themselves:
``(p.astype(u.dtype) + u).astype(p.dtype)``. These tests run that recipe in a
training loop and check every step against a reference written in numpy and
ml_dtypes, independent of mpx: the masters are plain SGD in the master dtype,
and each param is its master rounded to nearest even, saturating at the fp8
type's largest finite value.
"""

import jax
import jax.numpy as jnp
import jax_versions
import ml_dtypes
import numpy as np
import optax
import pytest

import mpx
from mpx._src import compat

FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
MASTERS = [jnp.float16, jnp.float32]
# A power of two: lr * g is exact in the master dtype, so the reference's
# rounding cannot depend on whether XLA fuses the multiply into the add.
LR = 2.0**-4


def apply_updates(params, updates):
  """The docs' recipe: add in the update's (master) dtype, round to the param's."""
  return jax.tree.map(lambda p, u: (p.astype(u.dtype) + u).astype(p.dtype), params, updates)


def bits(x):
  x = np.asarray(x)
  return x.view(f"uint{8 * x.dtype.itemsize}")


def rounded(master, param_dtype):
  """The master rounded to nearest even, saturating: computed by ml_dtypes."""
  limit = float(ml_dtypes.finfo(np.dtype(param_dtype)).max)
  return np.clip(np.asarray(master, np.float64), -limit, limit).astype(np.dtype(param_dtype))


def test_optax_apply_updates_refuses_fp8_params():
  """Why the docs need a recipe: if this starts to pass, revisit docs/howto.md."""
  params = {"w": jnp.ones(4, jnp.float8_e4m3fn)}
  updates = {"w": jnp.full(4, 0.5, jnp.float32)}
  with pytest.raises(jax_versions.type_promotion_error()):
    optax.apply_updates(params, updates)


@jax_versions.below_jax(compat.FLOAT8_NEEDS_JAX, "what mpx says to an older jax")
@pytest.mark.parametrize("param_dtype", FP8, ids=lambda d: jnp.dtype(d).name)
def test_fp8_params_on_an_older_jax_name_the_version_they_need(param_dtype):
  tx = mpx.mixed_precision(optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"float8 params .* need jax >= 0\.7\.0"):
    tx.init({"w": jnp.ones(4, param_dtype)})


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
@pytest.mark.parametrize("master_dtype", MASTERS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("param_dtype", FP8, ids=lambda d: jnp.dtype(d).name)
def test_fp8_training_loop_lands_on_the_rounded_masters(param_dtype, master_dtype):
  x = jax.random.normal(jax.random.key(0), (64, 16))
  y = x @ jnp.linspace(-2.0, 2.0, 16)
  params = {"w": (0.5 * jax.random.normal(jax.random.key(1), (16,))).astype(param_dtype)}
  tx = mpx.mixed_precision(optax.sgd(LR), dtype=master_dtype)
  state = tx.init(params)

  def loss_fn(p):
    return jnp.mean((x @ p["w"].astype(jnp.float32) - y) ** 2)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)  # fp8 gradients
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state, loss, grads

  np_master = np.dtype(master_dtype)
  master = np.asarray(params["w"]).astype(np_master)  # init: the param, widened
  losses = []
  for _ in range(100):
    params, state, loss, grads = step(params, state)
    losses.append(float(loss))
    master = master + np_master.type(-LR) * np.asarray(grads["w"]).astype(np_master)
    assert params["w"].dtype == param_dtype
    np.testing.assert_array_equal(bits(mpx.master_params(state, params)["w"]), bits(master))
    np.testing.assert_array_equal(bits(params["w"]), bits(rounded(master, param_dtype)))
  # It trains: the masters keep the steps that fp8 alone would round away.
  assert losses[-1] < losses[0] / 50, losses[::10]


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
@pytest.mark.parametrize("param_dtype", FP8, ids=lambda d: jnp.dtype(d).name)
def test_fp8_params_saturate_and_skipped_steps_change_nothing(param_dtype):
  limit = float(ml_dtypes.finfo(np.dtype(param_dtype)).max)
  params = {"w": jnp.array([limit, -limit, 1.0], param_dtype)}
  tx = mpx.mixed_precision(optax.sgd(1.0), dtype=jnp.float32)
  state = tx.init(params)
  # Push the first two masters a quarter beyond the fp8 range.
  grads = {"w": jnp.array([-limit / 4, limit / 4, 0.0], param_dtype)}
  updates, state = tx.update(grads, state, params)
  params = apply_updates(params, updates)
  masters = np.asarray(mpx.master_params(state, params)["w"])
  np.testing.assert_array_equal(masters, [1.25 * limit, -1.25 * limit, 1.0])
  np.testing.assert_array_equal(np.asarray(params["w"], np.float32), [limit, -limit, 1.0])

  nan = {"w": jnp.array([jnp.nan, 1.0, 1.0], param_dtype)}
  updates, after = tx.update(nan, state, params)
  np.testing.assert_array_equal(np.asarray(updates["w"]), 0.0)
  np.testing.assert_array_equal(bits(apply_updates(params, updates)["w"]), bits(params["w"]))
  np.testing.assert_array_equal(bits(mpx.master_params(after, params)["w"]), bits(masters))
