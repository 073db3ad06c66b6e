"""``mpx.sync_masters``: params edited outside the optimizer stay edited, and
``mpx.adjust`` keeps the sharding of what it replaces.

References are numpy computations on the state before the edit: an edited
element's master must become the edited param, every other master must keep
its bits.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from treecheck import tree_equal

import mpx


def trained(tx, params, steps=5, seed=0):
  """``(params, state)`` after a few SGD-like steps on random gradients."""
  rng = np.random.default_rng(seed)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(steps):
    grads = jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape).astype(np.float32)).astype(p.dtype), params
    )
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def project(params):
  """A projection onto w >= 0 and a pruning of every fourth element."""
  w = jnp.maximum(params["w"], 0)
  w = jnp.where(jnp.arange(w.size).reshape(w.shape) % 4 == 0, 0, w)
  return {**params, "w": w}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_edited_elements_restart_their_masters_and_the_rest_keep_their_bits(dtype):
  params = {"w": jnp.linspace(-1, 1, 48, dtype=jnp.float32).astype(dtype), "b": jnp.ones(3)}
  tx = mpx.mixed_precision(optax.sgd(1e-3))
  params, state = trained(tx, params)
  edited = project(params)
  changed = np.asarray(edited["w"]).view(np.uint16) != np.asarray(params["w"]).view(np.uint16)
  assert 0 < changed.sum() < changed.size
  synced = mpx.sync_masters(state, edited)
  old, new = np.asarray(state.master_params["w"]), np.asarray(synced.master_params["w"])
  np.testing.assert_array_equal(new[changed], np.asarray(edited["w"], np.float32)[changed])
  np.testing.assert_array_equal(new[~changed].view(np.uint32), old[~changed].view(np.uint32))
  assert tree_equal(synced.inner_state, state.inner_state)
  # Without the sync, a zero-update step undoes the edit; with it, the edit stays.
  zero = jax.tree.map(jnp.zeros_like, edited)
  undone = optax.apply_updates(edited, tx.update(zero, state, edited)[0])
  kept = optax.apply_updates(edited, tx.update(zero, synced, edited)[0])
  assert tree_equal(kept, edited)
  assert not tree_equal(undone, edited)


def test_sync_finds_masters_at_any_depth_and_jits():
  params = {"w": jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16), "b": jnp.zeros(4, jnp.bfloat16)}
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(1e-2))
  tx = mpx.loss_scale(optax.MultiSteps(mpx.mixed_precision(inner), every_k_schedule=1))
  params, state = trained(tx, params)
  edited = project(params)
  synced = jax.jit(mpx.sync_masters)(state, edited)
  assert tree_equal(synced, mpx.sync_masters(state, edited))
  masters = mpx.master_params(synced, edited)
  np.testing.assert_array_equal(
    np.asarray(masters["w"])[np.asarray(edited["w"], np.float32) == 0], 0
  )
  assert jax.tree.structure(synced) == jax.tree.structure(state)


def test_remainder_masters_follow_edits_and_a_pruned_param_never_becomes_nan():
  params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.sgd(1e-3), masters="remainder")
  params, state = trained(tx, params)
  edited = project(params)
  remainders = np.asarray(state.master_remainders["w"])
  pruned = np.asarray(edited["w"], np.float32) == 0
  assert np.any(pruned & (remainders < 0))  # the pairs an edit breaks occur
  # The master view follows the edit within half an ulp, and is never NaN.
  view = np.asarray(mpx.master_params(state, edited)["w"])
  assert np.isfinite(view).all()
  w = np.asarray(edited["w"], np.float32)
  ulp = np.spacing(np.abs(np.asarray(edited["w"])).astype(ml_dtypes.bfloat16)).astype(np.float32)
  assert np.all(np.abs(view - w) <= ulp / 2)
  synced = mpx.sync_masters(state, edited)
  new = np.asarray(synced.master_remainders["w"])
  np.testing.assert_array_equal(new[pruned & (remainders < 0)], 0)
  np.testing.assert_array_equal(
    new[~(pruned & (remainders < 0))], remainders[~(pruned & (remainders < 0))]
  )
  # A step from the edit is finite with or without the sync, and the same.
  grads = {"w": jnp.full((64,), 0.5, jnp.bfloat16)}
  steps = [optax.apply_updates(edited, tx.update(grads, s, edited)[0]) for s in (state, synced)]
  assert np.isfinite(np.asarray(steps[0]["w"], np.float32)).all()
  assert tree_equal(steps[0], steps[1])


def test_stochastic_has_no_masters_to_sync():
  params = {"w": jnp.ones(8, jnp.bfloat16)}
  state = mpx.mixed_precision(optax.sgd(1.0), masters="stochastic").init(params)
  assert tree_equal(mpx.sync_masters(state, project(params)), state)


def test_sync_rejects_other_params():
  state = mpx.mixed_precision(optax.sgd(1.0)).init({"w": jnp.ones(3, jnp.bfloat16)})
  with pytest.raises(ValueError, match="sync_masters: params do not match"):
    mpx.sync_masters(state, {"v": jnp.ones(3, jnp.bfloat16)})


def test_sync_and_adjust_keep_shardings_so_the_step_never_recompiles():
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  params = {"w": jnp.linspace(-1, 1, 64 * 4, dtype=jnp.bfloat16).reshape(64, 4)}
  params = jax.device_put(params, NamedSharding(mesh, P()))
  tx = mpx.mixed_precision(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
  shardings = mpx.zero1_shardings(tx, params, mesh)
  state = jax.jit(tx.init, out_shardings=shardings)(params)

  def step(params, state):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  pinned = (jax.tree.map(lambda p: p.sharding, params), shardings)
  step = jax.jit(step, in_shardings=pinned, out_shardings=pinned)

  params, state = step(params, state)
  adjusted = mpx.adjust(state, learning_rate=5e-4)
  edited = project(params)
  synced = mpx.sync_masters(adjusted, edited)
  for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(synced), strict=True):
    assert new.sharding.is_equivalent_to(old.sharding, new.ndim), (old.sharding, new.sharding)
  with jax.transfer_guard("disallow"):
    _, after = step(edited, synced)
  assert step._cache_size() == 1
  assert float(optax.tree.get(after, "learning_rate")) == np.float32(5e-4)
