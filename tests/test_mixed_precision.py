"""mixed_precision: masters, exactness against float32 optax, skipping, errors."""

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from treecheck import round_like_params, skip_recorded, tree_equal

import mpx
from mpx._src import compat


def random_tree(seed: int, dtype, shapes=((16, 8), (8,), (8, 4))):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {
    f"w{i}": jax.random.normal(k, s).astype(dtype)
    for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
  }


def test_rejects_non_floating_dtype_and_non_transformations():
  with pytest.raises(ValueError, match="dtype must be a floating dtype"):
    mpx.mixed_precision(optax.adam(1e-3), dtype=jnp.int32)
  with pytest.raises(TypeError, match="optax.adam instead of optax.adam"):
    mpx.mixed_precision(optax.adam)
  with pytest.raises(TypeError, match="GradientTransformation"):
    mpx.mixed_precision(None)


@jax_versions.requires_jax(compat.FLOAT8_NEEDS_JAX, "float8 params")
def test_masters_exist_exactly_for_floating_leaves_narrower_than_dtype():
  params = {
    "bf16": jnp.ones(3, jnp.bfloat16),
    "fp16": jnp.ones(3, jnp.float16),
    "fp8": jnp.ones(3, jnp.float8_e4m3fn),
    "fp32": jnp.ones(3, jnp.float32),
    "int": jnp.arange(3),
  }
  masters = mpx.mixed_precision(optax.sgd(0.1)).init(params).master_params
  assert {k for k, v in masters.items() if not isinstance(v, optax.MaskedNode)} == {
    "bf16",
    "fp16",
    "fp8",
  }
  assert all(masters[k].dtype == jnp.float32 for k in ("bf16", "fp16", "fp8"))
  # With bf16 masters, fp16 is as wide as the masters: no copy.
  masters = mpx.mixed_precision(optax.sgd(0.1), dtype=jnp.bfloat16).init(params).master_params
  assert isinstance(masters["fp16"], optax.MaskedNode)
  assert masters["fp8"].dtype == jnp.bfloat16


def test_inner_state_and_injected_hyperparameters_are_float32():
  params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
  inner = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
  # The optax defect mpx fixes: with bf16 params, nu and the lr are bf16.
  plain = inner.init(params)
  assert plain.hyperparams["learning_rate"].dtype == jnp.bfloat16
  state = mpx.mixed_precision(inner).init(params)
  float_leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert float_leaves and all(x.dtype == jnp.float32 for x in float_leaves)
  assert state.inner_state.count.dtype == jnp.int32  # counters are never cast


def test_float64_leaves_are_updated_directly_and_never_downcast():
  with jax_versions.enable_x64():
    params = {"f64": jnp.ones(3, jnp.float64), "bf16": jnp.ones(3, jnp.bfloat16)}
    tx = mpx.mixed_precision(optax.adam(1e-3))
    state = tx.init(params)
    assert isinstance(state.master_params["f64"], optax.MaskedNode)
    assert state.inner_state[0].mu["f64"].dtype == jnp.float64
    grads = {"f64": jnp.full(3, 1e-9, jnp.float64), "bf16": jnp.ones(3, jnp.bfloat16)}
    updates, state = tx.update(grads, state, params)
    reference, _ = optax.adam(1e-3).update(
      {"f64": grads["f64"]}, optax.adam(1e-3).init({"f64": params["f64"]})
    )
    assert updates["f64"].dtype == jnp.float64
    # float64 accuracy (float32 would be off by ~1e-7 relative).
    np.testing.assert_allclose(updates["f64"], reference["f64"], rtol=1e-13)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
