"""Compressed optimizer moments: ``mixed_precision(..., moments=...)``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import skip_recorded, tree_equal

import mpx

BIG = (64, 128)  # 8192 elements: compressed (at least 4096)
SMALL = (16,)  # stays float32


def bf16_params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {
    "w": jax.random.normal(keys[0], BIG).astype(jnp.bfloat16),
    "b": jax.random.normal(keys[1], SMALL).astype(jnp.bfloat16),
  }


def grads_like(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1000 + seed), len(leaves))
  return treedef.unflatten(
    [jax.random.normal(k, x.shape).astype(x.dtype) for k, x in zip(keys, leaves, strict=True)]
  )


def bytes_per_param(state, params):
  n = sum(x.size for x in jax.tree.leaves(params))
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)) / n


@pytest.mark.parametrize(
  ("masters", "moments", "expected"),
  [
    ("full", "full", 12),
    ("remainder", "full", 10),
    ("stochastic", "full", 8),
    ("full", "bfloat16", 8),
    ("remainder", "bfloat16", 6),
    ("stochastic", "bfloat16", 4),
  ],
)
def test_adamw_state_bytes_per_parameter(masters, moments, expected):
  params = {"w": jnp.ones((1024, 1024), jnp.bfloat16)}  # one large leaf
  tx = mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments=moments)
  got = bytes_per_param(tx.init(params), params)
  assert expected <= got <= expected + 0.001, got


def test_only_moments_of_at_least_4096_elements_are_compressed():
  tx = mpx.mixed_precision(optax.adamw(1e-3), moments="bfloat16")
  state = tx.init(bf16_params())
  adam = state.inner_state[0]
  assert isinstance(adam.mu["w"], mpx.Bfloat16Moment)
  assert isinstance(adam.nu["w"], mpx.Bfloat16Moment)
  assert adam.mu["b"].dtype == jnp.float32 and adam.count.dtype == jnp.int32


@pytest.mark.parametrize("masters", ["full", "remainder", "stochastic"])
def test_a_skipped_step_leaves_every_stored_byte_unchanged(masters):
  params = bf16_params()
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments="bfloat16"),
    init_scale=1.0,
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  updates, state = step(grads_like(params, 1), state, params)
  params = optax.apply_updates(params, updates)
  poisoned = grads_like(params, 2)
  poisoned["w"] = poisoned["w"].at[3, 4].set(jnp.nan)
  updates, skipped = step(poisoned, state, params)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert skip_recorded(skipped.inner_state, state.inner_state)


def test_inner_state_is_the_state_plain_optax_holds_at_any_depth_and_under_jit():
  params = bf16_params()
  tx = mpx.loss_scale(
    optax.chain(optax.clip(10.0), mpx.mixed_precision(optax.adam(1e-3), moments="bfloat16"))
  )
  state = tx.init(params)
  inner = jax.jit(mpx.inner_state)(state)
  reference = optax.adam(1e-3).init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
  assert jax.tree.structure(inner) == jax.tree.structure(reference)
  assert jax.tree.map(lambda x: x.dtype, inner) == jax.tree.map(lambda x: x.dtype, reference)
  full = mpx.mixed_precision(optax.adam(1e-3))
  assert tree_equal(mpx.inner_state(full.init(params)), full.init(params).inner_state)
  with pytest.raises(ValueError, match="holds 0 mixed_precision states"):
    mpx.inner_state(optax.adam(1e-3).init(params))


def test_bfloat16_moments_track_float32_optax_without_drift():
  """float32 params (no masters): the same gradient stream into optax.adam
  and into its bfloat16-moment form. Stochastic rounding keeps nu unbiased
  (b2 = 0.999 moves it by 0.1% a step, below bfloat16's half-ulp of 0.2-0.4%,
  so rounding to nearest would stall it)."""
  shape = (64, 256)
  params = {"w": jnp.zeros(shape, jnp.float32)}
  scales = jnp.logspace(-3, 0, shape[0])[:, None]  # rows 1000x apart
  plain, compressed = optax.adam(1e-3), mpx.mixed_precision(optax.adam(1e-3), moments="bfloat16")

  @jax.jit
  def run(key):
    def body(carry, key):
      s_plain, s_comp = carry
      g = {"w": scales * jax.random.normal(key, shape)}
      _, s_plain = plain.update(g, s_plain, params)
      _, s_comp = compressed.update(g, s_comp, params)
      return (s_plain, s_comp), None

    carry = (plain.init(params), compressed.init(params))
    (s_plain, s_comp), _ = jax.lax.scan(body, carry, jax.random.split(key, 2000))
    return s_plain[0], mpx.inner_state(s_comp)[0]

  want, got = run(jax.random.key(0))
  nu_ratio = np.asarray(got.nu["w"]) / np.asarray(want.nu["w"])
  mu_err = np.abs(np.asarray(got.mu["w"]) - np.asarray(want.mu["w"]))
  # Unbiased: over all elements nu's mean ratio within 0.1% of 1, and within
  # 1% per row of 256 (one gradient scale; stochastic rounding's noise).
  assert abs(nu_ratio.mean() - 1) < 1e-3, nu_ratio.mean()
  np.testing.assert_allclose(nu_ratio.mean(axis=1), 1.0, atol=1e-2)
  # Stochastic rounding's noise accumulates in a slow average (a random walk
  # the average damps over ~1/(1-b2) steps): per row, the mean relative error
  # stays bounded after 2000 steps (no drift), as does mu's error measured in
  # the gradient's RMS.
  rows_err = np.abs(nu_ratio - 1).mean(axis=1)
  assert rows_err.max() < 0.06
  rms = np.sqrt(np.asarray(want.nu["w"]))
  assert np.max(mu_err / rms) < 0.05
  assert np.all(np.asarray(got.nu["w"]) > 0)


def test_adjust_changes_the_rate_without_recompiling():
  params = bf16_params()
  tx = mpx.mixed_precision(
    optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), moments="bfloat16"
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  _, state = step(grads_like(params, 1), state, params)
  state = mpx.adjust(state, learning_rate=5e-4)
  _, state = step(grads_like(params, 2), state, params)
  assert step._cache_size() == 1
  assert float(optax.tree.get(state, "learning_rate")) == np.float32(5e-4)


def test_bad_settings_name_the_fix():
  with pytest.raises(ValueError, match="moments must be one of"):
    mpx.mixed_precision(optax.adam(1e-3), moments="int4")
  with pytest.raises(ValueError, match="float32 inner state"):
    mpx.mixed_precision(optax.adam(1e-3), dtype=jnp.float16, moments="bfloat16")
  with pytest.raises(ValueError, match="sequence of field names"):
    mpx.mixed_precision(optax.adam(1e-3), moments="bfloat16", moment_fields="mu")
  tx = mpx.mixed_precision(optax.adam(1e-3), moments="bfloat16", moment_fields=("mu", "m"))
  with pytest.raises(ValueError, match=r"(?s)\['m'\] match no field.*'mu', 'nu'"):
    tx.init(bf16_params())


def test_named_fields_compress_other_rules_moments():
  tx = mpx.mixed_precision(optax.adan(1e-3), moments="bfloat16", moment_fields=("m", "v", "n"))
  state = tx.init(bf16_params())
  adan = state.inner_state[0]
  assert all(isinstance(getattr(adan, f)["w"], mpx.Bfloat16Moment) for f in ("m", "v", "n"))
  assert adan.g["w"].dtype == jnp.float32  # not named: kept
