"""mpx inside optax's machinery: injection, masking, partitions, jit, sync-free."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import round_to_bfloat16

import mpx


def model_params(dtype=jnp.float16):
  keys = jax.random.split(jax.random.key(0), 2)
  return {
    "dense": {"kernel": (0.3 * jax.random.normal(keys[0], (8, 4))).astype(dtype)},
    "norm": {"scale": jnp.ones(4, jnp.float32)},
    "out": (0.3 * jax.random.normal(keys[1], (4,))).astype(dtype),
  }


def loss_fn(params, x):
  h = jnp.tanh(x.astype(params["dense"]["kernel"].dtype) @ params["dense"]["kernel"])
  h = h.astype(jnp.float32) * params["norm"]["scale"]
  return jnp.mean((h @ params["out"].astype(jnp.float32) - 1.0) ** 2)


def make_step(tx, traces):
  """A full training step; ``traces`` counts how often jit traces it."""

  def step(params, opt_state, x):
    traces.append(1)
    grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1))


def test_whole_step_is_sync_free_and_compiles_once_across_skipped_steps():
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))),
    init_scale=2.0**15,
  )
  params = model_params()
  opt_state = tx.init(params)
  traces = []
  step = make_step(tx, traces)
  batches = [jax.random.normal(jax.random.key(i), (16, 8)) for i in range(6)]
  batches[2] = batches[2].at[0, 0].set(jnp.inf)  # one overflowing step
  batches = jax.device_put(batches)
  with jax.transfer_guard("disallow"):
    for x in batches:
      params, opt_state = step(params, opt_state, x)
  assert len(traces) == 1
  assert int(opt_state.skipped_steps) == 1
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))


def test_learning_rate_changes_without_recompiling():
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2))
  )
  params = model_params()
  opt_state = tx.init(params)
  traces = []
  step = make_step(tx, traces)
  x = jnp.ones((4, 8))
  params, opt_state = step(params, opt_state, x)
  opt_state = mpx.adjust(opt_state, learning_rate=1e-3)  # a Python float
  params, opt_state = step(params, opt_state, x)
  assert float(optax.tree.get(opt_state, "learning_rate")) == np.float32(1e-3)
  opt_state = optax.tree.set(opt_state, learning_rate=jnp.asarray(0.0, jnp.float32))
  frozen = jax.tree.map(np.asarray, mpx.master_params(opt_state, params))  # before donation
  params, opt_state = step(params, opt_state, x)
  assert len(traces) == 1
  # Traced once is not enough: a committed new rate would be compiled anew.
  assert step._cache_size() == 1
  # lr 0 and adamw's decay times lr 0: the masters must not move.
  after = mpx.master_params(opt_state, params)
  assert all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(after), strict=True)
  )


def test_learning_rate_actually_takes_effect():
  """Changing lr with adjust equals building the rule with that lr."""
  params = {"w": jnp.linspace(-1, 1, 8, dtype=jnp.bfloat16)}
  grads = {"w": jnp.linspace(1, 2, 8, dtype=jnp.bfloat16)}
  injected = mpx.mixed_precision(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5))
  state = mpx.adjust(injected.init(params), learning_rate=0.125)
  fixed = mpx.mixed_precision(optax.sgd(0.125))
  got, _ = injected.update(grads, state, params)
  want, _ = fixed.update(grads, fixed.init(params), params)
  np.testing.assert_array_equal(got["w"], want["w"])


class TestAdjust:
  tx = mpx.loss_scale(
    mpx.mixed_precision(
      optax.chain(
        optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0),
        optax.inject_hyperparams(optax.adamw)(
          learning_rate=optax.linear_schedule(1e-3, 0.0, 100), weight_decay=1e-4
        ),
      )
    )
  )
  params = {"w": jnp.ones(3, jnp.bfloat16)}

  def test_keeps_dtype_and_shape_and_sets_every_match(self):
    state = mpx.adjust(self.tx.init(self.params), weight_decay=1, max_norm=np.float64(2.0))
    assert optax.tree.get(state, "weight_decay").dtype == jnp.float32
    assert float(optax.tree.get(state, "weight_decay")) == 1.0
    assert optax.tree.get(state, "max_norm").shape == ()
    assert optax.tree.get(state, "max_norm").dtype == jnp.float32

  def test_unknown_name_lists_the_names_that_exist(self):
    with pytest.raises(ValueError, match="'lr'.*'learning_rate'.*'max_norm'.*'weight_decay'"):
      mpx.adjust(self.tx.init(self.params), lr=1e-3)

  def test_scheduled_names_are_refused(self):
    with pytest.raises(ValueError, match="'learning_rate' is driven by a schedule"):
      mpx.adjust(self.tx.init(self.params), learning_rate=1e-3)

  def test_bad_shape_is_refused(self):
    with pytest.raises(ValueError, match="'weight_decay' has shape"):
      mpx.adjust(self.tx.init(self.params), weight_decay=jnp.ones(3))

  def test_state_without_injection_says_how(self):
    with pytest.raises(ValueError, match="optax.inject_hyperparams"):
      mpx.adjust(mpx.mixed_precision(optax.adam(1e-3)).init(self.params), learning_rate=1.0)

  def test_works_inside_jit_with_a_traced_value(self):
    state = self.tx.init(self.params)
    new = jax.jit(lambda s, v: mpx.adjust(s, weight_decay=v))(state, jnp.float32(0.5))
    assert float(optax.tree.get(new, "weight_decay")) == 0.5
    assert float(optax.tree.get(state, "weight_decay")) == np.float32(1e-4)  # not mutated


def test_masked_inside_and_outside_mixed_precision():
  params = model_params(jnp.bfloat16)
  grads = jax.tree.map(jnp.ones_like, params)
  is_kernel = {"dense": {"kernel": True}, "norm": {"scale": False}, "out": False}
  inside = mpx.mixed_precision(optax.masked(optax.sgd(0.5), is_kernel))
  outside = optax.masked(mpx.mixed_precision(optax.sgd(0.5)), is_kernel)
  for tx in (inside, outside):
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    kernel = params["dense"]["kernel"].astype(jnp.float32) - 0.5
    np.testing.assert_array_equal(new["dense"]["kernel"], round_to_bfloat16(kernel))
    # Leaves outside the mask get the gradient itself as update (optax.masked's
    # rule), so they land on param + 1, rounded.
    out = params["out"].astype(jnp.float32) + 1.0
    np.testing.assert_array_equal(new["out"], round_to_bfloat16(out))


def test_multi_transform_groups_and_tree_map_params():
  params = model_params(jnp.bfloat16)
  labels = {"dense": {"kernel": "adam"}, "norm": {"scale": "sgd"}, "out": "adam"}
  tx = mpx.loss_scale(
    mpx.mixed_precision(
      optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)}, labels)
    )
  )
  state = tx.init(params)
  is_hole = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  # Replace every param-shaped tree in the state (masters, mu, nu) with zeros.
  zeroed = optax.tree_utils.tree_map_params(
    tx,
    lambda p: p if is_hole(p) else jnp.zeros_like(p),
    state,
    transform_non_params=lambda x: x,
    is_leaf=is_hole,
  )
  master = zeroed.inner_state.master_params["dense"]["kernel"]
  assert master.dtype == jnp.float32 and not np.any(np.asarray(master))
  assert int(zeroed.growth_tracker) == 0 and float(zeroed.loss_scale) == float(state.loss_scale)
  mu = optax.tree.get(zeroed, "mu")
  assert not np.any(np.asarray(mu["dense"]["kernel"]))
  # Specs for sharding: a PartitionSpec per param-shaped leaf.
  specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), params)
  state_specs = optax.tree_utils.tree_map_params(
    tx, lambda p, s: s, state, specs, transform_non_params=lambda _: None, is_leaf=is_hole
  )
  assert state_specs.inner_state.master_params["out"] == jax.sharding.PartitionSpec()


def test_eval_shape_of_init_on_shape_dtype_structs():
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_params())
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
  )
  abstract = jax.eval_shape(tx.init, params)
  assert abstract.inner_state.master_params["dense"]["kernel"].dtype == jnp.float32
  assert isinstance(abstract.inner_state.master_params["norm"]["scale"], optax.MaskedNode)
  concrete = tx.init(model_params())
  assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
  assert all(
    a.shape == c.shape and a.dtype == c.dtype
    for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete), strict=True)
  )