def test_masters_follow_float32_optax_bitwise(param_dtype):
  """With the same gradients, the masters are exactly plain float32 AdamW."""
  params = random_tree(0, param_dtype)
  tx = mpx.mixed_precision(optax.adamw(1e-2, weight_decay=0.1))
  reference_tx = optax.adamw(1e-2, weight_decay=0.1)
  reference = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state, reference_state = tx.init(params), reference_tx.init(reference)

  @jax.jit
  def step(params, state, reference, reference_state, grads):
    updates, state = tx.update(grads, state, params)
    ref_updates, reference_state = reference_tx.update(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads), reference_state, reference
    )
    return (
      optax.apply_updates(params, updates),
      state,
      optax.apply_updates(reference, ref_updates),
      reference_state,
    )

  for i in range(20):
    grads = random_tree(100 + i, param_dtype)
    params, state, reference, reference_state = step(
      params, state, reference, reference_state, grads
    )
    assert tree_equal(state.master_params, reference)
    assert tree_equal(state.inner_state, reference_state)
    # The low-precision params are the masters, rounded.
    rounded = jax.tree.map(lambda m: jnp.asarray(round_like_params(m, param_dtype)), reference)
    assert tree_equal(params, rounded)


def test_small_updates_accumulate_where_plain_bf16_loses_them():
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  grads = {"w": jnp.ones(4, jnp.bfloat16)}
  for tx in (optax.sgd(1e-3), mpx.mixed_precision(optax.sgd(1e-3))):
    p, state = params, tx.init(params)
    update = jax.jit(tx.update)  # 100 eager steps would dispatch every operation alone
    for _ in range(100):
      updates, state = update(grads, state, p)
      p = optax.apply_updates(p, updates)
    if isinstance(state, mpx.MixedPrecisionState):
      # 1 - 100 * 1e-3 = 0.9, rounded to bf16.
      assert float(p["w"][0]) == float(jnp.bfloat16(0.9))
    else:
      assert float(p["w"][0]) == 1.0  # every 1e-3 step is below half a bf16 ulp


def test_updates_are_returned_in_master_dtype():
  params = {"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2, jnp.float32)}
  updates, _ = mpx.mixed_precision(optax.adam(1e-3)).update(
    {"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)},
    mpx.mixed_precision(optax.adam(1e-3)).init(params),
    params,
  )
  assert updates["w"].dtype == jnp.float32 and updates["b"].dtype == jnp.float32


def test_large_relative_steps_land_exactly_where_bf16_updates_would_not():
  """Adam's first step moves every weight by lr: relative steps above 1/2 for
  weights near zero. Updates in bf16 would round; float32 updates land exactly."""
  params = {"w": (1e-3 * jax.random.normal(jax.random.key(0), (1000,))).astype(jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.adam(1e-2))
  grads = {"w": jnp.sign(jax.random.normal(jax.random.key(1), (1000,))).astype(jnp.bfloat16)}
  updates, state = tx.update(grads, tx.init(params), params)
  expected = state.master_params["w"].astype(jnp.bfloat16)
  np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], expected)
  bf16_updates = {"w": updates["w"].astype(jnp.bfloat16)}
  assert not np.array_equal(optax.apply_updates(params, bf16_updates)["w"], expected)


def test_fp16_params_saturate_instead_of_overflowing():
  params = {"w": jnp.array([65000.0, -65000.0, 1.0], jnp.float16)}
  tx = mpx.mixed_precision(optax.sgd(1.0))
  grads = {"w": jnp.array([-5000.0, 5000.0, 0.0], jnp.float16)}
  updates, state = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["w"], jnp.array([65504.0, -65504.0, 1.0], jnp.float16))
  start = params["w"].astype(jnp.float32)
  np.testing.assert_array_equal(state.master_params["w"], start - grads["w"].astype(jnp.float32))
  assert float(state.master_params["w"][0]) > 65504  # the master keeps the true value


