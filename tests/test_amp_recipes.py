"""PyTorch's "Automatic Mixed Precision examples" page, recipe by recipe, in mpx.

Every test runs the mpx form of one recipe (see docs/recipes.md) and checks it
against an independent reference: plain optax in float32 on the unscaled
problem, or a value computed by hand. Nothing is compared with mpx's own
output.

Most tests use a *probe* loss, ``sum(x * params)``, whose gradient is ``x``
whatever the parameters. With ``x`` on a grid of multiples of 1/64 in [-1, 1],
the scaled fp16 (or bf16) gradient ``S * x`` is exact for every power-of-two
scale ``S <= 2**15`` and so is its unscaling, so mpx's inner rule and the
float32 reference see bit-identical gradients and the masters must agree to
the last bit or two (see ``_assert_matches_fp32``). Tests whose gradients
depend on the weights use a tolerance justified where it is set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx._src import compat

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
PyTree = Any


# ----------------------------------------------------------------------------
# Helpers


def _grid(rng: np.random.Generator, shape: Sequence[int], nonzero: bool = False) -> np.ndarray:
  """Float32 values ``k / 64`` with ``k`` in [-64, 64]: exact in fp16 and bf16.

  Args:
    rng: numpy generator.
    shape: shape of the result.
    nonzero: draw ``k`` from [1, 64] with a random sign instead, so no entry is 0.

  Returns:
    A float32 numpy array.
  """
  if nonzero:
    k = rng.integers(1, 65, size=shape) * rng.choice([-1, 1], size=shape)
  else:
    k = rng.integers(-64, 65, size=shape)
  return (k / 64.0).astype(np.float32)


def _probe_loss(params: PyTree, xs: PyTree) -> jax.Array:
  """``sum(x * p)`` over all leaves, in float32: its gradient is ``xs`` exactly."""
  terms = jax.tree.map(lambda p, x: jnp.sum(x * p.astype(F32)), params, xs)
  return sum(jax.tree.leaves(terms))


def _fp32_run(tx: optax.GradientTransformation, params: PyTree, grads_seq: list) -> PyTree:
  """Plain optax in float32: the reference for unscaled, exact gradients."""
  step = jax.jit(_apply(tx))
  state = tx.init(params)
  for grads in grads_seq:
    params, state = step(grads, state, params)
  return params


def _fp32_train(
  tx: optax.GradientTransformation, params: PyTree, loss_fn: Callable[..., jax.Array], batches
) -> PyTree:
  """Plain optax in float32 on the unscaled loss, one step per batch."""
  apply = _apply(tx)
  step = jax.jit(lambda p, s, *batch: apply(jax.grad(loss_fn)(p, *batch), s, p))
  state = tx.init(params)
  for batch in batches:
    params, state = step(params, state, *batch)
  return params


def _apply(tx: optax.GradientTransformation) -> Callable[..., tuple[PyTree, optax.OptState]]:
  """``(grads, state, params) -> (new_params, new_state)`` for ``tx``."""

  def apply(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return apply


def _make_step(
  tx: optax.GradientTransformation, loss_fn: Callable[..., jax.Array]
) -> Callable[..., tuple[PyTree, optax.OptState]]:
  """A jitted mpx step: grads of the *scaled* loss, then ``tx.update``."""

  @jax.jit
  def step(params, opt_state, *batch):
    grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, *batch), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def _assert_bitwise(actual: PyTree, expected: PyTree) -> None:
  """Same structure, dtypes and bits at every leaf."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.dtype == e.dtype, (a.dtype, e.dtype)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _assert_matches_fp32(actual: PyTree, expected: PyTree, maxulp: int = 4) -> None:
  """Float32 trees equal up to a few ulps, i.e. as good as bitwise.

  mpx's step and the reference are separate XLA programs, which may fuse the
  rule's arithmetic differently (one contracts ``a * b + c`` into an FMA, the
  other does not), so a last-bit difference now and then is legitimate. Any
  real mistake (a gradient rounded to fp16, a missing or double unscale, a
  skipped step) is at least 2**-11 relative, thousands of ulps.
  """
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.dtype == e.dtype == F32, (a.dtype, e.dtype)
    np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(e), maxulp=maxulp)


def _dtypes(tree: PyTree) -> set:
  return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


