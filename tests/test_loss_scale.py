"""loss_scale: PyTorch's rule, validation, skipping, nesting, persistence."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import skip_recorded, tree_equal

import mpx
from mpx._src.loss_scale import ScaleRule


def reference_scales(flags, *, init, growth, backoff, interval, min_scale, max_scale, hysteresis):
  """The documented rule, written independently in plain Python."""
  scale, tracker, streak, out = init, 0, 0, []
  for finite in flags:
    if finite:
      streak, tracker = 0, tracker + 1
      if tracker == interval:
        scale, tracker = min(scale * growth, max_scale), 0
    else:
      tracker, streak = 0, streak + 1
      if streak >= hysteresis:
        scale = max(scale * backoff, min_scale)
    out.append(scale)
  return out


def run_flags(tx, flags, params=None):
  """Feeds finite (1.0) or inf gradients per flag; returns the scales seen."""
  params = {"w": jnp.ones(3, jnp.float16)} if params is None else params
  state = tx.init(params)
  step = jax.jit(tx.update)
  scales, states = [], []
  for finite in flags:
    grads = {"w": jnp.full(3, 1.0 if finite else jnp.inf, jnp.float16)}
    _, state = step(grads, state, params)
    scales.append(float(state.loss_scale))
    states.append(state)
  return scales, states


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"growth_factor": float("inf")}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 2.5}, "growth_interval"),
    ({"hysteresis": 0}, "hysteresis"),
    ({"init_scale": float("nan")}, "init_scale"),
    ({"init_scale": -1.0}, "init_scale"),
    ({"init_scale": 1e39}, "init_scale"),
    ({"min_scale": 0.0}, "min_scale"),
    ({"max_scale": float("inf")}, "max_scale"),
    ({"min_scale": 4.0, "init_scale": 2.0}, "min_scale"),
    ({"init_scale": 4.0, "max_scale": 2.0}, "init_scale"),
  ],
)
def test_invalid_settings_raise_naming_the_argument(kwargs, message):
  with pytest.raises(ValueError, match=message):
    mpx.loss_scale(optax.sgd(0.1), **kwargs)


def test_invalid_static_scale_and_inner():
  with pytest.raises(ValueError, match="scale"):
    mpx.static_loss_scale(optax.sgd(0.1), 0.0)
  with pytest.raises(TypeError, match="GradientTransformation"):
    mpx.loss_scale(optax.sgd)


def test_default_initial_scale_is_representable_in_fp16():
  state = mpx.loss_scale(optax.sgd(0.1)).init(jnp.zeros(2))
  assert float(state.loss_scale) == 2.0**15
  assert np.isfinite(np.float16(float(state.loss_scale)))


def scale_settings(config, hysteresis):
  """``loss_scale``'s keyword arguments for a ``reference_scales`` config."""
  return dict(
    init_scale=config["init"],
    growth_factor=config["growth"],
    backoff_factor=config["backoff"],
    growth_interval=config["interval"],
    min_scale=config["min_scale"],
    max_scale=config["max_scale"],
    hysteresis=hysteresis,
  )


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_scale_sequence_matches_the_documented_rule(hysteresis):
  config = dict(init=64.0, growth=2.0, backoff=0.5, interval=3, min_scale=4.0, max_scale=256.0)
  rng = np.random.default_rng(hysteresis)
  flags = list(rng.random(120) > 0.3) + [True] * 20 + [False] * 10 + [True] * 9
  tx = mpx.loss_scale(optax.sgd(0.1), **scale_settings(config, hysteresis))
  scales, states = run_flags(tx, flags)
  assert scales == reference_scales(flags, hysteresis=hysteresis, **config)
  assert int(states[-1].skipped_steps) == flags.count(False)
  assert min(scales) == 4.0 and max(scales) == 256.0  # floor and cap both reached


