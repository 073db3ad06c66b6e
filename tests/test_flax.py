"""Flax works with mpx unchanged: linen's TrainState and nnx's Optimizer.

mpx transformations are ordinary optax transformations whose ``update`` needs
the params, which both ``TrainState.apply_gradients`` and
``nnx.Optimizer.update`` pass. These tests train tiny regression models for a
few dozen steps and check the mixed-precision contract from the outside:
low-precision params, float32 masters, falling loss, and skipped steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import mpx

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
PyTree = Any


def _regression_data(seed: int, n: int = 64, features: int = 4) -> tuple[jax.Array, jax.Array]:
  """A smooth nonlinear target a small MLP can fit in a few dozen steps."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, features)).astype(np.float32)
  w = rng.normal(size=(features, 1)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.tanh(x @ w) + 0.5)


def _dtypes(tree: PyTree) -> set:
  return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


def _assert_bitwise(actual: PyTree, expected: PyTree) -> None:
  """Same structure, dtypes and bits at every leaf."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.dtype == e.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _has_bits_beyond(masters: PyTree, dtype) -> bool:
  """True if some master is not representable in ``dtype``: it holds updates
  too small for the low-precision weight, which is what masters are for."""
  return any(
    not np.array_equal(np.asarray(m), np.asarray(m.astype(dtype).astype(m.dtype)))
    for m in jax.tree.leaves(masters)
  )


# ----------------------------------------------------------------------------
# linen + flax.training.train_state.TrainState


class _LinenMLP(nn.Module):
  """Two dense layers with fp16 weights and fp16 compute."""

  hidden: int = 16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Dense(self.hidden, dtype=F16, param_dtype=F16)(x)
    return nn.Dense(1, dtype=F16, param_dtype=F16)(jnp.tanh(x))


@jax.jit
def _linen_step(state: train_state.TrainState, x, y, poison) -> tuple[Any, jax.Array]:
  """One fp16 step; ``poison`` puts an inf in one gradient, as an overflow would."""

  def loss_fn(params):
    pred = state.apply_fn({"params": params}, x)
    loss = jnp.mean((pred.astype(F32) - y) ** 2)
    return mpx.scale_loss(loss, state.opt_state), loss

  grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
  grads["Dense_1"]["kernel"] = jnp.where(
    poison, grads["Dense_1"]["kernel"].at[0, 0].set(jnp.inf), grads["Dense_1"]["kernel"]
  )
  return state.apply_gradients(grads=grads), loss


def test_linen_train_state_fp16_with_loss_scale():
  x, y = _regression_data(0)
  model = _LinenMLP()
  params = model.init(jax.random.key(0), x.astype(F16))["params"]
  assert _dtypes(params) == {np.dtype(F16)}
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-2)), init_scale=2.0**12),
  )

  losses = []
  for _ in range(40):
    state, loss = _linen_step(state, x, y, False)
    losses.append(float(loss))
  assert losses[-1] < 0.2 * losses[0], losses
  assert _dtypes(state.params) == {np.dtype(F16)}
  masters = mpx.master_params(state.opt_state, state.params)
  assert _dtypes(masters) == {np.dtype(F32)}
  _assert_bitwise(state.params, mpx.cast_tree(masters, F16))
  assert _has_bits_beyond(masters, F16)
  assert int(state.opt_state.skipped_steps) == 0
  scale = float(state.opt_state.loss_scale)

  skipped, _ = _linen_step(state, x, y, True)
  _assert_bitwise(skipped.params, state.params)
  _assert_bitwise(mpx.master_params(skipped.opt_state, skipped.params), masters)
  assert int(skipped.opt_state.skipped_steps) == 1
  assert float(skipped.opt_state.loss_scale) == scale / 2
  assert int(skipped.step) == int(state.step) + 1  # flax counts it; mpx skipped it
  # Training resumes at the smaller scale.
  resumed, loss = _linen_step(skipped, x, y, False)
  assert bool(resumed.opt_state.last_step_finite)
  assert not np.array_equal(
    np.asarray(resumed.params["Dense_1"]["kernel"]), np.asarray(state.params["Dense_1"]["kernel"])
  )
  assert float(loss) < 0.2 * losses[0]


# ----------------------------------------------------------------------------
# nnx + nnx.Optimizer


class _NnxMLP(nnx.Module):
  """Two linear layers whose weights and compute are in ``dtype``."""

  def __init__(self, dtype: Any, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(4, 16, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(16, 1, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jnp.tanh(self.hidden(x.astype(self.hidden.param_dtype))))


def _nnx_masters(optimizer: nnx.Optimizer, model: nnx.Module) -> PyTree:
  """The float32 masters held by ``optimizer``, as a pure tree like the params."""
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  return mpx.master_params(nnx.as_pure(optimizer.opt_state), params), params


@nnx.jit
def _nnx_step(model: nnx.Module, optimizer: nnx.Optimizer, x, y) -> jax.Array:
  """One step; the loss is scaled by the optimizer's loss scale if it has one."""

  def loss_fn(model):
    loss = jnp.mean((model(x).astype(F32) - y) ** 2)
    return mpx.scale_loss(loss, optimizer.opt_state), loss

  grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_optimizer_bf16_with_mixed_precision():
  x, y = _regression_data(1)
  model = _NnxMLP(BF16, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, mpx.mixed_precision(optax.adam(1e-2)), wrt=nnx.Param)
  assert isinstance(optimizer.opt_state, mpx.MixedPrecisionState)

  losses = [float(_nnx_step(model, optimizer, x, y)) for _ in range(40)]
  assert losses[-1] < 0.2 * losses[0], losses
  assert int(optimizer.step[...]) == 40

  masters, params = _nnx_masters(optimizer, model)
  assert _dtypes(params) == {np.dtype(BF16)}
  assert _dtypes(masters) == {np.dtype(F32)}
  assert jax.tree.structure(masters) == jax.tree.structure(params)
  # The bf16 model is the rounding of the masters, which keep the extra bits.
  _assert_bitwise(params, mpx.cast_tree(masters, BF16))
  assert _has_bits_beyond(masters, BF16)
  # Adam's moments are built on the masters, so they are float32 too.
  adam_state = nnx.as_pure(optimizer.opt_state).inner_state[0]
  assert isinstance(adam_state, optax.ScaleByAdamState)
  assert _dtypes((adam_state.mu, adam_state.nu)) == {np.dtype(F32)}


def test_nnx_optimizer_fp16_with_loss_scale_skips_overflow():
  x, y = _regression_data(2)
  model = _NnxMLP(F16, nnx.Rngs(1))
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-2)), init_scale=2.0**12)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  losses = [float(_nnx_step(model, optimizer, x, y)) for _ in range(30)]
  assert losses[-1] < 0.3 * losses[0], losses
  assert int(optimizer.opt_state.skipped_steps[...]) == 0
  masters, params = _nnx_masters(optimizer, model)
  assert _dtypes(params) == {np.dtype(F16)}
  assert _dtypes(masters) == {np.dtype(F32)}

  # One inf target overflows the loss and every gradient: the step is skipped.
  bad_y = y.at[0, 0].set(jnp.inf)
  _nnx_step(model, optimizer, x, bad_y)
  skipped_masters, skipped_params = _nnx_masters(optimizer, model)
  _assert_bitwise(skipped_params, params)
  _assert_bitwise(skipped_masters, masters)
  assert int(optimizer.opt_state.skipped_steps[...]) == 1
  assert float(mpx.get_loss_scale(optimizer.opt_state)) == 2.0**11
