"""`mpx.accumulate`: gradients averaged over micro-batches, the inner rule run once a window.

References are independent of the code under test: `optax.MultiSteps` on
float32 params, and `mpx.mixed_precision` fed the window's mean as numpy
computes it. The micro-step (`mpx.accumulate_gradients`) is checked to touch
nothing but the accumulator, and to equal calling `update` on every micro-batch.
"""

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from treecheck import tree_equal

import mpx
from mpx._src import compat

K = 4


def micro_batches(count, shape=(6,), seed=0, scale=1e-2):
  """`count` gradients of varied signs and magnitudes, exact in bfloat16."""
  rng = np.random.default_rng(seed)
  grads = rng.standard_normal((count, *shape)).astype(np.float32) * scale
  return jnp.asarray(grads, jnp.bfloat16).astype(np.float32)


def run(tx, grads, params, micro_step=False, k=K, grad_dtype=None):
  """Steps `tx` over `grads` (in the params' dtype, or `grad_dtype`): every
  micro-batch through `update`, or (with `micro_step`) all but each window's
  last through `mpx.accumulate_gradients`."""
  update = jax.jit(tx.update)
  add = jax.jit(mpx.accumulate_gradients)
  state = tx.init(params)
  trajectory = []
  for i, g in enumerate(grads):
    g = {"w": g.astype(grad_dtype or params["w"].dtype)}
    if micro_step and (i + 1) % k:
      state = add(g, state)
    else:
      updates, state = update(g, state, params)
      params = optax.apply_updates(params, updates)
    trajectory.append(params)
  return trajectory, state


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_plain_rule_matches_optax_multisteps(inner):
  make = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(1e-2)}[inner]
  grads = micro_batches(3 * K)
  params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)}
  ours, state = run(mpx.accumulate(make(), K), grads, params)
  theirs, _ = run(optax.MultiSteps(make(), K).gradient_transformation(), grads, params)
  for a, b in zip(ours, theirs, strict=True):
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-6, atol=1e-7)
  assert int(optax.tree.get(state, "gradient_step")) == 3
  assert int(optax.tree.get(state, "mini_step")) == 0