def _dtype_spy(seen: list) -> optax.GradientTransformation:
  """Identity transformation that records the dtypes of the updates it is given."""

  def update_fn(updates, state, params=None):
    del params
    seen.extend(np.dtype(u.dtype) for u in jax.tree.leaves(updates))
    return updates, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _find(tree: PyTree, state_type: type) -> list:
  """Every ``state_type`` node in an optimizer state, at any depth."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, state_type))
  return [x for x in leaves if isinstance(x, state_type)]


# ----------------------------------------------------------------------------
# Typical use: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()


# Adam is blind to a constant factor on the gradients (up to eps), so a
# missing or doubled unscale only shows with SGD; both are checked.
@pytest.mark.parametrize("make_rule", [optax.adam, optax.sgd], ids=["adam", "sgd"])
def test_typical_use_masters_match_fp32(make_rule: Callable[[float], Any]):
  rng = np.random.default_rng(0)
  init = {"w": _grid(rng, (4, 3)), "b": _grid(rng, (3,))}
  xs = [jax.tree.map(lambda p: _grid(rng, p.shape), init) for _ in range(6)]

  tx = mpx.loss_scale(mpx.mixed_precision(make_rule(1e-2)))
  params = mpx.cast_tree(jax.tree.map(jnp.asarray, init), F16)
  opt_state = tx.init(params)
  step = _make_step(tx, _probe_loss)
  for x in xs:
    params, opt_state = step(params, opt_state, x)

  expected = _fp32_run(make_rule(1e-2), jax.tree.map(jnp.asarray, init), xs)
  masters = mpx.master_params(opt_state, params)
  _assert_matches_fp32(masters, expected)
  # The fp16 model is the rounding of the masters, and stays fp16.
  _assert_bitwise(params, mpx.cast_tree(masters, F16))
  assert float(mpx.get_loss_scale(opt_state)) == 2.0**15
  assert int(opt_state.skipped_steps) == 0
  # Six steps of up to 1e-2 each: the comparison is not between no-ops.
  moved = jax.tree.map(lambda m, p: np.abs(np.asarray(m) - p).mean(), masters, init)
  assert min(jax.tree.leaves(moved)) > 2e-3


def test_typical_use_rescues_gradients_below_fp16_range():
  # What loss scaling is for: true gradients k * 2**-26 lie below fp16's
  # smallest subnormal (2**-24), so plain fp16 backprop rounds them to
  # multiples of 2**-24 (mostly 0). Scaled by 2**15 they are exact fp16
  # normals; unscaled in float32 they are exact again, and SGD with lr 1 from
  # zero puts minus their sum in the masters, bit for bit.
  rng = np.random.default_rng(8)
  xs = [{"w": _grid(rng, (16,), nonzero=True) * np.float32(2.0**-20)} for _ in range(3)]
  params = {"w": jnp.zeros(16, F16)}
  plain_fp16 = jax.grad(_probe_loss)(params, xs[0])["w"]
  assert plain_fp16.dtype == F16
  assert not np.array_equal(np.asarray(plain_fp16, np.float32), xs[0]["w"])

  tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(1.0)))
  opt_state = tx.init(params)
  step = _make_step(tx, _probe_loss)
  for x in xs:
    params, opt_state = step(params, opt_state, x)
  expected = -(xs[0]["w"] + xs[1]["w"] + xs[2]["w"])  # exact: multiples of 2**-26
  masters = mpx.master_params(opt_state, params)
  np.testing.assert_array_equal(np.asarray(masters["w"]), expected)
  assert int(opt_state.skipped_steps) == 0


def _mse(params: PyTree, x: jax.Array, y: jax.Array) -> jax.Array:
  """Linear regression in the params' dtype (fp16 forward), loss in float32."""
  pred = x.astype(params["w"].dtype) @ params["w"] + params["b"]
  return jnp.mean((pred.astype(F32) - y) ** 2)