@pytest.mark.parametrize("hysteresis", [1, 2, 4])
def test_the_scale_rule_alone_matches_the_reference(hysteresis):
  # ScaleRule.adjust is a pure function of (state, finite), tested on its own,
  # scanned over a flag sequence, against the plain-Python model: the scale and
  # every counter at every step.
  config = dict(init=32.0, growth=4.0, backoff=0.25, interval=5, min_scale=0.5, max_scale=2.0**12)
  rule = ScaleRule.dynamic(**scale_settings(config, hysteresis))
  rng = np.random.default_rng(7 + hysteresis)
  flags = list(rng.random(300) > 0.25) + [False] * 12 + [True] * 40

  def body(state, finite):
    state = rule.adjust(state, finite)
    return state, state

  _, states = jax.lax.scan(body, rule.initial_state(inner_state=()), jnp.asarray(flags))
  assert np.asarray(states.loss_scale).tolist() == reference_scales(
    flags, hysteresis=hysteresis, **config
  )
  tracker, streak, trackers, streaks = 0, 0, [], []
  for finite in flags:
    streak = 0 if finite else streak + 1
    tracker = (tracker + 1) % config["interval"] if finite else 0
    trackers.append(tracker)
    streaks.append(streak)
  assert np.asarray(states.growth_tracker).tolist() == trackers
  assert np.asarray(states.overflow_streak).tolist() == streaks
  assert np.asarray(states.skipped_steps).tolist() == np.cumsum(np.logical_not(flags)).tolist()
  assert np.asarray(states.last_step_finite).tolist() == flags


def test_a_static_rule_never_moves():
  rule = ScaleRule.static(8.0)
  state = rule.initial_state(inner_state=())
  for finite in [False, True, True, False]:
    state = rule.adjust(state, jnp.asarray(finite))
    assert float(state.loss_scale) == 8.0


def test_hand_computed_sequence():
  """interval 2: grow on the 2nd consecutive finite step, not the 3rd (flax's
  off-by-one); an overflow resets the count."""
  tx = mpx.loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=2, max_scale=32.0)
  flags = [True, True, True, False, True, True, True, True, True, True]
  scales, states = run_flags(tx, flags)
  assert scales == [8, 16, 16, 8, 8, 16, 16, 32, 32, 32]
  assert [int(s.growth_tracker) for s in states] == [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
  assert [bool(s.last_step_finite) for s in states] == flags


def test_growth_stops_at_the_cap_and_unscaling_stays_exact_there():
  # At the highest cap allowed, 2**126, the reciprocal 2**-126 is still a
  # normal float32: gradients unscale exactly instead of flushing to zero.
  tx = mpx.loss_scale(optax.sgd(1.0), init_scale=2.0**124, max_scale=2.0**126, growth_interval=1)
  scales, _ = run_flags(tx, [True] * 4)
  assert list(scales) == [2.0**125, 2.0**126, 2.0**126, 2.0**126]
  state = tx.init(jnp.zeros(2))
  state = state._replace(loss_scale=jnp.float32(2.0**126))
  updates, _ = tx.update(jnp.array([2.0**126, 3 * 2.0**120], jnp.float32), state)
  np.testing.assert_array_equal(updates, [-1.0, -3 * 2.0**-6])


@pytest.mark.parametrize(
  ("setting", "value"),
  [
    ("max_scale", 2.0**127),
    ("max_scale", float(np.finfo(np.float32).max)),
    ("min_scale", 2.0**-127),
    ("init_scale", 2.0**-130),
  ],
)
def test_scales_whose_reciprocal_xla_would_flush_are_refused(setting, value):
  settings = {"init_scale": 1.0, "min_scale": 2.0**-126, "max_scale": 2.0**126, setting: value}
  if setting == "init_scale":
    settings["min_scale"] = value
  with pytest.raises(ValueError, match=rf"{setting} must be in \[2\*\*-126, 2\*\*126\]"):
    mpx.loss_scale(optax.sgd(1.0), **settings)
  with pytest.raises(ValueError, match=r"scale must be in \[2\*\*-126"):
    mpx.static_loss_scale(optax.sgd(1.0), 2.0**127)


def test_a_state_that_does_not_fit_the_settings_is_refused():
  tx = mpx.loss_scale(optax.sgd(1.0), init_scale=8.0, min_scale=1.0, max_scale=64.0)
  state = tx.init(jnp.zeros(2))
  grads = jnp.ones(2)
  for bad, message in [
    (state._replace(loss_scale=jnp.float32(128.0)), r"loss_scale 128.0 is outside \[min_scale"),
    (state._replace(growth_tracker=jnp.int32(2000)), r"growth_tracker 2000 is outside"),
    (state._replace(skipped_steps=jnp.int32(-1)), r"a counter is negative"),
  ]:
    with pytest.raises(ValueError, match=message):
      tx.update(grads, bad)
  tx.update(grads, state)  # the state init made is fine


def test_gradients_are_unscaled_in_float32_with_this_steps_scale():
  """The inner rule sees float32 grads divided by the scale the loss used,
  even on the step where the scale grows."""
  seen_dtypes = []

  def record(updates, state, params=None):
    seen_dtypes.append(updates.dtype)  # at trace time
    return updates, state  # pass the gradients the inner rule saw through

  inner = optax.GradientTransformation(lambda p: optax.EmptyState(), record)
  tx = mpx.loss_scale(inner, init_scale=2.0**12, growth_interval=1)
  true_grads = jnp.array([3e-6, 1.5e-7, -2.0], jnp.float32)  # 1.5e-7: subnormal in fp16
  state = tx.init(jnp.zeros(3, jnp.float16))
  for _ in range(2):
    scaled = (true_grads * state.loss_scale).astype(jnp.float16)
    seen, new_state = tx.update(scaled, state, None)
    assert seen_dtypes[-1] == jnp.float32 and seen.dtype == jnp.float32
    np.testing.assert_array_equal(seen, scaled.astype(jnp.float32) / state.loss_scale)
    np.testing.assert_allclose(seen, true_grads, rtol=1e-3)
    state = new_state
  assert float(state.loss_scale) == 2.0**14  # grew after each step


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_skipped_step_leaves_inner_state_and_schedule_untouched(bad):
  params = {"w": jnp.ones(4, jnp.float16)}
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.chain(optax.adam(0.1), optax.scale_by_schedule(schedule))),
    init_scale=16.0,
    min_scale=1.0,
  )
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.ones(4, jnp.float16)}, state, params)
  params = optax.apply_updates(params, updates)
  bad_grads = {"w": jnp.array([1.0, bad, 1.0, 1.0], jnp.float16)}
  updates, skipped = jax.jit(tx.update)(bad_grads, state, params)
  assert not np.any(np.asarray(updates["w"]))
  assert skip_recorded(skipped.inner_state, state.inner_state)
  assert float(skipped.loss_scale) == 8.0
  assert int(skipped.skipped_steps) == 1 and not bool(skipped.last_step_finite)
  assert int(skipped.growth_tracker) == 0