@pytest.mark.parametrize("accumulator", ["float32", "bfloat16"])
@pytest.mark.parametrize(
  "masters",
  [
    "full",
    "24bit",
    *(pytest.param(m, marks=pytest.mark.slow) for m in ("remainder", "stochastic")),
  ],
)
def test_mixed_precision_receives_the_float32_mean(masters, accumulator):
  """Against `mixed_precision` fed each window's running mean as numpy computes
  it in float32 (`m += (g - m) / n`): bit for bit with a float32 accumulator,
  within the stochastic rounding of the means with a bfloat16 one."""
  grads = micro_batches(3 * K, shape=(4096,))
  params = {"w": jnp.asarray(np.linspace(-1, 1, 4096), jnp.bfloat16)}
  make = lambda: mpx.mixed_precision(optax.adam(1e-3), masters=masters)  # noqa: E731
  ours, state = run(mpx.accumulate(make(), K, accumulator=accumulator), grads, params)
  means = []
  for window in np.asarray(grads).reshape(3, K, -1):
    mean = window[0]
    for n, g in enumerate(window[1:], start=2):
      mean = mean + (g - mean) / np.float32(n)
    means.append(mean)
  reference, _ = run(make(), jnp.asarray(means), params, grad_dtype=jnp.float32)
  for window, expected in enumerate(reference):
    got = ours[K * window + K - 1]
    if accumulator == "float32":
      assert tree_equal(got, expected)
    else:
      ulps = np.abs(np.asarray(got["w"], np.float32) - np.asarray(expected["w"], np.float32))
      assert np.mean(ulps > 0) < 0.05, f"window {window}: {np.mean(ulps > 0):.3f} differ"
  # Between windows the params do not move.
  for i in range(len(grads)):
    if (i + 1) % K:
      before = params if i < K else ours[(i // K) * K - 1]
      assert tree_equal(ours[i], before)
  assert int(state.inner_state.applied_steps) == 3


@pytest.mark.parametrize("accumulator", ["float32", "bfloat16"])
def test_micro_step_equals_update_on_every_micro_batch(accumulator, finite_check_form):
  """In each form of the skip: between windows `update` neither applies nor
  counts a skip, so it ends where the micro-step path does."""
  grads = micro_batches(2 * K, shape=(4096,))
  params = {"w": jnp.asarray(np.linspace(-1, 1, 4096), jnp.bfloat16)}
  tx = mpx.accumulate(
    mpx.mixed_precision(optax.adamw(1e-3), masters="24bit", moments="4bit"),
    K,
    accumulator=accumulator,
  )
  by_update, state_a = run(tx, grads, params)
  by_micro_step, state_b = run(tx, grads, params, micro_step=True)
  assert tree_equal(by_update[-1], by_micro_step[-1])
  assert tree_equal(state_a, state_b)
  assert int(state_a.inner_state.applied_steps) == 2
  assert int(state_a.inner_state.nonfinite_steps) == 0


def test_micro_step_adds_and_touches_nothing_else():
  """The micro-step's program: no conditional, no optimizer work; every state
  leaf but the accumulator and its counters is passed through as it came."""
  params = {"w": jnp.zeros(4096, jnp.bfloat16), "b": jnp.zeros(3, jnp.float32)}
  tx = mpx.accumulate(mpx.mixed_precision(optax.adamw(1e-3), moments="8bit"), K)
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(mpx.accumulate_gradients)(params, state)
  text = str(jaxpr)  # nested jaxprs (jnp's pjit wrappers) included
  for primitive in ("cond[", "while[", "dot_general["):
    assert primitive not in text
  ins = jaxpr.jaxpr.invars[len(jax.tree.leaves(params)) :]
  state_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  for (path, _), inp, out in zip(state_leaves, ins, jaxpr.jaxpr.outvars, strict=True):
    if "inner_state" in jax.tree_util.keystr(path):
      assert out is inp, jax.tree_util.keystr(path)


def test_non_finite_micro_batch_skips_and_counts_the_whole_window(finite_check_form):
  grads = np.array(micro_batches(3 * K, shape=(4096,)))
  grads[1, 7] = np.inf  # the first window's second micro-batch
  params = {"w": jnp.asarray(np.linspace(-1, 1, 4096), jnp.bfloat16)}
  tx = mpx.accumulate(mpx.mixed_precision(optax.adam(1e-3)), K)
  trajectory, state = run(tx, jnp.asarray(grads), params, micro_step=True)
  assert tree_equal(trajectory[K - 1], params)  # the window is skipped whole
  assert int(state.inner_state.nonfinite_steps) == 1
  assert int(state.inner_state.applied_steps) == 2
  assert int(state.gradient_step) == 3
  assert bool(mpx.all_finite(state))
  # The later windows train as from a clean start on them.
  clean = mpx.accumulate(mpx.mixed_precision(optax.adam(1e-3)), K)
  expected, _ = run(clean, jnp.asarray(grads[K:]), params, micro_step=True)
  assert tree_equal(trajectory[-1], expected[-1])


def test_fp16_loss_scale_backs_off_on_an_overflowing_micro_batch():
  params = {"w": jnp.zeros(3, jnp.float16)}
  tx = mpx.accumulate(mpx.loss_scale(mpx.mixed_precision(optax.sgd(1.0)), init_scale=8.0), 2)
  state = tx.init(params)
  scaled = lambda g: {"w": jnp.asarray(g, jnp.float16) * mpx.get_loss_scale(state)}  # noqa: E731
  state = mpx.accumulate_gradients(scaled([1.0, np.inf, 1.0]), state)
  updates, state = tx.update(scaled([1.0, 1.0, 1.0]), state, params)
  assert not np.any(np.asarray(updates["w"]))
  assert float(mpx.get_loss_scale(state)) == 4.0
  assert int(optax.tree.get(state, "skipped_steps")) == 1
  state = mpx.accumulate_gradients(scaled([1.0, 2.0, 3.0]), state)
  updates, state = tx.update(scaled([3.0, 2.0, 1.0]), state, params)
  np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [-2.0, -2.0, -2.0])


def test_bfloat16_accumulator_is_unbiased_where_rounding_to_nearest_is_not():
  """Averaging 64 gradients of 1 + 2**-10 in bfloat16 (8 bits): rounded to
  nearest the mean would be 1; stochastically its average over many
  elements keeps the 2**-10."""
  n, count = 1 << 14, 64
  tx = mpx.accumulate(optax.sgd(1.0), count, accumulator="bfloat16")
  state = tx.init({"w": jnp.zeros(n)})
  add = jax.jit(mpx.accumulate_gradients)
  g = {"w": jnp.full(n, 1.0 + 2.0**-10)}
  for _ in range(count):
    state = add(g, state)
  mean = np.asarray(state.acc_grads["w"], np.float64).mean()
  assert abs(mean - (1.0 + 2.0**-10)) < 2.0**-13


def test_every_k_schedule_may_be_a_function_of_the_gradient_step():
  tx = mpx.accumulate(optax.sgd(1.0), lambda step: jnp.where(step < 1, 1, 3))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  moved = []
  for _ in range(7):
    updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    moved.append(bool(np.any(np.asarray(updates["w"]))))
  assert moved == [True, False, False, True, False, False, True]


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="accumulator must be one of"):
    mpx.accumulate(optax.sgd(1.0), 2, accumulator="float16")
  with pytest.raises(ValueError, match="integer >= 1, got 0"):
    mpx.accumulate(optax.sgd(1.0), 0)
  with pytest.raises(ValueError, match="integer >= 1, got 2.5"):
    mpx.accumulate(optax.sgd(1.0), 2.5)
  with pytest.raises(ValueError, match="integer >= 1, got True"):
    mpx.accumulate(optax.sgd(1.0), True)
  with pytest.raises(ValueError, match="must fit in int32"):
    mpx.accumulate(optax.sgd(1.0), 2**31)
  with pytest.raises(ValueError, match="holds 0 mpx.accumulate states"):
    mpx.accumulate_gradients({"w": jnp.ones(2)}, optax.sgd(1.0).init({"w": jnp.ones(2)}))
  with pytest.raises(ValueError, match="Nest them the other way"):
    mpx.mixed_precision(mpx.accumulate(optax.sgd(1.0), 2)).init({"w": jnp.ones(2, jnp.bfloat16)})