def test_typical_use_fp16_regression_tracks_fp32_adam():
  rng = np.random.default_rng(1)
  w_true = rng.normal(size=(8, 2)).astype(np.float32)
  batches = []
  for _ in range(10):
    x = rng.normal(size=(16, 8)).astype(np.float32)
    batches.append((x, x @ w_true + 0.5))
  init = {"w": np.zeros((8, 2), np.float32), "b": np.zeros(2, np.float32)}

  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-2)), init_scale=2.0**10)
  params = mpx.cast_tree(jax.tree.map(jnp.asarray, init), F16)
  opt_state = tx.init(params)
  step = _make_step(tx, _mse)
  for x, y in batches:
    params, opt_state = step(params, opt_state, x, y)

  ref = _fp32_train(optax.adam(1e-2), jax.tree.map(jnp.asarray, init), _mse, batches)

  assert _dtypes(params) == {np.dtype(F16)}
  masters = mpx.master_params(opt_state, params)
  assert _dtypes(masters) == {np.dtype(F32)}
  assert int(opt_state.skipped_steps) == 0
  # The fp16 forward rounds inputs, weights and products to 11 bits, so each
  # gradient differs from fp32's by a relative ~1e-3. Adam's normalised step
  # lr * m / sqrt(v) moves by about as much: ~10 * 1e-2 * 1e-3 = 1e-4 over ten
  # steps (measured: 1.5e-5). 3e-4 keeps a margin, while the weights moved by
  # ~0.08 on average (an fp32 Adam on the unscaled loss would miss by far more
  # if the gradients were not unscaled, or were rounded to a coarser grid).
  for m, r in zip(jax.tree.leaves(masters), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(np.asarray(m), np.asarray(r), rtol=0, atol=3e-4)
    assert np.abs(np.asarray(r)).mean() > 0.05


# ----------------------------------------------------------------------------
# Gradient clipping: scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)

# Gradients of the probe loss over three steps: true norms 1.018, 0.57 and
# 1.046, so a threshold of 1 clips the first and the last only, and barely.
_CLIP_GRADS = [
  np.array([0.75, 0.6875, 0.0], np.float32),
  np.array([0.25, -0.5, 0.125], np.float32),
  np.array([-0.75, 0.625, 0.375], np.float32),
]


@pytest.mark.parametrize("make_rule", [optax.sgd, optax.adam], ids=["sgd", "adam"])
def test_clipping_sees_unscaled_fp32_grads(make_rule: Callable[[float], Any]):
  max_norm, scale = 1.0, 2.0**10
  assert np.linalg.norm(_CLIP_GRADS[0]) > max_norm  # "just above c"
  seen: list = []
  tx = mpx.loss_scale(
    mpx.mixed_precision(
      optax.chain(_dtype_spy(seen), optax.clip_by_global_norm(max_norm), make_rule(0.1))
    ),
    init_scale=scale,
  )
  init = np.array([0.5, -0.25, 1.0], np.float32)
  params = {"w": jnp.asarray(init, F16)}
  opt_state = tx.init(params)
  step = _make_step(tx, _probe_loss)
  for g in _CLIP_GRADS:
    params, opt_state = step(params, opt_state, {"w": g})
  masters = mpx.master_params(opt_state, params)

  def fp32_run(threshold: float) -> np.ndarray:
    rule = optax.chain(optax.clip_by_global_norm(threshold), make_rule(0.1))
    grads = [{"w": jnp.asarray(g)} for g in _CLIP_GRADS]
    return np.asarray(_fp32_run(rule, {"w": jnp.asarray(init)}, grads)["w"])

  right = fp32_run(max_norm)
  # Clipping the scaled gradients to max_norm and unscaling afterwards equals
  # clipping the true ones to max_norm / scale: what PyTorch's page warns of.
  wrong = fp32_run(max_norm / scale)
  assert seen and set(seen) == {np.dtype(F32)}
  _assert_matches_fp32(masters["w"], jnp.asarray(right))
  assert np.abs(right - wrong).max() > 1e-2  # the check can tell them apart
  assert float(mpx.get_loss_scale(opt_state)) == scale


# ----------------------------------------------------------------------------
# Gradient penalty: grads of scaler.scale(loss), unscaled by hand, penalised


def _tanh_net_loss(params: PyTree, x: jax.Array, y: jax.Array) -> jax.Array:
  """Small tanh network, computed in float32 from (possibly fp16) weights."""
  p = jax.tree.map(lambda a: a.astype(F32), params)
  hidden = jnp.tanh(x @ p["w1"])
  return jnp.mean((hidden @ p["w2"] - y) ** 2)


def test_gradient_penalty_with_unscale_matches_fp32():
  rng = np.random.default_rng(2)
  init = {"w1": _grid(rng, (3, 4), nonzero=True), "w2": _grid(rng, (4, 1), nonzero=True)}
  batches = [(_grid(rng, (8, 3)), _grid(rng, (8, 1))) for _ in range(3)]
  lr = 0.05

  def penalised(loss_fn, params, x, y, opt_state=None):
    """loss + ||d loss / d params||; with ``opt_state`` it is the scaled recipe."""
    if opt_state is None:  # The fp32 reference: no scaling at all.
      grads = jax.grad(loss_fn)(params, x, y)
      return loss_fn(params, x, y) + optax.tree.norm(grads)
    scaled = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x, y), opt_state))(params)
    grads = mpx.unscale(scaled, opt_state)  # float32, divided by the scale
    return mpx.scale_loss(loss_fn(params, x, y) + optax.tree.norm(grads), opt_state)

  tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(lr)), init_scale=2.0**10)
  params = mpx.cast_tree(jax.tree.map(jnp.asarray, init), F16)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: penalised(_tanh_net_loss, p, x, y, opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for x, y in batches:
    params, opt_state = step(params, opt_state, x, y)
  masters = mpx.master_params(opt_state, params)

  as_f32 = jax.tree.map(jnp.asarray, init)
  penalised_fp32 = lambda p, x, y: penalised(_tanh_net_loss, p, x, y)  # noqa: E731
  ref = _fp32_train(optax.sgd(lr), as_f32, penalised_fp32, batches)
  unpenalised = _fp32_train(optax.sgd(lr), as_f32, _tanh_net_loss, batches)
  assert int(opt_state.skipped_steps) == 0
  for name in init:
    step_mpx = np.asarray(masters[name]) - init[name]
    step_ref = np.asarray(ref[name]) - init[name]
    step_plain = np.asarray(unpenalised[name]) - init[name]
    # mpx's gradients pass through fp16 (the scaled cotangents, in both the
    # inner and the outer backward pass, and the fp16 weights of steps 2-3),
    # each a relative rounding of 2**-11 ~ 5e-4. A few such roundings per
    # entry stay well inside 2e-3 of the total update (measured: <= 2.5e-4).
    # The penalty itself moves the weights by far more than that.
    tol = 2e-3 * np.abs(step_ref).max()
    np.testing.assert_allclose(step_mpx, step_ref, rtol=0, atol=tol)
    assert np.abs(step_ref - step_plain).max() > 20 * tol


# ----------------------------------------------------------------------------
# Several losses and models: one scaler, one update, one skip decision


def _two_model_losses(params: PyTree, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """PyTorch's example: two models, two losses mixing both outputs."""
  out0 = x @ params["model0"].astype(F32)
  out1 = x @ params["model1"].astype(F32)
  loss0 = jnp.mean((2 * out0 + 3 * out1 - y) ** 2)
  loss1 = jnp.mean((3 * out0 - 5 * out1 - y) ** 2)
  return loss0, loss1


@pytest.mark.parametrize("scale_each", [True, False], ids=["scale_each", "scale_sum"])
def test_several_losses_and_models_track_fp32(scale_each: bool):
  rng = np.random.default_rng(3)
  init = {"model0": _grid(rng, (3, 2)), "model1": _grid(rng, (3, 2))}
  batches = [(_grid(rng, (8, 3)), _grid(rng, (8, 2))) for _ in range(5)]

  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-2)), init_scale=2.0**10)
  params = mpx.cast_tree(jax.tree.map(jnp.asarray, init), F16)
  opt_state = tx.init(params)

  def scaled_total(p, x, y, opt_state):
    loss0, loss1 = _two_model_losses(p, x, y)
    if scale_each:  # scaler.scale(loss0).backward(); scaler.scale(loss1).backward()
      return mpx.scale_loss(loss0, opt_state) + mpx.scale_loss(loss1, opt_state)
    return mpx.scale_loss(loss0 + loss1, opt_state)

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(scaled_total)(params, x, y, opt_state)  # one backward pass
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for x, y in batches:
    params, opt_state = step(params, opt_state, x, y)

  ref = _fp32_train(
    optax.adam(1e-2),
    jax.tree.map(jnp.asarray, init),
    lambda p, x, y: sum(_two_model_losses(p, x, y)),  # loss0 + loss1, unscaled
    batches,
  )

  masters = mpx.master_params(opt_state, params)
  assert int(opt_state.skipped_steps) == 0
  # Forward and loss run in float32; mpx differs from the reference only by
  # the fp16 rounding of the scaled gradients (relative 2**-11) and of the
  # weights after each step. Adam's steps of ~lr = 1e-2 then differ by a
  # relative ~1e-3, i.e. ~1e-5 each, ~5e-5 over 5 steps (measured: 7e-6), so
  # 1e-4 has margin, while every weight moved by about 5 * lr.
  for name in init:
    np.testing.assert_allclose(np.asarray(masters[name]), np.asarray(ref[name]), atol=1e-4)
    assert np.abs(np.asarray(ref[name]) - init[name]).max() > 2e-2