def test_exponent_gap_corner_is_bounded():
  """The one documented inexact case: a master more than 2**16 times smaller than
  its bf16 param. The param lands within a float32 ulp of its old magnitude."""
  params = {"w": jnp.array([1.0], jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.sgd(1.0))
  target = 2.0**-30
  grads = {"w": jnp.array([1.0 - target], jnp.float32)}
  updates, state = tx.update(grads, tx.init(params), params)
  assert float(state.master_params["w"][0]) == np.float32(1.0) - np.float32(1.0 - target)
  landed = float(optax.apply_updates(params, updates)["w"][0])
  assert abs(landed - float(state.master_params["w"][0])) <= 2.0**-24


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_nonfinite_step_is_skipped_with_state_bitwise_unchanged(bad):
  params = random_tree(1, jnp.bfloat16)
  tx = mpx.mixed_precision(
    optax.chain(optax.adam(1e-2), optax.scale_by_schedule(lambda n: 1.0 / (1 + n)))
  )
  step = jax.jit(tx.update)
  state = tx.init(params)
  for i in range(3):
    updates, state = step(random_tree(10 + i, jnp.bfloat16), state, params)
    params = optax.apply_updates(params, updates)
  poisoned = random_tree(20, jnp.bfloat16)
  poisoned["w1"] = poisoned["w1"].at[2].set(bad)
  updates, skipped_state = step(poisoned, state, params)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  # Bitwise unchanged but for the count of non-finite steps.
  assert skip_recorded(skipped_state, state)
  # The next finite step continues as if the bad step never happened.
  clean = random_tree(21, jnp.bfloat16)
  (after_skip, state_after_skip), (after, state_after) = (
    step(clean, skipped_state, params),
    step(clean, state, params),
  )
  assert tree_equal(after_skip, after) and skip_recorded(state_after_skip, state_after)


def test_update_errors_are_clear():
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.sgd(0.1))
  state = tx.init(params)
  with pytest.raises(ValueError, match="needs the current params"):
    tx.update(params, state)
  with pytest.raises(TypeError, match="not MixedPrecisionState"):
    tx.update(params, optax.sgd(0.1).init(params), params)
  with pytest.raises(ValueError, match="params do not match the optimizer state"):
    tx.update({"v": params["w"]}, state, {"v": params["w"]})
  with pytest.raises(ValueError, match="'w' has shape \\[3\\] but its master has shape \\[2\\]"):
    tx.update({"w": jnp.ones(3, jnp.bfloat16)}, state, {"w": jnp.ones(3, jnp.bfloat16)})
  with pytest.raises(ValueError, match="gradients do not match params"):
    tx.update({"w": params["w"], "extra": params["w"]}, state, params)
  wide_state = tx.init({"w": jnp.ones(2, jnp.float32)})
  with pytest.raises(ValueError, match="'w' is bfloat16\\[2\\] but the state holds no master"):
    tx.update(params, wide_state, params)


def test_extra_args_reach_the_inner_rule():
  seen = {}

  def update(updates, state, params=None, **extra_args):
    seen["key"] = extra_args.get("key")
    # The step is jitted (eager too): read the traced value= when it runs.
    jax.debug.callback(lambda value: seen.update(value=value), extra_args["value"])
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  tx = mpx.loss_scale(mpx.mixed_precision(inner))
  state = tx.init(params)
  tx.update(params, state, params, value=jnp.float32(3.0), key="k")
  # value= (L-BFGS's loss) comes from the scaled loss: loss_scale unscales it.
  assert set(seen) == {"value", "key"} and seen["key"] == "k"
  assert float(seen["value"]) == 3.0 / float(mpx.get_loss_scale(state))
  # A plain GradientTransformation inside does not receive (or choke on) them.
  plain = mpx.mixed_precision(optax.sgd(0.1))
  plain.update(params, plain.init(params), params, value=1.0)


def test_optimizer_state_bytes_per_parameter():
  """bf16 params + Adam: exactly a 4-byte master plus Adam's 8 bytes."""
  params = {"a": jnp.ones((256, 64), jnp.bfloat16), "b": jnp.ones((64,), jnp.bfloat16)}
  n = sum(x.size for x in jax.tree.leaves(params))
  state = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3))).init(params)
  per_param = [x for x in jax.tree.leaves(state) if x.size == n or x.shape in {(256, 64), (64,)}]
  scalars = [x for x in jax.tree.leaves(state) if x.shape == ()]
  assert sum(x.nbytes for x in per_param) == 12 * n
  assert len(per_param) + len(scalars) == len(jax.tree.leaves(state))
  # Scalars: loss scale, tracker, streak, skipped, finite flag; applied and
  # non-finite steps; adam count.
  assert len(scalars) == 8