def test_static_loss_scale_never_changes_but_still_skips():
  tx = mpx.static_loss_scale(optax.sgd(1.0), 64.0)
  scales, states = run_flags(tx, [True, False, True, True, False])
  assert scales == [64.0] * 5
  assert int(states[-1].skipped_steps) == 2


def test_get_and_scale_loss_find_the_state_at_any_depth():
  params = {"w": jnp.ones(2, jnp.float16)}
  core = mpx.loss_scale(mpx.mixed_precision(optax.sgd(0.1)), init_scale=4.0)
  wrappers = {
    "bare": core,
    "chain": optax.chain(optax.identity(), core),
    "multisteps": optax.MultiSteps(core, every_k_schedule=2),
    "inject": optax.inject_hyperparams(lambda lr: optax.chain(core, optax.scale(lr)))(lr=1.0),
    "partition": optax.partition({"a": core}, {"w": "a"}),
  }
  for name, tx in wrappers.items():
    state = tx.init(params)
    assert float(mpx.get_loss_scale(state)) == 4.0, name
    scaled = mpx.scale_loss(jnp.float16(3.0), state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 12.0, name
  assert float(mpx.get_loss_scale(optax.adam(1.0).init(params))) == 1.0
  assert mpx.get_loss_scale(optax.adam(1.0).init(params)).dtype == jnp.float32
  two = optax.partition({"a": core, "b": core}, {"w": "a", "v": "b"})
  with pytest.raises(ValueError, match="2 LossScaleStates"):
    mpx.get_loss_scale(two.init({"w": params["w"], "v": params["w"]}))


def test_scale_loss_avoids_fp16_overflow():
  state = mpx.loss_scale(optax.sgd(0.1), init_scale=2.0**15).init(jnp.zeros(1))
  assert np.isfinite(float(mpx.scale_loss(jnp.float16(100.0), state)))


def test_configuration_survives_jit_tree_map_and_pickle():
  """The floor, cap and interval live in the transformation, so a state that
  went through jit, tree_map and serialisation still obeys them."""
  import pickle

  tx = mpx.loss_scale(
    optax.sgd(0.1), init_scale=8.0, min_scale=2.0, max_scale=16.0, growth_interval=2
  )
  params = {"w": jnp.ones(2, jnp.float16)}
  state = jax.jit(tx.init)(params)
  state = jax.tree.map(lambda x: x, state)
  state = pickle.loads(pickle.dumps(jax.device_get(state)))
  step = jax.jit(tx.update)
  inf = {"w": jnp.full(2, jnp.inf, jnp.float16)}
  one = {"w": jnp.ones(2, jnp.float16)}
  for _ in range(5):
    _, state = step(inf, state, params)
  assert float(state.loss_scale) == 2.0  # floor
  for _ in range(10):
    _, state = step(one, state, params)
  assert float(state.loss_scale) == 16.0  # cap


def test_orbax_checkpoint_round_trip(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  params = {"w": jnp.linspace(-1, 1, 6, dtype=jnp.float16)}
  tx = mpx.loss_scale(
    mpx.mixed_precision(optax.adamw(1e-2)), init_scale=64.0, growth_interval=3, min_scale=8.0
  )
  step = jax.jit(tx.update)
  state = tx.init(params)
  grads = [{"w": jnp.full(6, g, jnp.float16)} for g in (1.0, jnp.inf, 2.0, -1.0, jnp.nan, 3.0)]
  for g in grads[:3]:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  assert tree_equal(restored["opt_state"], state)
  a = (params, state)
  b = (restored["params"], restored["opt_state"])
  for g in grads[3:]:
    ua, sa = step(g, a[1], a[0])
    ub, sb = step(g, b[1], b[0])
    a = (optax.apply_updates(a[0], ua), sa)
    b = (optax.apply_updates(b[0], ub), sb)
  assert tree_equal(a, b)
  assert float(b[1].loss_scale) == 16.0 and int(b[1].skipped_steps) == 2


def test_axis_name_makes_replicas_skip_together_under_vmap():
  tx = mpx.loss_scale(optax.sgd(1.0), init_scale=8.0, axis_name="replica")
  plain = mpx.loss_scale(optax.sgd(1.0), init_scale=8.0)
  params = jnp.zeros((4, 3))
  grads = jnp.ones((4, 3)).at[2, 1].set(jnp.inf)  # only replica 2 overflows
  for transform, expect_all_skipped in ((tx, True), (plain, False)):
    state = jax.vmap(transform.init)(params)
    # Jitted: eagerly every batched operation would compile on its own.
    update = jax.jit(jax.vmap(transform.update, axis_name="replica"))
    updates, state = update(grads, state, params)
    scales = np.asarray(state.loss_scale)
    if expect_all_skipped:
      assert not np.any(np.asarray(updates)) and np.all(scales == 4.0)
    else:  # without the reduction the replicas diverge
      assert np.any(np.asarray(updates)) and len(set(scales.tolist())) == 2


@pytest.mark.slow  # in-process: test_multidevice's replicas in lockstep under shard_map
def test_axis_name_under_shard_map_on_8_devices():
  """shard_map over 8 CPU devices, in a fresh process so the device count is
  guaranteed whatever imported jax first."""
  code = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax, mpx
    import jax_versions
    from jax.sharding import Mesh, PartitionSpec as P
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(1.0)), init_scale=8.0, axis_name="data")
    params = jnp.ones(8, jnp.float16)
    state = tx.init(params)

    # Each device's local grads; device 5 alone holds an inf.
    local = jnp.ones((8, 8), jnp.float16).at[5, 0].set(jnp.inf)
    def per_device(local, state, params):
      updates, state = tx.update(local[0], state, params)
      return updates[None], jax.tree.map(lambda x: x[None], state)
    fn = jax_versions.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P()),
                       out_specs=(P("data"), P("data")), check_vma=False)
    updates, states = jax.jit(fn)(local, state, params)
    assert not np.any(np.asarray(updates)), updates
    assert np.all(np.asarray(states.loss_scale) == 4.0)
    assert np.all(np.asarray(states.skipped_steps) == 1)
    print("ok")
    """
  )
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  tests = os.path.dirname(os.path.abspath(__file__))  # for jax_versions
  env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
  result = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_unscaling_overflow_counts_as_nonfinite_when_scale_below_one():
  """With a scale below 1 unscaling multiplies: a finite float32 gradient can
  become inf after unscaling, and that step must be skipped."""
  tx = mpx.loss_scale(optax.sgd(1.0), init_scale=0.5, min_scale=0.25)
  state = tx.init(jnp.zeros(2))
  updates, state = tx.update(jnp.array([3e38, 1.0], jnp.float32), state)
  assert int(state.skipped_steps) == 1 and not np.any(np.asarray(updates))
  updates, state = tx.update(jnp.array([1e38, 1.0], jnp.float32), state)  # 4e38 at scale 0.25
  assert int(state.skipped_steps) == 2
  updates, state = tx.update(jnp.array([1e30, 1.0], jnp.float32), state)
  np.testing.assert_array_equal(updates, -jnp.array([4e30, 4.0], jnp.float32))