@pytest.mark.slow
@pytest.mark.parametrize("k", [8, 32])
def test_accumulator_error_as_docs_benchmarks_whole_step_md_says(k):
  """benchmarks/accumulator_error.py's steady stream: float32 exact to its
  precision; stochastic bfloat16 within 2x nearest's error, its bias at most
  a tenth of nearest's drift."""
  import benchmarks.accumulator_error as bench

  found = bench.errors("steady", k)
  f32, sr, nearest = (found[label] for label in bench.ACCUMULATORS)
  assert f32[0] < 1e-6
  assert nearest[0] < sr[0] < 2 * nearest[0]
  assert abs(sr[1]) <= 1e-5 < abs(nearest[1]) / 10


def test_flax_train_state_calls_update_on_every_micro_batch():
  """`TrainState.apply_gradients` on every micro-batch: the params move once
  a window, to where `mixed_precision` fed the window's mean puts them."""
  from flax.training import train_state

  grads = micro_batches(2 * K, shape=(4096,))
  params = {"w": jnp.asarray(np.linspace(-1, 1, 4096), jnp.bfloat16)}
  make = lambda: mpx.mixed_precision(optax.adam(1e-3), masters="remainder")  # noqa: E731
  state = train_state.TrainState.create(
    apply_fn=None, params=params, tx=mpx.accumulate(make(), K, accumulator="bfloat16")
  )
  apply = jax.jit(lambda s, g: s.apply_gradients(grads={"w": g}))
  for g in grads:
    state = apply(state, g.astype(jnp.bfloat16))
  expected, _ = run(mpx.accumulate(make(), K, accumulator="bfloat16"), grads, params)
  assert tree_equal(state.params, expected[-1])
  assert int(optax.tree.get(state.opt_state, "gradient_step")) == 2


@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "mpx inside nnx.Optimizer")
def test_nnx_optimizer_calls_update_on_every_micro_batch():
  from flax import nnx

  model = nnx.Linear(4, 2, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  initial = np.asarray(model.kernel[...], np.float32).copy()
  tx = mpx.accumulate(mpx.mixed_precision(optax.sgd(0.1)), 2, accumulator="bfloat16")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jnp.ones((3, 4), jnp.bfloat16)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    optimizer.update(model, grads)

  kernels = []
  for _ in range(4):
    step(model, optimizer)
    kernels.append(np.asarray(model.kernel[...], np.float32).copy())
  assert np.array_equal(kernels[0], initial)
  assert not np.array_equal(kernels[1], kernels[0])  # the first window ends
  assert np.array_equal(kernels[2], kernels[1])
  assert int(nnx.as_pure(optimizer.opt_state).gradient_step) == 2