def test_inf_in_one_model_skips_the_step_for_both():
  rng = np.random.default_rng(4)
  params = mpx.cast_tree({"model0": _grid(rng, (3, 2)), "model1": _grid(rng, (3, 2))}, F16)
  params = jax.tree.map(jnp.asarray, params)
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-2)), init_scale=2.0**10)
  opt_state = tx.init(params)
  x, y = _grid(rng, (8, 3)), _grid(rng, (8, 2))

  @jax.jit
  def step(params, opt_state, poison_model1):
    grads = jax.grad(lambda p: mpx.scale_loss(sum(_two_model_losses(p, x, y)), opt_state))(params)
    # An overflow in model1's backward pass only; model0's grads are finite.
    bad = grads["model1"].at[0, 0].set(jnp.inf)
    grads["model1"] = jnp.where(poison_model1, bad, grads["model1"])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = step(params, opt_state, False)  # one ordinary step first
  before_params, before_state = params, opt_state
  params, opt_state = step(params, opt_state, True)

  _assert_bitwise(params, before_params)  # model0 did not step either
  _assert_bitwise(
    mpx.master_params(opt_state, params), mpx.master_params(before_state, before_params)
  )
  (adam_state,) = _find(opt_state, optax.ScaleByAdamState)
  (adam_before,) = _find(before_state, optax.ScaleByAdamState)
  _assert_bitwise(adam_state, adam_before)  # count, mu, nu untouched
  assert int(opt_state.skipped_steps) == 1
  assert not bool(opt_state.last_step_finite)
  assert float(opt_state.loss_scale) == 2.0**9
  # The next finite step applies to both models again.
  params, opt_state = step(params, opt_state, False)
  for name in params:
    assert not np.array_equal(np.asarray(params[name]), np.asarray(before_params[name]))


