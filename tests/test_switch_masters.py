"""``mpx.switch_masters``: a run switched between ``masters=`` modes goes on as if
it had never switched ("full" <-> "remainder"), its counters and every state
around the masters carried over."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import mp_states, tree_equal

import mpx


def _tx(masters: str, moments: str = "8bit") -> optax.GradientTransformation:
  """A transformation with mixed_precision at depth: loss scale, gradient
  accumulation and clipping around it."""
  return mpx.loss_scale(
    optax.MultiSteps(
      optax.chain(
        optax.clip_by_global_norm(1.0),
        mpx.mixed_precision(
          optax.adamw(1e-2, weight_decay=0.1), masters=masters, moments=moments, seed=3
        ),
      ),
      every_k_schedule=2,
    ),
    init_scale=2.0**8,
  )


def _loss(params, x):
  hidden = jnp.tanh(x @ params["w"].astype(jnp.float32) + params["b"].astype(jnp.float32))
  return jnp.mean(hidden**2)


@functools.cache
def _step(masters: str, moments: str = "8bit"):
  tx = _tx(masters, moments)

  @jax.jit
  def step(params, state, x, poison):
    grads = jax.grad(lambda p: mpx.scale_loss(_loss(p, x), state))(params)
    grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _start():
  rng = np.random.default_rng(0)
  full_params = {"w": rng.normal(size=(64, 128)) / 8, "b": rng.normal(size=(128,)) / 8}
  full_params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), full_params)
  params, state = mpx.init_from_full_precision(_tx("full"), full_params, jnp.bfloat16)
  xs = [jnp.asarray(rng.normal(size=(16, 64)), jnp.float32) for _ in range(8)]
  # The fourth step's gradients are not finite: it is skipped, and counted.
  poisons = [jnp.float32(jnp.inf) if i == 3 else jnp.float32(1.0) for i in range(8)]
  return params, state, list(zip(xs, poisons, strict=True))


def _train(masters, params, state, batches):
  for x, poison in batches:
    params, state = _step(masters)(params, state, x, poison)
  return params, state


@pytest.mark.slow
def test_full_to_remainder_and_back_continues_the_run_bit_for_bit():
  params, state, batches = _start()
  never = _train("full", params, state, batches)

  p, s = _train("full", params, state, batches[:3])
  s = mpx.switch_masters(_tx("remainder"), s, p)
  assert isinstance(mp_states(s)[0], mpx.MixedPrecisionRemainderState)
  p, s = _train("remainder", p, s, batches[3:6])
  s = mpx.switch_masters(_tx("full"), s, p)
  switched = _train("full", p, s, batches[6:])

  assert tree_equal(switched, never)
  (mp,) = mp_states(switched[1])
  # 8 micro-steps under MultiSteps(every_k=2), one of them skipped by loss_scale.
  assert int(switched[1].skipped_steps) == 1
  assert int(mp.applied_steps) > 0


def test_to_stochastic_and_back_keeps_params_counters_and_the_state_around_masters():
  params, state, batches = _start()
  p, s = _train("full", params, state, batches[:5])
  to_stochastic = mpx.switch_masters(_tx("stochastic"), s, p)
  (old_mp,), (new_mp,) = mp_states(s), mp_states(to_stochastic)
  assert isinstance(new_mp, mpx.MixedPrecisionStochasticState)
  assert (int(new_mp.applied_steps), int(new_mp.nonfinite_steps)) == (
    int(old_mp.applied_steps),
    int(old_mp.nonfinite_steps),
  )
  assert tree_equal(new_mp.inner_state, old_mp.inner_state)
  # Everything around the masters (loss scale, MultiSteps' accumulators) as it was.
  assert float(to_stochastic.loss_scale) == float(s.loss_scale)
  assert tree_equal(optax.tree.get(to_stochastic, "acc_grads"), optax.tree.get(s, "acc_grads"))
  # No master: the params, in float32, are the model.
  as_f32 = mpx.cast_tree(p, jnp.float32)
  assert tree_equal(mpx.master_params(to_stochastic, p), as_f32)

  p, s = _train("stochastic", p, to_stochastic, batches[5:])
  back = mpx.switch_masters(_tx("full"), s, p)
  (mp,) = mp_states(back)
  assert tree_equal(mp.master_params, mpx.cast_tree(p, jnp.float32))
  assert int(mp.applied_steps) == int(mp_states(s)[0].applied_steps)


def test_a_switch_that_changes_more_than_the_masters_is_refused():
  params, state, _ = _start()
  # Named where they differ, with the fix: no structure dump.
  moments_differ = (
    r"outside the masters: at inner_state/inner_opt_state/1/inner_state/0/mu/w, opt_state holds "
    r"Signed8bitMoment "
    r"and tx's state float32\[64, 128\]\. To switch, build tx with the run's moments="
  )
  with pytest.raises(ValueError, match=moments_differ) as error:
    mpx.switch_masters(_tx("remainder", moments="full"), state, params)
  assert "PyTreeDef" not in str(error.value)
  rule_differs = r"0/count, opt_state holds int32\[\] and tx's state nothing\. .* own rule"
  with pytest.raises(ValueError, match=rule_differs):
    other_rule = mpx.loss_scale(
      optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), mpx.mixed_precision(optax.sgd(1e-2))),
        every_k_schedule=2,
      )
    )
    mpx.switch_masters(other_rule, state, params)
  with pytest.raises(ValueError, match="mixed_precision states"):
    mpx.switch_masters(optax.adam(1e-3), state, params)