class TestInitFromFullPrecision:
  full = {
    "w": jnp.array([1.0 + 2.0**-20, -3.0 - 2.0**-17, 1e-8], jnp.float32),
    "norm": jnp.array([1.0 + 2.0**-20], jnp.float32),
  }

  def test_masters_equal_the_checkpoint_bit_for_bit(self):
    tx = mpx.mixed_precision(optax.adam(1e-3))
    params, state = mpx.init_from_full_precision(tx, self.full, jnp.bfloat16)
    assert params["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(state.master_params["w"], self.full["w"])
    np.testing.assert_array_equal(mpx.master_params(state, params)["norm"], self.full["norm"])
    # Plain init can only recover the rounded values.
    rounded = tx.init(params).master_params["w"]
    assert not np.array_equal(rounded, self.full["w"])

  def test_where_keeps_chosen_leaves_in_full_precision(self):
    tx = mpx.mixed_precision(optax.adam(1e-3))
    params, state = mpx.init_from_full_precision(
      tx, self.full, jnp.float16, where=lambda path, x: "norm" not in path
    )
    assert params["norm"] is self.full["norm"] and params["w"].dtype == jnp.float16
    assert isinstance(state.master_params["norm"], optax.MaskedNode)

  def test_inner_rule_is_initialised_on_the_exact_masters(self):
    """A rule whose state depends on the param values sees the checkpoint."""
    keep = optax.GradientTransformation(lambda p: {"copy": p}, lambda u, s, p=None: (u, s))
    tx = optax.chain(optax.identity(), mpx.mixed_precision(keep))
    _, state = jax.jit(lambda f: mpx.init_from_full_precision(tx, f, jnp.bfloat16))(self.full)
    np.testing.assert_array_equal(state[1].inner_state["copy"]["w"], self.full["w"])

  def test_leaves_without_a_master_raise(self):
    lost = r"2 leaves cast to bfloat16 would be lost\. 2 \(norm, w\) are under no mixed_prec"
    with pytest.raises(ValueError, match=lost):
      mpx.init_from_full_precision(optax.adam(1e-3), self.full, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"2 \(norm, w\) get no master"):
      mpx.init_from_full_precision(
        mpx.mixed_precision(optax.adam(1e-3), dtype=jnp.bfloat16), self.full, jnp.bfloat16
      )


def test_master_params_merges_every_mixed_precision_state():
  params = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2, jnp.float16), "c": jnp.ones(2)}
  labels = {"a": "x", "b": "y", "c": "y"}
  tx = mpx.loss_scale(
    optax.partition(
      {"x": mpx.mixed_precision(optax.sgd(1.0)), "y": mpx.mixed_precision(optax.adam(0.1))},
      labels,
    )
  )
  state = tx.init(params)
  grads = {"a": jnp.full(2, 2.0**-9, jnp.bfloat16), "b": jnp.ones(2, jnp.float16), "c": jnp.ones(2)}
  scaled = jax.tree.map(lambda g: g * mpx.get_loss_scale(state).astype(g.dtype), grads)
  updates, state = tx.update(scaled, state, params)
  params = optax.apply_updates(params, updates)
  full = mpx.master_params(state, params)
  assert {k: v.dtype for k, v in full.items()} == dict.fromkeys("abc", jnp.float32)
  np.testing.assert_array_equal(full["a"], jnp.full(2, 1.0 - 2.0**-9))  # lost in bf16
  assert float(params["a"][0]) == 1.0
  assert full["c"] is params["c"]
  assert mpx.master_params(optax.sgd(1.0).init(params), params) is params


def test_loss_scale_inside_mixed_precision_is_refused():
  """The reverse nesting would roll the scale back on every overflow."""
  params = {"w": jnp.ones(2, jnp.float16)}
  with pytest.raises(ValueError, match=r"mpx.loss_scale\(mpx.mixed_precision\(inner\)\)"):
    mpx.mixed_precision(mpx.loss_scale(optax.sgd(0.1))).init(params)
  with pytest.raises(ValueError, match="wraps a loss_scale"):
    mpx.mixed_precision(optax.chain(optax.identity(), mpx.loss_scale(optax.sgd(0.1)))).init(params)
