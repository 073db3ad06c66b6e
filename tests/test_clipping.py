"""`mpx.clipped_grad`: global-norm clipping with the norm from a first backward pass.

The reference is independent of it: ``optax.clip_by_global_norm`` first in
the inner rule, on the gradients of one backward pass (``jax.grad``). The two
must train bit for bit alike, in every masters mode and either skip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import tree_equal

import mpx


def loss(params, x, poison=0.0):
  hidden = jnp.tanh(x @ params["w"]) * params["v"]
  # poison (inf) reaches b's gradient alone.
  return jnp.mean(jnp.square(hidden.astype(jnp.float32))) + poison * jnp.sum(params["b"])


def setup(seed=0):
  rng = np.random.default_rng(seed)
  params = {
    "w": jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16),
    "v": jnp.asarray(rng.standard_normal(64), jnp.bfloat16),
    "b": jnp.asarray(rng.standard_normal(8), jnp.bfloat16),
  }
  batches = [jnp.asarray(rng.standard_normal((16, 32)) * 3, jnp.bfloat16) for _ in range(4)]
  return params, batches


def first_norm():
  params, batches = setup()
  return float(optax.tree.norm(mpx.cast_tree(jax.grad(loss)(params, batches[0]), jnp.float32)))


def train(tx, grad_fn, params, batches):
  state = tx.init(params)

  @jax.jit
  def step(params, state, x):
    grads = grad_fn(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for x in batches:
    params, state = step(params, state, x)
  return params, state


def reference_and_two_pass(masters, skip, scale):
  max_norm = scale * first_norm()
  params, batches = setup()
  inner = optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(1e-2))
  reference = train(mpx.mixed_precision(inner, masters=masters), jax.grad(loss), params, batches)
  two_pass = mpx.clipped_grad(loss, max_norm)
  tx = mpx.mixed_precision(optax.adamw(1e-2), masters=masters, skip=skip)
  got = train(tx, lambda p, x: two_pass(p, x)[0], params, batches)
  (got_params, got_state), (ref_params, ref_state) = got, reference
  masters_pair = (
    mpx.master_params(got_state, got_params),
    mpx.master_params(ref_state, ref_params),
  )
  # The reference's inner state is optax.chain's: (clip's empty state, adamw's).
  inner_pair = (mpx.inner_state(got_state), mpx.inner_state(ref_state)[1])
  return (got_params, ref_params), masters_pair, inner_pair


MASTERS = ("full", "remainder", "24bit", "stochastic")
# Below, between and above the gradients' norms: clipped at every step, at
# some, at none.
SCALES = (0.1, 1.0, 100.0)


# 24-bit masters at the scale between the gradients' norms (clipped at some
# steps) in the quick tier; at the other scales, and the other masters at
# that one, with -m slow.
LEAF_CASES = [(m, s) for m in MASTERS for s in SCALES if m == "24bit" or s == 1.0]


@pytest.mark.parametrize(
  "masters, scale",
  [c if c == ("24bit", 1.0) else pytest.param(*c, marks=pytest.mark.slow) for c in LEAF_CASES],
)
def test_with_skip_leaf_it_trains_bitwise_as_clip_by_global_norm_in_the_inner_rule(masters, scale):
  for got, want in reference_and_two_pass(masters, "leaf", scale):
    assert tree_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("masters", ["full", "stochastic"])
def test_with_the_default_skip_it_trains_as_clip_by_global_norm_in_the_inner_rule(masters):
  # Inside the skip's cond, XLA:CPU fuses the clip into Adam's arithmetic where
  # the rule clips, and contracts a multiply-add there (a rounding apart).
  (got_params, ref_params), masters_pair, inner_pair = reference_and_two_pass(masters, "step", 1.0)
  assert tree_equal(got_params, ref_params)
  for got, want in (masters_pair, inner_pair):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-9)


def test_the_norm_and_gradients_are_those_of_one_backward_pass():
  params, batches = setup()
  grads = jax.grad(loss)(params, batches[0])
  norm = optax.tree.norm(mpx.cast_tree(grads, jnp.float32))
  max_norm = float(norm) / 2
  clipped, got_norm = jax.jit(mpx.clipped_grad(loss, max_norm))(params, batches[0])
  assert got_norm.dtype == jnp.float32 and float(got_norm) == float(norm)
  for name, g in grads.items():
    expected = (np.asarray(g, np.float32) / np.float32(norm)) * np.float32(max_norm)
    np.testing.assert_array_equal(np.asarray(clipped[name]), expected)


@pytest.mark.slow
def test_has_aux_returns_the_second_pass_aux():
  params, batches = setup()
  with_aux = lambda p, x: (loss(p, x), {"loss": loss(p, x)})  # noqa: E731
  grads, norm, aux = mpx.clipped_grad(with_aux, 1.0, has_aux=True)(params, batches[0])
  assert float(aux["loss"]) == float(loss(params, batches[0]))
  assert tree_equal(grads, mpx.clipped_grad(loss, 1.0)(params, batches[0])[0])
  assert np.isfinite(float(norm))


@pytest.mark.parametrize("masters", ["24bit", pytest.param("stochastic", marks=pytest.mark.slow)])
def test_a_nonfinite_gradient_anywhere_skips_every_leaf_with_skip_leaf(masters):
  # Alone, skip="leaf" would keep b and step w and v; the norm is a verdict
  # on every gradient, known before any leaf changes: every leaf is kept.
  params, batches = setup()
  tx = mpx.mixed_precision(optax.adamw(1e-2), masters=masters, moments="4bit", skip="leaf")
  state = tx.init(params)
  two_pass = mpx.clipped_grad(loss, 1.0)
  grads, norm = jax.jit(two_pass)(params, batches[0], jnp.inf)
  assert not np.isfinite(float(norm))
  assert all(bool(jnp.isnan(g).all()) for g in grads.values())
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  new_params = optax.apply_updates(params, updates)
  assert tree_equal(new_params, params)
  assert tree_equal(mpx.master_params(new_state, new_params), mpx.master_params(state, params))
  moments = lambda s: (optax.tree.get(s, "mu"), optax.tree.get(s, "nu"))  # noqa: E731
  assert tree_equal(moments(new_state), moments(state))
  assert int(new_state.nonfinite_steps) == 1 and int(new_state.applied_steps) == 0
