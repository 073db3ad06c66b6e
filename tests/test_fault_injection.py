"""Fault injection, overflow storms and the fp16 range, over long training runs.

The harness (``training_loop.py``) trains a small bf16/fp16 MLP and poisons the
gradients at random steps: one element, a whole leaf (the float32 leaf that has
no master included), or the loss itself, with inf, -inf or NaN, plus one burst
of consecutive poisoned steps. Each run asserts that

1. no non-finite value ever enters the params, the masters or the inner state
   (checked by numpy at every step, not by ``mpx.all_finite``);
2. ``skipped_steps`` equals the number of poisoned steps so far, at every step,
   and ``last_step_finite`` is False exactly on them;
3. the loss scale follows the documented rule (an independent plain-Python
   model of it), so it stays within ``[min_scale, max_scale]``;
4. the params, masters and inner state are, at every step, bitwise those of a
   *reference run that never took the poisoned steps*, and the inner state's
   step counters (Adam's and the schedule's) count clean steps only.

With compressed moments (``moments="8bit"`` or ``"bfloat16"``, on the MLP
widened so that one kernel's moments are compressed) points 1 and 4 cover the
inner state twice: as stored (codes, block scales, bfloat16 values) and
decompressed by ``mpx.inner_state``; and the run asserts that the stored
moments really are compressed. The compression rounds stochastically with
bits keyed on the count of applied steps, so the reference, which applies the
same clean steps, draws the same bits: point 4 holds bitwise there too.

What the reference is. The reference run is the same compiled function, with
the same transformation and the same initial params, fed only the clean steps'
batches, in order (padded at the end with extra batches whose results are not
compared). Row ``t`` of the poisoned run must equal row ``c(t)`` of the
reference, where ``c(t)`` counts the clean steps among the first ``t``: a
skipped step must leave everything bitwise as it was, and the next clean step
must continue as if the skipped one had never been fed.

- ``mixed_precision`` alone (bf16) and ``static_loss_scale`` (fp16) have no
  state that an overflow is *meant* to change, so the reference is exactly that:
  the same transformation fed only the clean steps, nothing else changed.
- Dynamic ``loss_scale`` must react to an overflow: the scale backs off. A run
  that never saw the overflows would keep a larger scale, and in fp16 the
  scale decides which gradient bits survive (underflow below 2**-24, rounding
  in the backward pass), so its params would differ for a good reason. The
  reference therefore *pins* the loss scale before each clean step to the value
  that the plain-Python rule predicts after the poisoned run's history of
  overflows (``train_step``'s ``pin``), and differs from the poisoned run in
  nothing else. The poisoned run's own scale path is checked against the same
  plain-Python rule (point 3), so the pin is not taken from the run under test.

The default sizes (400 steps, two seeds) keep the module within a few seconds of
compilation plus well under a second of training per run; ``MPX_LONG=1`` runs
3000 steps on five seeds.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import training_loop as tl
from treecheck import tree_equal

import mpx

STEPS = 3000 if tl.LONG else 400
SEEDS = range(5) if tl.LONG else range(2)
RATE, BURST = 0.03, 12  # 3% of steps poisoned at random, plus a burst of 12


class Case(NamedTuple):
  """One configuration of the poisoned runs."""

  stack: str
  dtype: Any
  config: tl.ScaleConfig = tl.ScaleConfig()
  masters: str = "full"
  moments: str = "full"
  hidden: int = tl.HIDDEN


CONFIGS = {
  "fp16-loss_scale": Case("loss_scale", jnp.float16),
  "fp16-static_loss_scale": Case("static_loss_scale", jnp.float16),
  "bf16-mixed_precision": Case("mixed_precision", jnp.bfloat16),
  # Hysteresis 2: the scale backs off on the second overflow in a row only.
  "bf16-loss_scale-hysteresis": Case("loss_scale", jnp.bfloat16, tl.ScaleConfig(hysteresis=2)),
  # The compact storage modes, alone and under a dynamic scale.
  "bf16-mixed_precision-remainder": Case("mixed_precision", jnp.bfloat16, masters="remainder"),
  "bf16-loss_scale-remainder": Case("loss_scale", jnp.bfloat16, masters="remainder"),
  "bf16-mixed_precision-stochastic": Case("mixed_precision", jnp.bfloat16, masters="stochastic"),
  "bf16-loss_scale-stochastic": Case("loss_scale", jnp.bfloat16, masters="stochastic"),
  # Compressed moments, on the model wide enough to have a compressed leaf.
  "bf16-loss_scale-remainder-8bit": Case(
    "loss_scale", jnp.bfloat16, masters="remainder", moments="8bit", hidden=tl.WIDE
  ),
  "bf16-mixed_precision-stochastic-8bit": Case(
    "mixed_precision", jnp.bfloat16, masters="stochastic", moments="8bit", hidden=tl.WIDE
  ),
  "fp16-loss_scale-bfloat16": Case("loss_scale", jnp.float16, moments="bfloat16", hidden=tl.WIDE),
}
# The cost of a case is the compilation of its configuration in its form (a
# second seed reuses it: a fraction of a second). The quick tier keeps four
# (configuration, form) pairs, so that every stack, dtype and masters mode but
# 8-bit moments runs once: "one CPU device" (the lax.cond) runs the fp16
# loss_scale (which test_training_recovers_from_an_overflow_storm reuses), the
# remainder and the stochastic configurations; "GPU form" (the select) runs
# the static scale. -m slow
# runs every configuration in every form ("several devices" included), the
# hysteresis one too (test_loss_scale checks its scale rule step by step).
QUICK_FORMS = {
  "fp16-loss_scale": {"one CPU device"},
  "fp16-static_loss_scale": {"GPU form"},
  "bf16-mixed_precision-remainder": {"one CPU device"},
  "bf16-loss_scale-stochastic": {"one CPU device"},
}
FORMS = ("one CPU device", "several devices", "GPU form")  # conftest.py's, in its order


# What a run records of the training state, checked for finiteness and bitwise.
PARTS = ("params", "masters", "inner", "inner_decompressed")


def rows(records, index):
  return jax.tree.map(lambda a: a[index], records)


def expected_scales(stack, config, injected):
  """The scale before the first step and after each step (plain Python)."""
  if stack == "mixed_precision":
    return np.ones(len(injected) + 1, np.float32)
  if stack == "static_loss_scale":
    return np.full(len(injected) + 1, 2.0**10, np.float32)
  after = tl.reference_scales(~injected, config)
  return np.asarray([config.init_scale, *after], np.float32)


def reference_plan(plan, injected, scales_before, pin, seed):
  """The clean steps of ``plan`` in order, padded to the same length."""
  clean = np.flatnonzero(~injected)
  pad = len(injected) - len(clean)
  x, y = tl.batches(10_000 + seed, pad)
  return tl.make_xs(
    np.concatenate([plan["x"][clean], x]),
    np.concatenate([plan["y"][clean], y]),
    pin=np.concatenate([np.full(len(clean), pin), np.zeros(pad, bool)]),
    scale=np.concatenate([scales_before[clean], np.ones(pad)]),
  )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
  ("finite_check_form", "name"),
  [
    pytest.param(
      form,
      name,
      id=f"{form}-{name}",
      marks=() if form in QUICK_FORMS.get(name, ()) else pytest.mark.slow,
    )
    for form in FORMS
    for name in CONFIGS
  ],
  indirect=["finite_check_form"],
)
def test_poisoned_steps_are_skipped_as_if_never_taken(finite_check_form, name, seed):
  stack, dtype, config, masters, moments, hidden = CONFIGS[name]
  _, run = tl.compiled_run(stack, config, masters, moments)
  params = tl.init_params(seed, dtype, hidden)
  plan = tl.random_plan(seed, STEPS, RATE, BURST)
  injected = plan["kind"] != tl.NONE
  # Every kind of injection, every poison, and every leaf occur.
  assert set(plan["kind"][injected]) == {tl.SINGLE, tl.LEAF, tl.LOSS}
  assert len({str(p) for p in plan["poison"][injected]}) == 3
  into_a_leaf = injected & (plan["kind"] != tl.LOSS)
  assert set(plan["leaf"][into_a_leaf]) == set(range(len(tl.LEAF_NAMES)))
  poisoned = jax.device_get(run(params, plan))

  # The moments are stored as the format says (not silently full), and the
  # decompressed view holds float32 where the stored one holds codes.
  assert tl.compressed_nodes(poisoned["inner"]) == tl.COMPRESSED[moments]
  assert tl.compressed_nodes(poisoned["inner_decompressed"]) == {}
  if moments != "full":
    adam = poisoned["inner_decompressed"][1][0]  # chain(clip, adamw): scale_by_adam's
    assert adam.mu["dense"]["kernel"].dtype == adam.nu["dense"]["kernel"].dtype == np.float32

  # 1. Nothing non-finite ever enters params, masters or inner state (stored,
  # and decompressed: a finite code with a non-finite block scale would show).
  for part in PARTS:
    assert tl.all_finite_np(poisoned[part]), part

  # 2. and 3. The counters and the scale, at every step.
  scales = expected_scales(stack, config, injected)
  np.testing.assert_array_equal(poisoned["scale"], scales)
  if stack != "mixed_precision":
    np.testing.assert_array_equal(poisoned["skipped"], np.r_[0, np.cumsum(injected)])
    np.testing.assert_array_equal(poisoned["last_finite"][1:], ~injected)
    assert config.min_scale <= scales.min() and scales.max() <= config.max_scale
  if stack == "loss_scale":  # the floor and the cap are both reached
    assert scales.min() == config.min_scale and scales.max() == config.max_scale

  # 4. Bitwise the run that never took the poisoned steps.
  reference = jax.device_get(
    run(params, reference_plan(plan, injected, scales[:-1], stack == "loss_scale", seed))
  )
  clean_so_far = np.r_[0, np.cumsum(~injected)]
  for part in PARTS:
    assert tree_equal(poisoned[part], rows(reference[part], clean_so_far)), part
  counters = [x for x in jax.tree.leaves(poisoned["inner"]) if x.dtype == np.int32]
  assert len(counters) == 2  # Adam's count and the schedule's
  for counter in counters:
    np.testing.assert_array_equal(counter, clean_so_far)

  # The check has teeth: every clean step moves the masters, and the model learns.
  moved = np.zeros(STEPS, bool)
  for leaf in jax.tree.leaves(poisoned["masters"]):
    moved |= (leaf[1:] != leaf[:-1]).reshape(STEPS, -1).any(axis=1)
  np.testing.assert_array_equal(moved, ~injected)
  assert poisoned["eval_loss"][-1] < 0.05 * poisoned["eval_loss"][0]


# The storm reuses the fp16 loss_scale run that the quick tier compiles in the
# "one CPU device" form; -m slow runs it in the other forms.
@pytest.mark.parametrize(
  "finite_check_form",
  [
    pytest.param(form, marks=() if form == "one CPU device" else pytest.mark.slow) for form in FORMS
  ],
  indirect=True,
)
def test_training_recovers_from_an_overflow_storm(finite_check_form):
  """Hundreds of consecutive overflows drive the scale to its floor; then it
  grows back by the rule, one factor per growth interval, and the loss keeps
  falling from where the storm found it to where a run without the storm gets."""
  config = tl.ScaleConfig()
  _, run = tl.compiled_run("loss_scale", config)  # the fp16 run compiled above
  pre, storm = 50, STEPS // 2  # the storm hits while the loss is still falling
  post = STEPS - pre - storm
  steps = np.arange(STEPS)
  stormy = (steps >= pre) & (steps < pre + storm)
  plan = tl.make_xs(
    *tl.batches(7, STEPS),
    kind=np.where(stormy, 1 + steps % 3, tl.NONE),
    leaf=steps % 4,
    elem=steps,
    poison=np.where(stormy, tl.POISONS[steps % 3], 1.0),
  )
  out = jax.device_get(run(tl.init_params(7, jnp.float16), plan))
  scale, start, end = out["scale"], pre, pre + storm  # rows: state after `row` steps

  assert scale[start] == config.max_scale  # the storm hits a run at its cap
  backoffs = int(np.log2(config.max_scale / config.min_scale))
  np.testing.assert_array_equal(
    scale[start + 1 : end + 1],
    np.maximum(
      config.max_scale * config.backoff_factor ** np.arange(1, storm + 1), config.min_scale
    ),
  )
  assert storm > 10 * backoffs  # hundreds of overflows at the floor
  assert int(out["skipped"][end]) == storm and int(out["skipped"][-1]) == storm
  for part in PARTS:
    during = rows(out[part], np.arange(start, end + 1))
    assert tree_equal(during, rows(out[part], np.full(storm + 1, start))), part
    assert tl.all_finite_np(out[part]), part

  # Recovery on schedule: one growth per interval of clean steps, up to the cap.
  k = np.arange(1, post + 1)
  growth = config.growth_factor ** (k // config.growth_interval)
  np.testing.assert_array_equal(
    scale[end + 1 :], np.minimum(config.min_scale * growth, config.max_scale)
  )
  # The loss continues to fall from where the storm found it, to where a run
  # that never had the storm gets on the same batches (its scale stays at the
  # cap: not pinned, so the two runs are close but not bitwise equal).
  loss = out["eval_loss"]
  clean = np.flatnonzero(~stormy)
  calm = jax.device_get(
    run(
      tl.init_params(7, jnp.float16),
      tl.make_xs(
        np.r_[plan["x"][clean], plan["x"][:storm]], np.r_[plan["y"][clean], plan["y"][:storm]]
      ),
    )
  )["eval_loss"][: len(clean) + 1]
  assert loss[start] < 0.1 * loss[0]
  quarter = post // 4
  recovered = loss[-quarter:].mean()
  assert recovered < 0.7 * loss[start]
  assert recovered < 1.25 * calm[-quarter:].mean()


def test_fp16_params_stay_finite_while_masters_leave_the_range_and_return():
  """Masters driven far beyond 65504 (and below -65504) for many steps, and back:
  every fp16 param is at every step its master rounded and saturated, never
  inf, and the masters follow float32 SGD exactly (numpy reference)."""
  half = 1000 if tl.LONG else 100
  lr = 1000.3 * 100 / half  # peaks near 60000 + 100_000
  w0 = np.array([60000.0, -60000.0, 30000.0, 0.5], np.float16)
  direction = np.sign(w0.astype(np.float32))
  # The gradient of sum(w * c) is c: outwards for `half` steps, then inwards.
  c = np.concatenate([np.tile(-direction, (half, 1)), np.tile(direction, (half, 1))])
  tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(lr)), init_scale=2.0**10)

  @jax.jit
  def run(params, cs):
    def body(carry, c):
      params, state = carry
      grads = jax.grad(lambda p: mpx.scale_loss(jnp.sum(p.astype(jnp.float32) * c), state))(params)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), (params, state.inner_state.master_params, state.skipped_steps)

    return jax.lax.scan(body, (params, tx.init(params)), cs)[1]

  params, masters, skipped = jax.device_get(run(jnp.asarray(w0), jnp.asarray(c)))

  expected = [w0.astype(np.float32)]
  for t in range(2 * half):
    expected.append(expected[-1] + np.float32(-lr) * c[t].astype(np.float32))
  expected = np.stack(expected[1:])
  np.testing.assert_array_equal(masters, expected)
  limit = np.float32(np.finfo(np.float16).max)
  np.testing.assert_array_equal(params, np.clip(expected, -limit, limit).astype(np.float16))
  assert np.isfinite(params.astype(np.float32)).all()
  assert not skipped.any()
  saturated = np.abs(expected) > limit
  assert saturated[:, :2].sum(axis=0).min() > half  # both signs, most of the run
  assert np.abs(expected).max() > 2 * limit
  assert not saturated[-1].any()  # back in range: the params are the masters, rounded
  np.testing.assert_array_equal(params[-1], expected[-1].astype(np.float16))

  # Without masters, the same steps turn fp16 params into inf.
  plain, plain_tx = jnp.asarray(w0), optax.sgd(lr)
  plain_state = plain_tx.init(plain)
  for t in range(int(6000 / lr) + 2):  # 60000 + 6000 > 65504
    updates, plain_state = plain_tx.update(jnp.asarray(c[t], jnp.float16), plain_state)
    plain = optax.apply_updates(plain, updates)
  assert np.isinf(np.asarray(plain[:2], np.float32)).all()


def test_the_gradients_are_checked_not_the_loss():
  """A non-finite loss whose gradients are finite (here selected away by
  ``jnp.where``) is a finite step: mpx inspects what reaches the optimizer."""
  tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(0.5)), init_scale=4.0)
  params = {"w": jnp.array([1.0, 2.0], jnp.float16)}
  state = tx.init(params)

  def loss(p):
    value = jnp.sum(p["w"].astype(jnp.float32) ** 2)
    return jnp.where(value > 0, jnp.inf, value)  # inf, with zero gradients

  value, grads = jax.value_and_grad(lambda p: mpx.scale_loss(loss(p), state))(params)
  assert np.isinf(value) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  _, state = tx.update(grads, state, params)
  assert int(state.skipped_steps) == 0 and bool(state.last_step_finite)
