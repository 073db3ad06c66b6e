"""`mixed_precision(..., skip="leaf")`: each leaf stepped or kept by its own gradient.

References are independent of the per-leaf code: the default one-verdict step
on the same gradients where every leaf is finite (the two must agree bit for
bit); where a leaf's gradient is not, every other leaf must step as the
default step does with that gradient finite, bit for bit, and the leaf's own
param and master must not move.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from treecheck import tree_equal

import mpx

MASTERS = ("full", "remainder", "24bit", "stochastic")
MOMENTS = ("full", "bfloat16", "8bit", "4bit")


def params_and_grads(steps, seed=0):
  rng = np.random.default_rng(seed)
  params = {
    "w": jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16),
    "v": jnp.asarray(rng.standard_normal((4096,)), jnp.bfloat16),
    "b": jnp.asarray(rng.standard_normal((8,)), jnp.bfloat16),
  }
  grads = [
    {k: jnp.asarray(rng.standard_normal(p.shape) * 1e-2, jnp.bfloat16) for k, p in params.items()}
    for _ in range(steps)
  ]
  return params, grads


def run(tx, params, grads):
  update = jax.jit(tx.update)
  state = tx.init(params)
  for g in grads:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def make(masters, moments, skip):
  return mpx.mixed_precision(optax.adamw(1e-2), masters=masters, moments=moments, skip=skip)


# The quick tier runs one mode of each test; the slow tier every other.
QUICK = {("stochastic", "bfloat16")}


def modes(pairs):
  return [pytest.param(m, f, marks=() if (m, f) in QUICK else pytest.mark.slow) for m, f in pairs]


@pytest.mark.parametrize("masters, moments", modes([(m, f) for m in MASTERS for f in MOMENTS]))
def test_with_every_gradient_finite_it_is_the_default_step(masters, moments):
  params, grads = params_and_grads(3)
  by_leaf = run(make(masters, moments, "leaf"), params, grads)
  by_step = run(make(masters, moments, "step"), params, grads)
  assert tree_equal(by_leaf, by_step)


# Run in a process of its own without FMA instructions: the two programs
# compute each new moment in other fusions, where XLA:CPU contracts
# multiply-adds otherwise (a scale an ulp apart, seen with 24-bit masters).
GPU_PROGRAM_WORKER = """
from lowering_forms import forced
from test_leaf_skip import MASTERS, make, params_and_grads, run
from treecheck import tree_equal

params, grads = params_and_grads(3)
for masters in MASTERS:
  for moments in ("8bit", "4bit", {"mu": "8bit", "nu": "4bit"}):
    with forced("gpu"):
      by_leaf = run(make(masters, moments, "leaf"), params, grads)
      by_step = run(make(masters, moments, "step"), params, grads)
    print(masters, moments, tree_equal(by_leaf, by_step))
"""


@pytest.mark.slow  # a process of its own: 40 s
def test_in_the_gpu_program_the_two_passes_by_leaf_code_as_the_default_step():
  """The accelerator's program codes 8- and 4-bit moments against the block
  maxima of a first pass: leaf by leaf with skip="leaf"
  (``two_pass.maxima_by_leaf``), for the whole step by default. With every
  gradient finite the two store the same bits."""
  env = {**os.environ, "XLA_FLAGS": "--xla_cpu_max_isa=AVX", "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
    [sys.executable, "-c", GPU_PROGRAM_WORKER],
    cwd=pathlib.Path(__file__).parent,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert len(lines) == 12 and all(line.endswith(" True") for line in lines), result.stdout


@pytest.mark.parametrize(
  "masters, moments",
  modes([("full", "full"), ("24bit", "4bit"), ("stochastic", "bfloat16"), ("remainder", "8bit")]),
)
def test_a_non_finite_leaf_is_kept_and_the_others_step(masters, moments, finite_check_form):
  """The poisoned leaf's param, master and moments do not move; every other
  leaf steps as the default step does on the tree without it."""
  params, grads = params_and_grads(3)
  grads[1]["v"] = grads[1]["v"].at[5].set(jnp.nan)
  tx = make(masters, moments, "leaf")
  update = jax.jit(tx.update)
  state = tx.init(params)
  before = None
  for i, g in enumerate(grads):
    if i == 1:
      before = (params["v"], mpx.master_params(state, params)["v"])
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    if i == 1:
      assert tree_equal((params["v"], mpx.master_params(state, params)["v"]), before)
  assert int(state.nonfinite_steps) == 1
  assert int(state.applied_steps) == 3
  assert bool(mpx.all_finite((params, state)))
  # The other leaves, against the default step with "v"'s gradient finite
  # (the same program's arithmetic: a tree without "v" compiles to other
  # fusions, whose multiply-adds XLA may contract otherwise).
  clean, clean_grads = params_and_grads(3)
  expected, _ = run(make(masters, moments, "step"), clean, clean_grads)
  assert tree_equal({k: params[k] for k in ("w", "b")}, {k: expected[k] for k in ("w", "b")})


def test_a_step_with_every_leaf_non_finite_moves_nothing_but_the_counts():
  params, grads = params_and_grads(1)
  poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads[0])
  tx = make("remainder", "4bit", "leaf")
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(poisoned, state, params)
  assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert int(new_state.nonfinite_steps) == 1
  assert int(new_state.applied_steps) == 0
  # The moments and masters are the old ones; Adam's count (a leaf of no
  # param) steps, as it does not wait for every gradient.
  assert tree_equal(new_state.master_remainders, state.master_remainders)
  assert tree_equal(
    jax.tree.map(lambda x: x, optax.tree.get(new_state, "mu")), optax.tree.get(state, "mu")
  )
  assert int(optax.tree.get(new_state, "count")) == 1


@pytest.mark.slow
def test_under_accumulate_a_window_steps_once():
  params, grads = params_and_grads(4)
  tx = mpx.accumulate(make("24bit", "4bit", "leaf"), 2)
  got, state = run(tx, params, grads)
  assert int(state.inner_state.applied_steps) == 2
  assert int(state.inner_state.nonfinite_steps) == 0
  reference = mpx.accumulate(make("24bit", "4bit", "step"), 2)
  expected, _ = run(reference, params, grads)
  assert tree_equal(got, expected)


def test_bad_skip_and_loss_scale_are_refused():
  with pytest.raises(ValueError, match="skip must be 'step' or 'leaf'"):
    mpx.mixed_precision(optax.adam(1e-3), skip="leaves")
  params = {"w": jnp.zeros(3, jnp.float16)}
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3), skip="leaf"))
  state = tx.init(params)
  with pytest.raises(ValueError, match="loss scale is too high for the whole step"):
    tx.update({"w": jnp.ones(3, jnp.float16)}, state, params)