def test_one_scaled_loss_needs_one_loss_scale():
  # PyTorch lets each optimizer skip on its own; in mpx the models share one
  # loss_scale, and a state with two is refused by scale_loss.
  params = {"model0": jnp.zeros(2, F16), "model1": jnp.zeros(2, F16)}
  labels = {"model0": "m0", "model1": "m1"}
  per_model = {k: mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3))) for k in ("m0", "m1")}
  opt_state = optax.partition(per_model, labels).init(params)
  with pytest.raises(ValueError, match="2 LossScaleStates"):
    mpx.scale_loss(jnp.float32(1.0), opt_state)


# ----------------------------------------------------------------------------
# Several parameter groups, one loss scale


def _groups() -> tuple[dict, dict]:
  rng = np.random.default_rng(5)
  init = {
    "encoder": {"w": _grid(rng, (3, 4)), "b": _grid(rng, (4,))},
    "head": {"w": _grid(rng, (4, 2)), "b": _grid(rng, (2,))},
  }
  labels = {"encoder": {"w": "a", "b": "a"}, "head": {"w": "b", "b": "b"}}
  return init, labels


@pytest.mark.parametrize("layout", ["mixed_precision_outside", "mixed_precision_per_group"])
def test_parameter_groups_follow_their_own_fp32_rules(layout: str):
  init, labels = _groups()
  rules = {"a": optax.adam(1e-3), "b": optax.sgd(1e-2)}
  if layout == "mixed_precision_outside":
    tx = mpx.loss_scale(mpx.mixed_precision(optax.partition(rules, labels)))
  else:
    tx = mpx.loss_scale(
      optax.partition({k: mpx.mixed_precision(r) for k, r in rules.items()}, labels)
    )
  rng = np.random.default_rng(6)
  xs = [jax.tree.map(lambda p: _grid(rng, p.shape), init) for _ in range(4)]

  params = mpx.cast_tree(jax.tree.map(jnp.asarray, init), F16)
  opt_state = tx.init(params)
  step = _make_step(tx, _probe_loss)
  for x in xs:
    params, opt_state = step(params, opt_state, x)

  assert mpx.get_loss_scale(opt_state).dtype == F32
  assert float(mpx.get_loss_scale(opt_state)) == 2.0**15
  assert _dtypes(params) == {np.dtype(F16)}
  masters = mpx.master_params(opt_state, params)
  # Each group against its own plain fp32 rule, run on that group alone.
  as_f32 = lambda t: jax.tree.map(jnp.asarray, t)  # noqa: E731
  adam_ref = _fp32_run(optax.adam(1e-3), as_f32(init["encoder"]), [x["encoder"] for x in xs])
  sgd_ref = _fp32_run(optax.sgd(1e-2), as_f32(init["head"]), [x["head"] for x in xs])
  _assert_matches_fp32(masters, {"encoder": adam_ref, "head": sgd_ref})
  # Swapped rules would land elsewhere, so the groups were really told apart.
  swapped = _fp32_run(optax.sgd(1e-2), as_f32(init["encoder"]), [x["encoder"] for x in xs])
  assert np.abs(np.asarray(swapped["w"]) - np.asarray(adam_ref["w"])).max() > 1e-3


