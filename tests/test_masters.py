"""The three storage modes of ``mixed_precision``'s masters.

- ``"remainder"`` must be bitwise ``"full"``: the same params, the same master
  view, whole trajectories long, through ties, saturation and the exponent-gap
  corner, and a run may switch between the two at any step.
- ``"stochastic"`` must be unbiased (the mean of many rounded values is the
  float32 value, within the binomial error) with bits independent per element,
  per leaf and per applied step, the same under any sharding, and untouched by
  a skipped step.
- The state bytes per parameter are 12 / 10 / 8 for AdamW on bf16 params.

The references are independent of mpx: optax in float32 for the masters, and
``treecheck.round_to_bfloat16`` (numpy on the bits) for the params.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from lowering_forms import forced
from treecheck import round_to_bfloat16, skip_recorded, tree_equal

import mpx

BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def bf16(values) -> jax.Array:
  return jnp.asarray(np.asarray(values, np.float32).astype(ml_dtypes.bfloat16))


def hard_params(seed: int) -> dict:
  """bf16 params with exact ties ahead, values near the range limits and a
  leaf that keeps no master (float32)."""
  rng = np.random.default_rng(seed)
  return {
    "w": bf16(rng.normal(size=(16, 24))),
    "big": bf16(rng.choice([-1, 1], 40) * BF16_MAX * rng.uniform(0.5, 1.0, 40)),
    "tiny": bf16(rng.normal(size=40) * 1e-30),
    "norm": jnp.asarray(rng.normal(size=8), jnp.float32),
  }


def run(tx, params, grads_seq):
  """``[(params, master view, opt_state)]`` after each step, jitted once."""

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state, out = tx.init(params), []
  for grads in grads_seq:
    params, state = step(params, state, grads)
    out.append((params, mpx.master_params(state, params), state))
  return out


def grads_sequence(params, steps: int, seed: int):
  """Gradients of every scale: tiny ones (updates below half a bf16 ulp),
  huge ones (masters pushed past the bf16 range) and ties (a gradient equal
  to half an ulp of its param, under SGD with learning rate 1)."""
  rng = np.random.default_rng(seed)
  seq = []
  for t in range(steps):
    grads = {}
    for name, p in params.items():
      p32 = np.asarray(p, np.float32)
      g = rng.normal(size=p32.shape) * 10.0 ** rng.integers(-6, 2)
      if name == "big" and t % 3 == 0:
        g = -np.sign(p32) * BF16_MAX * 0.1  # push the masters beyond the range
      if name == "tiny" and t % 4 == 1:
        g = p32 * 2.0**20  # a target 2**20 times larger: the next corner
      grads[name] = jnp.asarray(g.astype(np.float32)).astype(p.dtype)
    seq.append(grads)
  return seq


# Two compilations a case. The quick tier keeps SGD (the saturation corner)
# in the CPU form; -m slow adds AdamW and the GPU form (test_fault_injection's
# quick GPU-form cases run remainder masters in the select, against a run
# never fed the skipped steps).
@pytest.mark.parametrize(
  ("inner", "form"),
  [
    ("sgd", "CPU form"),
    pytest.param("adamw", "CPU form", marks=pytest.mark.slow),
    pytest.param("sgd", "GPU form", marks=pytest.mark.slow),
    pytest.param("adamw", "GPU form", marks=pytest.mark.slow),
  ],
)
def test_remainder_is_bitwise_full_over_whole_trajectories(inner, form):
  # The GPU form: the programs a GPU runs (a select instead of lax.cond), on
  # the CPU. (Across forms XLA:CPU may contract a * b + c differently; the
  # zoo compares both forms with float32 optax with contraction off.)
  with forced("gpu" if form == "GPU form" else None):
    _check_remainder_is_bitwise_full(inner)


def _check_remainder_is_bitwise_full(inner):
  params = hard_params(0)
  rule = optax.sgd(1.0) if inner == "sgd" else optax.adamw(3e-2, weight_decay=1e-2)
  seq = grads_sequence(params, 40, seed=1)
  full = run(mpx.mixed_precision(rule), params, seq)
  remainder = run(mpx.mixed_precision(rule, masters="remainder"), params, seq)
  for t, ((p_f, m_f, s_f), (p_r, m_r, s_r)) in enumerate(zip(full, remainder, strict=True)):
    assert tree_equal(p_f, p_r), t
    assert tree_equal(m_f, m_r), t
    assert tree_equal(s_f.inner_state, s_r.inner_state), t
    # The params are the masters rounded to nearest, ties away, as numpy rounds them.
    for name in ("w", "big", "tiny"):
      np.testing.assert_array_equal(
        np.asarray(p_r[name]).view(np.uint16),
        round_to_bfloat16(np.asarray(m_r[name])).view(np.uint16),
      )
  # The trajectory went where it was meant to: every leaf moved, and under
  # SGD the huge gradients pushed masters to the saturation limit.
  for name in ("w", "big", "tiny"):
    assert not np.array_equal(np.asarray(full[-1][1][name]), np.asarray(params[name], np.float32))
  assert np.isfinite(np.asarray(full[-1][0]["big"], np.float32)).all()
  if inner == "sgd":
    limit = np.array(0x7F7F7FFF, np.uint32).view(np.float32)
    assert any(np.abs(np.asarray(m["big"])).max() == limit for _, m, _ in full)


def test_ties_round_away_from_zero_in_both_modes():
  # Masters exactly half a bf16 ulp above 1, 3 and -3: nearest-even would
  # round the first down and the others up; mpx rounds all three away from 0.
  params = {"w": bf16([1.0, 3.0, -3.0])}
  half_ulp = np.array([2.0**-8, 2.0**-7, -(2.0**-7)], np.float32)
  grads = {"w": jnp.asarray(-half_ulp)}
  for masters in ("full", "remainder"):
    ((new, view, _),) = run(mpx.mixed_precision(optax.sgd(1.0), masters=masters), params, [grads])
    np.testing.assert_array_equal(np.asarray(view["w"]), [1 + 2.0**-8, 3 + 2.0**-7, -3 - 2.0**-7])
    np.testing.assert_array_equal(
      np.asarray(new["w"], np.float32), [1 + 2.0**-7, 3 + 2.0**-6, -3 - 2.0**-6]
    )


def test_a_run_switches_between_full_and_remainder_bitwise():
  params = hard_params(2)
  rule = optax.adamw(1e-2)
  seq = grads_sequence(params, 20, seed=3)
  full = run(mpx.mixed_precision(rule), params, seq)
  # At step 10, rebuild a remainder state from the full one's masters.
  p10, m10, s10 = full[9]
  tx_r = mpx.mixed_precision(rule, masters="remainder")
  low = lambda path, leaf: path != "norm"  # noqa: E731  (norm is float32: no master)
  p_switched, s_switched = mpx.init_from_full_precision(tx_r, m10, jnp.bfloat16, where=low)
  assert tree_equal(p_switched, p10)
  s_switched = s_switched._replace(inner_state=s10.inner_state)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx_r.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  p, s = p_switched, s_switched
  for t in range(10, 20):
    p, s = step(p, s, seq[t])
    assert tree_equal(p, full[t][0]), t
    assert tree_equal(mpx.master_params(s, p), full[t][1]), t


def test_init_from_full_precision_is_exact_for_remainder():
  rng = np.random.default_rng(4)
  full = {
    "w": jnp.asarray(rng.normal(size=(8, 8)).astype(np.float32)),
    "ties": jnp.asarray(np.float32([1 + 2.0**-8, -3 - 2.0**-7, 2.5])),
    "huge": jnp.asarray(np.float32([3.4e38, -3.4e38])),
  }
  tx = mpx.mixed_precision(optax.adam(1e-3), masters="remainder")
  params, state = mpx.init_from_full_precision(tx, full, jnp.bfloat16)
  view = mpx.master_params(state, params)
  assert tree_equal(
    {k: view[k] for k in ("w", "ties")}, {k: full[k] for k in ("w", "ties")}
  )  # bit for bit
  np.testing.assert_array_equal(
    np.asarray(params["ties"], np.float32), [1 + 2.0**-7, -3 - 2.0**-6, 2.5]
  )
  # Beyond the largest float32 that rounds to a finite bf16: saturated, finite.
  assert np.isfinite(np.asarray(params["huge"], np.float32)).all()
  assert np.asarray(state.master_remainders["w"]).dtype == np.int16


def test_state_bytes_per_parameter_for_adamw_on_bf16():
  params = {"w": jnp.zeros((512, 1024), jnp.bfloat16), "b": jnp.zeros((1024,), jnp.bfloat16)}
  n = sum(x.size for x in jax.tree.leaves(params))
  expected = {"full": 12, "remainder": 10, "stochastic": 8}

  def state_bytes(tx):  # from the state's shapes and dtypes: nothing computed
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(tx.init, params)))

  for masters, want in expected.items():
    per_param = state_bytes(mpx.mixed_precision(optax.adamw(1e-3), masters=masters)) / n
    assert want <= per_param < want + 0.001, (masters, per_param)
  # Plain float32 Adam, the bar: 4 B of param + 8 B of moments.
  assert state_bytes(optax.adamw(1e-3)) / n < 8.001


# --- Stochastic rounding ---------------------------------------------------------------


def stochastic_step(params, grads, seed=0, count=0):
  tx = mpx.mixed_precision(optax.sgd(1.0), masters="stochastic", seed=seed)
  state = tx.init(params)
  state = state._replace(applied_steps=jnp.int32(count))
  updates, state = jax.jit(tx.update)(grads, state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.parametrize(
  ("start", "fraction"), [(1.0, 0.3), (-1.0, 0.3), (1.0, 0.9), (100.0, 0.5), (1e-30, 0.05)]
)
def test_stochastic_rounding_is_unbiased(start, fraction):
  n = 2**16
  params = {"w": jnp.full((n,), start, jnp.bfloat16)}
  start_bf16 = np.float32(np.asarray(params["w"][0], np.float32))
  ulp = np.float32(np.spacing(ml_dtypes.bfloat16(abs(start_bf16))).astype(np.float32))
  step = np.float32(np.sign(start_bf16) * fraction * ulp)  # away from zero
  target = np.float32(start_bf16 + step)
  new, _ = stochastic_step(params, {"w": jnp.full((n,), -step, jnp.float32).astype(jnp.bfloat16)})
  new = np.asarray(new["w"], np.float32)
  # Only the two neighbours occur.
  assert set(np.unique(new)) <= {start_bf16, np.float32(start_bf16 + np.sign(start_bf16) * ulp)}
  # The gradient was rounded to bf16 on its way in; the target is what the
  # rule computed from it.
  target = np.float32(start_bf16 - np.float32(np.asarray(-step, ml_dtypes.bfloat16)))
  p_up = abs(float(target) - float(start_bf16)) / float(ulp)
  observed = np.mean(new != start_bf16)
  assert abs(observed - p_up) < 5 * np.sqrt(p_up * (1 - p_up) / n) + 1e-9
  assert abs(np.mean(new.astype(np.float64)) - target) < 5 * float(ulp) * np.sqrt(0.25 / n)


def test_stochastic_bits_are_independent_per_element_leaf_step_and_seed():
  n = 2**14
  params = {"a": jnp.ones((n,), jnp.bfloat16), "b": jnp.ones((n,), jnp.bfloat16)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, -(2.0**-8)), params)  # half an ulp
  up = lambda new: np.asarray(new, np.float32) > 1  # noqa: E731
  first, state = stochastic_step(params, grads)
  a, b = up(first["a"]), up(first["b"])
  assert int(state.applied_steps) == 1
  # Each element rounds up with probability 1/2, independently: the leaves,
  # neighbouring elements, the next step and another seed all disagree on about half.
  tolerance = 5 * np.sqrt(0.25 / n)
  for other in (
    b,
    np.roll(a, 1),
    up(stochastic_step(params, grads, count=1)[0]["a"]),
    up(stochastic_step(params, grads, seed=1)[0]["a"]),
  ):
    assert abs(np.mean(a != other) - 0.5) < tolerance
  # And the same inputs give the same bits.
  assert np.array_equal(a, up(stochastic_step(params, grads)[0]["a"]))


def test_a_skipped_step_leaves_the_stochastic_state_bitwise_unchanged():
  params = {"w": bf16(np.linspace(-1, 1, 64)), "n": jnp.ones(3, jnp.float32)}
  tx = mpx.mixed_precision(optax.adamw(1e-2), masters="stochastic", seed=7)
  state = tx.init(params)
  good = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
  bad = {"w": good["w"].at[3].set(jnp.nan), "n": good["n"]}
  update = jax.jit(tx.update)
  u1, s1 = update(good, state, params)
  p1 = optax.apply_updates(params, u1)
  u2, s2 = update(bad, s1, p1)
  assert skip_recorded(s2, s1)  # the random-bit counter included
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(u2))
  assert int(s1.applied_steps) == 1 and int(s2.applied_steps) == 1
  # The next applied step draws the bits step 2 would have drawn with no skip.
  u3, s3 = update(good, s2, p1)
  u3_ref, _ = update(good, s1, p1)
  assert tree_equal(u3, u3_ref) and int(s3.applied_steps) == 2


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")
def test_stochastic_bits_do_not_depend_on_the_sharding():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  params = {
    "w": bf16(np.random.default_rng(5).normal(size=(64, 48))),
    "v": bf16(np.random.default_rng(6).normal(size=(40,))),
  }
  grads = jax.tree.map(lambda p: (p * 1e-3).astype(p.dtype), params)
  tx = mpx.mixed_precision(optax.adam(1e-3), masters="stochastic")

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  expected = jax.jit(step)(params, tx.init(params), grads)
  for specs in ({"w": P("data", "model"), "v": P("data")}, {"w": P("model", None), "v": P()}):
    sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    g = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in grads.items()}
    got = jax.jit(step)(sharded, tx.init(sharded), g)
    assert sharded["w"].sharding.spec == specs["w"]
    assert tree_equal(jax.device_get(got), jax.device_get(expected))


def test_stochastic_training_follows_float32_where_plain_bf16_stalls():
  # 2000 updates of 1e-4 on 1.0: each is 1/78 of a bf16 ulp. Plain bf16 SGD
  # never moves; the float32 value is 0.8; stochastic rounding gets there.
  params = {"w": jnp.ones((4096,), jnp.bfloat16)}
  grads = {"w": jnp.full((4096,), 1e-4, jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.sgd(1.0), masters="stochastic")

  @jax.jit
  def train(params):
    def body(carry, _):
      params, state = carry
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=2000)
    return params, state

  params, state = train(params)
  g = float(np.asarray(grads["w"][0], np.float32))
  assert abs(float(np.mean(np.asarray(params["w"], np.float32))) - (1 - 2000 * g)) < 2e-3
  assert int(state.applied_steps) == 2000


# --- Every mode composes -----------------------------------------------------------------


# Quick: remainder. test_fault_injection's quick cases wrap every masters mode
# in loss_scale against a run never fed the skipped steps; -m slow adds the
# other two here.
@pytest.mark.parametrize(
  "masters",
  [
    pytest.param("full", marks=pytest.mark.slow),
    "remainder",
    pytest.param("stochastic", marks=pytest.mark.slow),
  ],
)
def test_loss_scale_wraps_every_mode(masters):
  params = hard_params(8)
  params = {k: params[k] for k in ("w", "norm")}
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  plain = mpx.mixed_precision(inner, masters=masters)
  scaled = mpx.loss_scale(mpx.mixed_precision(inner, masters=masters), init_scale=2.0**8)
  grads = grads_sequence(params, 6, seed=9)
  grads[2] = {"w": grads[2]["w"].at[0, 0].set(jnp.inf), "norm": grads[2]["norm"]}
  ref = run(plain, params, [g for t, g in enumerate(grads) if t != 2])
  # loss_scale: the same gradients times the scale in effect (a power of 2: exact).
  update = jax.jit(scaled.update)
  p, state, got = params, scaled.init(params), []
  for g in grads:
    scale = mpx.get_loss_scale(state)
    g = jax.tree.map(lambda x, scale=scale: x * scale.astype(x.dtype), g)
    updates, state = update(g, state, p)
    p = optax.apply_updates(p, updates)
    got.append((p, state))
  assert int(state.skipped_steps) == 1 and float(state.loss_scale) == 2.0**7
  for t, k in zip([0, 1, 3, 4, 5], range(5), strict=True):
    assert tree_equal(got[t][0], ref[k][0]), t
    mp_state = got[t][1].inner_state
    assert int(mp_state.nonfinite_steps) == int(t > 2), t  # the skip, counted
    assert tree_equal(mp_state._replace(nonfinite_steps=ref[k][2].nonfinite_steps), ref[k][2]), t


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")
@pytest.mark.parametrize("masters", ["remainder", "24bit", "stochastic"])
def test_zero1_shardings_split_the_compact_state(masters):
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  params = {"w": jnp.ones((64, 8), jnp.bfloat16), "b": jnp.zeros((8,), jnp.float32)}
  params = jax.device_put(params, NamedSharding(mesh, P()))
  tx = mpx.mixed_precision(optax.adam(1e-3), masters=masters)
  shardings = mpx.zero1_shardings(tx, params, mesh)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  assert state.inner_state[0].mu["w"].sharding.spec == P("data")
  if masters != "stochastic":
    stored = state.master_remainders if masters == "remainder" else state.master_corrections
    assert stored["w"].sharding.spec == P("data")
    assert stored["w"].addressable_shards[0].data.shape == (8, 8)
  else:
    assert state.rounding_keys["w"].sharding.spec == P()  # one scalar key per leaf
    assert state.applied_steps.sharding.spec == P()


def test_master_params_in_every_mode():
  params = {"w": bf16([1.0, -2.5]), "b": jnp.asarray([0.5], jnp.float32)}
  full = {"w": jnp.asarray([1.0 + 2.0**-10, -2.5], jnp.float32), "b": params["b"]}
  for masters in ("full", "remainder"):
    tx = mpx.mixed_precision(optax.sgd(1.0), masters=masters)
    low, state = mpx.init_from_full_precision(tx, full, jnp.bfloat16)
    assert tree_equal(mpx.master_params(state, low), full)
  tx = mpx.mixed_precision(optax.sgd(1.0), masters="stochastic")
  view = mpx.master_params(tx.init(params), params)
  assert tree_equal(view, {"w": params["w"].astype(jnp.float32), "b": params["b"]})


# --- Errors ------------------------------------------------------------------------------


def test_bad_modes_seeds_and_leaves_are_refused_by_name():
  with pytest.raises(ValueError, match=r"masters must be one of 'full', 'remainder'"):
    mpx.mixed_precision(optax.sgd(1.0), masters="half")
  with pytest.raises(ValueError, match=r"bfloat16 params under float32 masters; dtype is float16"):
    mpx.mixed_precision(optax.sgd(1.0), jnp.float16, masters="remainder")
  for seed in (1.5, "0", None):
    with pytest.raises(ValueError, match="seed must be an integer"):
      mpx.mixed_precision(optax.sgd(1.0), masters="stochastic", seed=seed)
  params = {"ok": jnp.ones(2, jnp.bfloat16), "layer": {"half": jnp.ones(2, jnp.float16)}}
  for masters in ("remainder", "stochastic"):
    with pytest.raises(ValueError, match=r"param 'layer/half' is float16"):
      mpx.mixed_precision(optax.sgd(1.0), masters=masters).init(params)
  tx = mpx.mixed_precision(optax.sgd(1.0), masters="stochastic")
  with pytest.raises(ValueError, match="masters='stochastic', which keeps no master"):
    mpx.init_from_full_precision(tx, {"w": jnp.ones(2)}, jnp.bfloat16)
  # A state of another mode is refused, not misread.
  full_state = mpx.mixed_precision(optax.sgd(1.0)).init({"w": jnp.ones(2, jnp.bfloat16)})
  tx = mpx.mixed_precision(optax.sgd(1.0), masters="remainder")
  grads = {"w": jnp.ones(2, jnp.bfloat16)}
  with pytest.raises(TypeError, match="not MixedPrecisionRemainderState"):
    tx.update(grads, full_state, {"w": jnp.ones(2, jnp.bfloat16)})
