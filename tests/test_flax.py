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
import jax_versions
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import mpx
from mpx._src import compat

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


@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "mpx inside nnx.Optimizer")
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


@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "mpx inside nnx.Optimizer")
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


# ----------------------------------------------------------------------------
# linen fp8 layers: scales and amax histories in `_overwrite_with_gradient`

FP8 = "_overwrite_with_gradient"


class _Fp8TrainState(train_state.TrainState):
  """The docs' recipe (docs/howto.md, "Train flax fp8 layers"): the fp8
  metadata takes its new values only on a step mpx applied."""

  def apply_gradients(self, *, grads, **kwargs):
    updates, opt_state = self.tx.update(grads["params"], self.opt_state, self.params["params"])
    params = optax.apply_updates(self.params["params"], updates)
    if isinstance(opt_state, mpx.LossScaleState):
      applied = opt_state.last_step_finite & mpx.all_finite(grads[FP8])
    else:  # mixed_precision skips a step iff some gradient is not finite
      applied = mpx.all_finite(grads)
    metadata = mpx.select_tree(applied, grads[FP8], self.params[FP8])
    new_params = {"params": params, FP8: metadata}
    return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state, **kwargs)


class _Fp8MLP(nn.Module):
  dtype: Any = BF16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dense = lambda n: nn.Dense(  # noqa: E731
      n, dtype=self.dtype, param_dtype=self.dtype, dot_general_cls=nn.Fp8DirectDotGeneralOp
    )
    return dense(1)(jnp.tanh(dense(16)(x)))


@jax.jit
def _fp8_step(state: _Fp8TrainState, x, y, poison) -> tuple[Any, Any]:
  def loss_fn(variables):
    pred = state.apply_fn(variables, x).astype(F32)
    loss = jnp.mean((pred - y) ** 2) * jnp.where(poison, jnp.inf, 1.0)
    if isinstance(state.opt_state, mpx.LossScaleState):
      return mpx.scale_loss(loss, state.opt_state), loss
    return loss, loss

  grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), (loss, grads)


# flax's fp8 layers compute NaN with float16 compute even under plain optax
# (their kernel amax overflows), so bfloat16 it is, with and without scaling.
# On the floors: under loss_scale (the metadata beside scaled gradients, and a scale
# that backs off on the skipped step); -m slow adds mixed_precision alone.
@pytest.mark.parametrize(
  "scaled",
  [
    pytest.param(False, marks=pytest.mark.slow, id="mixed_precision"),
    pytest.param(True, id="loss_scale"),
  ],
)
@pytest.mark.slow
@pytest.mark.floors
def test_linen_fp8_recipe_overwrites_metadata_only_on_applied_steps(scaled):
  dtype = BF16
  tx = mpx.mixed_precision(optax.adam(1e-2))
  if scaled:
    tx = mpx.loss_scale(tx, init_scale=2.0**10)
  x, y = _regression_data(1)
  model = _Fp8MLP(dtype)
  variables = model.init(jax.random.key(0), x)
  state = _Fp8TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
  # The optimizer knows nothing of the metadata: no master, no moment.
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]
  assert any("kernel" in p for p in paths)
  assert not any("Fp8" in p or "amax" in p for p in paths), paths

  losses, applied = [], 0
  for _ in range(30):
    before = state
    state, (loss, grads) = _fp8_step(state, x, y, False)
    losses.append(float(loss))
    if not scaled or bool(state.opt_state.last_step_finite):
      applied += 1
      # Taken verbatim: not unscaled, not stepped on, not rounded.
      _assert_bitwise(state.params[FP8], grads[FP8])
    else:  # an overflow of the scaled gradients: skipped, metadata kept
      _assert_bitwise(state.params, before.params)
  assert losses[-1] < 0.5 * losses[0], losses
  assert applied >= 25
  history = state.params[FP8]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
  assert np.count_nonzero(np.asarray(history)) == applied  # one amax per applied step
  masters = mpx.master_params(state.opt_state, state.params["params"])
  _assert_bitwise(state.params["params"], mpx.cast_tree(masters, dtype))

  before = state
  state, (loss, grads) = _fp8_step(state, x, y, True)
  assert not np.isfinite(float(loss))
  _assert_bitwise(state.params, before.params)  # metadata included
  _assert_bitwise(
    mpx.master_params(state.opt_state, state.params["params"]),
    mpx.master_params(before.opt_state, before.params["params"]),
  )
  if scaled:
    assert float(state.opt_state.loss_scale) == float(before.opt_state.loss_scale) / 2
  state, (loss, _) = _fp8_step(state, x, y, False)
  assert np.isfinite(float(loss)) and float(loss) < 0.5 * losses[0]


@pytest.mark.parametrize("wrap", ["mixed_precision", "loss_scale"])
def test_fp8_metadata_given_to_the_optimizer_is_refused(wrap):
  x, _ = _regression_data(1)
  variables = _Fp8MLP().init(jax.random.key(0), x)
  tx = mpx.mixed_precision(optax.adam(1e-2))
  if wrap == "loss_scale":
    tx = mpx.loss_scale(optax.adam(1e-2))
  with pytest.raises(ValueError, match=r"_overwrite_with_gradient.*docs/howto.md"):
    tx.init(variables)


@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "nnx Variables as pytree nodes")
@pytest.mark.parametrize("moments", ["full", "bfloat16", "8bit", "4bit"])
def test_an_nnx_state_of_variables_steps_as_its_pure_dict(moments):
  # nnx.state(model, nnx.Param) holds Variables, which init fits to each state
  # leaf (a compressed moment becomes a NamedTuple of Variables); the step
  # runs on what they hold and gives back updates and state in Variables.
  model = _NnxMLP(BF16, nnx.Rngs(0))
  variables = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(variables)
  tx = mpx.mixed_precision(optax.adamw(1e-2), masters="24bit", moments=moments)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.25), variables)
  state = tx.init(variables)
  updates, new_state = jax.jit(tx.update)(grads, state, variables)
  pure_updates, pure_state = jax.jit(tx.update)(nnx.to_pure_dict(grads), tx.init(pure), pure)
  assert jax.tree.structure(updates) == jax.tree.structure(grads)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert all(
    isinstance(x, nnx.Variable)
    for x in jax.tree.leaves(
      new_state.master_corrections, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  )
  _assert_bitwise(nnx.to_pure_dict(updates), pure_updates)
  _assert_bitwise(jax.tree.leaves(new_state), jax.tree.leaves(pure_state))
