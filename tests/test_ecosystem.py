"""optax rules with unusual inputs: DP-SGD's per-example gradients and
L-BFGS's extra arguments, under ``mixed_precision`` and ``loss_scale``.

The reference is the same optax rule run in float32, jitted, on the master
view, fed the same gradients cast to float32: its state must match bit for
bit, its masters to a few ulps (separately compiled programs may contract
multiply-adds differently).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import tree_equal

import mpx


def per_example_grads(seed, batch=5):
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.normal(size=(batch, 3, 4)).astype(np.float32)).astype(jnp.bfloat16),
    "b": jnp.asarray(rng.normal(size=(batch, 4)).astype(np.float32)),
  }


def keys_as_data(tree):
  """PRNG keys as their uint32 data, so trees holding them compare bitwise."""
  is_key = lambda x: jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def dpsgd():
  """``optax.contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=3)``,
  built from its parts (the same state and updates, bit for bit): optax 0.2.8's
  ``dpsgd`` requires ``seed`` and passes it on to
  ``differentially_private_aggregate``, which warns that ``seed`` is deprecated
  for ``key``."""
  return optax.chain(
    optax.contrib.differentially_private_aggregate(
      l2_norm_clip=1.0, noise_multiplier=0.5, key=jax.random.key(3)
    ),
    optax.identity(),  # where dpsgd puts its momentum
    optax.scale_by_learning_rate(0.1),
  )


def test_dpsgd_takes_per_example_gradients_like_float32_optax():
  params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.bfloat16).reshape(3, 4), "b": jnp.zeros(4)}
  tx, ref = mpx.mixed_precision(dpsgd()), dpsgd()
  state = tx.init(params)

  @jax.jit
  def ref_step(masters, inner_state, grads):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, inner_state = ref.update(grads, inner_state, masters)
    return optax.apply_updates(masters, updates), inner_state

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  for seed in range(4):
    grads = per_example_grads(seed)
    masters, ref_state = ref_step(mpx.master_params(state, params), state.inner_state, grads)
    params, state, updates = step(params, state, grads)
    assert jax.tree.map(jnp.shape, updates) == {"w": (3, 4), "b": (4,)}
    assert tree_equal(keys_as_data(state.inner_state), keys_as_data(ref_state))
    # Two XLA programs may contract a * b + c into an FMA differently: a last
    # bit now and then; a gradient rounded to bf16 would be thousands of ulps.
    for got, want in zip(
      jax.tree.leaves(mpx.master_params(state, params)), jax.tree.leaves(masters), strict=True
    ):
      np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=4)


@pytest.mark.parametrize("wrap", ["mixed_precision", "loss_scale"])
def test_per_example_gradients_for_a_rule_that_does_not_reduce_them_are_refused(wrap):
  params = {"w": jnp.ones((3, 4), jnp.bfloat16), "b": jnp.zeros(4)}
  tx = mpx.mixed_precision(optax.sgd(1.0))
  if wrap == "loss_scale":
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    tx = mpx.loss_scale(optax.sgd(1.0))  # without mixed_precision: loss_scale checks
  with pytest.raises(ValueError, match=r"the inner rule did not reduce them .*dpsgd"):
    tx.update(per_example_grads(0), tx.init(params), params)
  # A gradient whose trailing shape does not match is still refused at once.
  bad = {"w": jnp.ones((5, 4, 3), jnp.bfloat16), "b": jnp.zeros(4)}
  with pytest.raises(ValueError, match=r"gradient 'w' has shape \[5, 4, 3\]"):
    tx.update(bad, tx.init(params), params)


def quadratic(params):
  target = jnp.linspace(-2.0, 2.0, 8)
  weights = jnp.linspace(0.5, 3.0, 8)
  return jnp.sum(weights * (params["w"].astype(jnp.float32) - target) ** 2)


@functools.cache
def lbfgs_reference_step():
  """float32 L-BFGS on the masters, at the bf16 params: jitted once for both cases."""
  ref = optax.lbfgs()

  @jax.jit
  def ref_step(masters, inner_state, params):
    value, grad = jax.value_and_grad(quadratic)(params)  # at the bf16 params, as mpx's
    grad = jax.tree.map(lambda g: g.astype(jnp.float32), grad)
    updates, inner_state = ref.update(
      grad, inner_state, masters, value=value, grad=grad, value_fn=quadratic
    )
    return optax.apply_updates(masters, updates), inner_state

  return ref_step


@pytest.mark.slow
@pytest.mark.parametrize("scaled", [False, True])
def test_lbfgs_extra_arguments_reach_the_inner_rule_in_float32(scaled):
  params = {"w": jnp.zeros(8, jnp.bfloat16)}
  mp = mpx.mixed_precision(optax.lbfgs())
  tx = mpx.loss_scale(mp, init_scale=2.0**4) if scaled else mp
  state = tx.init(params)
  inner = (lambda s: s.inner_state.inner_state) if scaled else (lambda s: s.inner_state)

  def step(params, state):
    scale = mpx.get_loss_scale(state) if scaled else jnp.float32(1)
    value, grad = jax.value_and_grad(lambda p: quadratic(p) * scale)(params)
    updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=quadratic)
    return optax.apply_updates(params, updates), state

  step, ref_step = jax.jit(step), lbfgs_reference_step()
  for _ in range(6):
    expected = ref_step(mpx.master_params(state, params), inner(state), params)
    params, state = step(params, state)
    assert tree_equal((mpx.master_params(state, params), inner(state)), expected)
  assert float(quadratic(params)) < 0.05 * float(quadratic({"w": jnp.zeros(8)}))


def test_params_widened_by_an_apply_that_does_not_cast_back_are_refused():
  # equinox.apply_updates computes p + u: float32 updates widen bf16 params.
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(2)}
  tx = mpx.mixed_precision(optax.adam(1e-3))
  state = tx.init(params)
  updates, state = tx.update(params, state, params)
  widened = jax.tree.map(lambda p, u: p + u, params, updates)
  assert widened["w"].dtype == jnp.float32
  with pytest.raises(ValueError, match=r"param 'w' is float32\[3\].*widened.*optax.apply_updates"):
    tx.update(params, state, widened)
  # optax.apply_updates keeps the dtype, and the run goes on.
  tx.update(params, state, optax.apply_updates(params, updates))