# ----------------------------------------------------------------------------
# Gradient accumulation with optax.MultiSteps

_K = 4  # micro-steps per optimizer step


def _accumulators(opt_state: optax.OptState) -> PyTree:
  (multi,) = _find(opt_state, optax.MultiStepsState)
  return multi.acc_grads


@pytest.mark.parametrize(
  ("layout", "param_dtype"),
  [
    ("loss_scale(MultiSteps(mixed_precision(adam)))", F16),
    ("loss_scale(mixed_precision(MultiSteps(adam)))", F16),
    ("mixed_precision(MultiSteps(adam))", BF16),
  ],
)
def test_accumulation_in_fp32_matches_fp32_multisteps(layout: str, param_dtype):
  # The scale doubles after every micro-step (growth_interval=1): each
  # micro-gradient is unscaled before it is accumulated, so a scale that
  # changes within an accumulation window does no harm.
  ls = lambda inner: mpx.loss_scale(inner, init_scale=2.0**8, growth_interval=1)  # noqa: E731
  adam = optax.adam(1e-2)
  tx = {
    "loss_scale(MultiSteps(mixed_precision(adam)))": lambda: ls(
      optax.MultiSteps(mpx.mixed_precision(adam), every_k_schedule=_K)
    ),
    "loss_scale(mixed_precision(MultiSteps(adam)))": lambda: ls(
      mpx.mixed_precision(optax.MultiSteps(adam, _K))
    ),
    "mixed_precision(MultiSteps(adam))": lambda: mpx.mixed_precision(optax.MultiSteps(adam, _K)),
  }[layout]()
  rng = np.random.default_rng(7)
  init = {"w": _grid(rng, (5,)), "b": _grid(rng, (2,))}
  xs = [jax.tree.map(lambda p: _grid(rng, p.shape), init) for _ in range(2 * _K)]

  params = mpx.cast_tree(jax.tree.map(jnp.asarray, init), param_dtype)
  opt_state = tx.init(params)
  step = _make_step(tx, _probe_loss)
  ref_tx = optax.MultiSteps(optax.adam(1e-2), _K)
  ref_step = jax.jit(_apply(ref_tx))
  ref = jax.tree.map(jnp.asarray, init)
  ref_state = ref_tx.init(ref)
  for i, x in enumerate(xs):
    previous = params
    params, opt_state = step(params, opt_state, x)
    ref, ref_state = ref_step(x, ref_state, ref)

    assert _dtypes(_accumulators(opt_state)) == {np.dtype(F32)}
    assert _dtypes(params) == {np.dtype(param_dtype)}
    _assert_matches_fp32(mpx.master_params(opt_state, params), ref)
    if (i + 1) % _K:  # between optimizer steps the model does not move
      _assert_bitwise(params, previous)
  if layout.startswith("loss_scale"):
    assert float(mpx.get_loss_scale(opt_state)) == 2.0 ** (8 + 2 * _K)
  assert np.abs(np.asarray(ref["w"]) - init["w"]).min() > 1e-2  # two Adam steps


def test_overflowing_micro_batch_is_dropped_from_the_window():
  # loss_scale outside MultiSteps judges every micro-batch: one that overflows
  # is skipped like any step (the MultiSteps state, mini_step included, stays
  # as it was), so the window closes one micro-batch later on finite ones.
  tx = mpx.loss_scale(optax.MultiSteps(mpx.mixed_precision(optax.sgd(1.0)), 2))
  step = jax.jit(_apply(tx))
  params = {"w": jnp.zeros(3, F16)}
  opt_state = tx.init(params)
  g1, g2 = np.array([0.5, -0.25, 1.0], np.float32), np.array([0.25, 0.75, -0.5], np.float32)
  micro = [g1, np.array([np.inf, 0.0, 0.0], np.float32), g2]
  for i, g in enumerate(micro):
    scaled = jnp.asarray(g * float(mpx.get_loss_scale(opt_state)), F16)
    params, opt_state = step({"w": scaled}, opt_state, params)
    (multi,) = _find(opt_state, optax.MultiStepsState)
    assert int(multi.mini_step) == [1, 1, 0][i]
  assert int(opt_state.skipped_steps) == 1
  assert float(opt_state.loss_scale) == 2.0**14
  masters = mpx.master_params(opt_state, params)
  np.testing.assert_array_equal(np.asarray(masters["w"]), -(g1 + g2) / 2)  # exact


def test_multisteps_outside_mixed_precision_rounds_the_mean():
  # MultiSteps outside mixed_precision gets bf16 gradients. This optax keeps
  # the accumulator in float32 by default, but hands the mean to the inner
  # rule cast back to the gradients' dtype, so the masters see a bf16 mean;
  # with accumulator_dtype=bf16 (older optax's behaviour: accumulate in the
  # params' dtype) the sum itself is rounded. mixed_precision outside casts
  # each micro-gradient to float32 before MultiSteps sees it.
  micro = [1.0, 2.0**-8, 0.0]  # the mean 257/768 is not a bf16 number
  exact = np.float32(1.0) - (np.float32(1.0) + np.float32(2.0**-8)) / np.float32(3.0)
  rounded = np.float32(1.0) - np.float32(jnp.asarray(257 / 768, BF16))
  assert exact != rounded

  def run(tx: optax.GradientTransformation) -> tuple[np.ndarray, PyTree]:
    step = jax.jit(_apply(tx))
    params = {"w": jnp.ones(2, BF16)}
    opt_state = tx.init(params)
    for g in micro:
      params, opt_state = step({"w": jnp.full(2, g, BF16)}, opt_state, params)
    assert params["w"].dtype == BF16
    return np.asarray(mpx.master_params(opt_state, params)["w"]), _accumulators(opt_state)

  sgd = optax.sgd(1.0)  # the master moves by exactly minus the mean it is given
  masters, acc = run(mpx.mixed_precision(optax.MultiSteps(sgd, 3)))
  assert _dtypes(acc) == {np.dtype(F32)}
  if compat.jax_at_least("0.10.2"):
    np.testing.assert_array_equal(masters, exact)
  else:  # XLA:CPU of jax 0.7.2 and before divides by 3 as a multiply by 1/3
    np.testing.assert_allclose(masters, exact, rtol=2**-23, atol=0)
    assert not np.array_equal(masters, np.full(2, rounded))

  masters, acc = run(optax.MultiSteps(mpx.mixed_precision(sgd), 3))
  assert _dtypes(acc) == {np.dtype(F32)}
  np.testing.assert_array_equal(masters, rounded)

  masters, acc = run(optax.MultiSteps(mpx.mixed_precision(sgd), 3, accumulator_dtype=BF16))
  assert _dtypes(acc) == {np.dtype(BF16)}
  assert not np.array_equal(masters, np.full(2, exact))
