"""ZeRO-1 steps whose shardings settle: the documented step compiles once.

A jitted step is compiled again when an input's layout differs from the one
it was compiled for. Left to XLA, the new parameters come back split like
their masters, so the documented step pins them in ``out_shardings``. And jit
keys its cache on ``NamedSharding`` equality, spelling included
(``P('data', None)`` is not ``P('data')``): ``zero1_shardings`` spells each
spec the way jax names what XLA picks, so a state leaf comes back equal to its
entry even where only the parameters are pinned. The reference for "what XLA
picks" is XLA itself: the state a step returns with its sharding unpinned.
Counted over several steps: XLA compilations (jax's compile events) and
entries in the step's jit cache.

Runs on the 8 host CPU devices that conftest.py asks XLA for.
"""

import contextlib

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from treecheck import tree_equal

import mpx

STEPS = 4
SKIPPED = 2  # a NaN in this step's batch: every mode skips it
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# Each test counts compilations (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("without_persistent_cache")

MESHES = {
  "data8": ((8,), ("data",)),
  "data4xmodel2": ((4, 2), ("data", "model")),
  "data8xmodel1": ((8, 1), ("data", "model")),  # XLA drops the size-1 axis from its specs
}
PARAM_SPECS = {
  1: {"w1": P(), "b1": P(), "w2": P(), "norm": P(), "odd": P()},
  2: {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "norm": P(), "odd": P()},
}


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  assert len(jax.devices()) == 8, (
    f"these tests need 8 devices (tests/conftest.py sets XLA_FLAGS), got {jax.devices()}"
  )


@contextlib.contextmanager
def counting_compilations():
  """Yields a list that gets one entry per XLA compilation inside the block."""
  compiled = []

  def listener(event, duration_secs, **kwargs):
    if event == BACKEND_COMPILE:
      compiled.append(duration_secs)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield compiled
  finally:
    jax_versions.unregister_event_duration_listener(listener)


def setup(mesh_name, masters, loss_scaled):
  shape, names = MESHES[mesh_name]
  mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
  param_shardings = {k: NamedSharding(mesh, s) for k, s in PARAM_SPECS[len(shape)].items()}
  # fp16 needs the loss scale; the compact modes store bfloat16 params only.
  dtype = jnp.float16 if masters == "full" and loss_scaled else jnp.bfloat16
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {
    "w1": jax.random.normal(k1, (16, 64)) * 0.3,
    "b1": jnp.zeros(64),
    "w2": jax.random.normal(k2, (64, 8)) * 0.3,
    "norm": jnp.ones(64),  # float32: no master, but sharded moments
    "odd": jax.random.normal(k3, (3, 5)),  # no dimension divides: stays replicated
  }
  params = mpx.cast_tree(params, dtype, where=lambda path, leaf: path != "norm")
  params = jax.device_put(params, param_shardings)  # zero1_shardings reads their specs
  xs = np.array(jax.random.normal(k4, (STEPS, 32, 16)))
  xs[SKIPPED, 3, 0] = np.nan
  batch = NamedSharding(mesh, P("data"))
  batches = [(jax.device_put(x, batch), jax.device_put(np.zeros((32, 8)), batch)) for x in xs]
  tx = mpx.mixed_precision(optax.adamw(1e-2), masters=masters)
  if loss_scaled:
    tx = mpx.loss_scale(tx, growth_interval=2)
  return mesh, tx, params, param_shardings, batch, batches


def loss_fn(p, x, y):
  dtype = p["w1"].dtype
  h = jnp.tanh(x.astype(dtype) @ p["w1"] + p["b1"]) * p["norm"].astype(dtype)
  extra = jnp.sum(p["odd"].astype(jnp.float32) ** 2) * 1e-3
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2) + extra


def jit_step(tx, param_shardings, **jit_kwargs):
  """The step of docs/multi_device.md, jitted with ``jit_kwargs``."""

  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x, y), opt_state))(params)
    grads = jax.lax.with_sharding_constraint(grads, param_shardings)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, **jit_kwargs)


def run(tx, params, param_shardings, state_shardings, batches, step):
  """Steps from a fresh state.

  Returns every step's (params, state), the number of XLA compilations and
  the number of entries in the step's jit cache. They differ where a call
  brings shardings that differ only in spelling: jit adds an entry (the call
  leaves the fast C++ dispatch path) and finds the executable it already
  compiled for the equivalent layout.
  """
  params = jax.device_put(jax.tree.map(np.asarray, params), param_shardings)
  opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  history = []
  with counting_compilations() as compiled:
    for x, y in batches:
      params, opt_state = step(params, opt_state, x, y)
      history.append((params, opt_state))
  return history, len(compiled), step._cache_size()


def mismatches(tree, shardings):
  """Leaves whose sharding is not *equal* (spelling included) to their entry."""
  found = []

  def check(path, leaf, sharding):
    if not isinstance(leaf, optax.MaskedNode) and (
      leaf.sharding != sharding or hash(leaf.sharding) != hash(sharding)
    ):
      found.append((jax.tree_util.keystr(path), leaf.sharding.spec, sharding.spec))

  is_hole = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  jax.tree_util.tree_map_with_path(check, tree, shardings, is_leaf=is_hole)
  return found


# Every masters mode with and without loss_scale on the data-parallel mesh,
# and the two other meshes. Each case compiles its step twice; the floors
# take two (float32 masters on fp16 params, int16 remainders, the loss
# scale's scalars, tensor-parallel specs); -m slow adds the rest (rounding
# keys, bare steps, and a size-1 axis that XLA drops from its specs).
FLOORS = {
  ("data8", "remainder", True),
  ("data4xmodel2", "full", True),
}
MATRIX = [("data8", m, ls) for m in ("full", "remainder", "stochastic") for ls in (False, True)]
MATRIX += [("data4xmodel2", "full", True), ("data4xmodel2", "remainder", False)]
MATRIX += [("data8xmodel1", "full", True), ("data8xmodel1", "stochastic", False)]
CASES = [
  pytest.param(
    *case,
    id=f"{case[0]}-{case[1]}-{'loss_scale' if case[2] else 'bare'}",
    marks=() if case in FLOORS else pytest.mark.slow,
  )
  for case in MATRIX
]


@pytest.mark.slow
@pytest.mark.floors
@pytest.mark.parametrize("mesh_name, masters, loss_scaled", CASES)
def test_the_documented_step_compiles_once_and_the_shardings_settle(
  mesh_name, masters, loss_scaled
):
  mesh, tx, params, param_shardings, batch, batches = setup(mesh_name, masters, loss_scaled)
  state_shardings = mpx.zero1_shardings(tx, params, mesh)

  # The docs' recipe: parameters, state and batch pinned in and out.
  recipe = jit_step(
    tx,
    param_shardings,
    in_shardings=(param_shardings, state_shardings, batch, batch),
    out_shardings=(param_shardings, state_shardings),
  )
  history, compiled, cached = run(tx, params, param_shardings, state_shardings, batches, recipe)
  assert (compiled, cached) == (1, 1)
  for params_after, state_after in history:
    assert mismatches(params_after, param_shardings) == []
    assert mismatches(state_after, state_shardings) == []
  assert tree_equal(history[SKIPPED][0], history[SKIPPED - 1][0])  # the NaN step was skipped
  assert not tree_equal(history[-1][0], history[SKIPPED][0])  # and the next one applied

  # Only the parameters pinned: XLA lays out the state, and what it returns is
  # exactly the tree zero1_shardings made (a differently spelled spec would
  # make the second call compile again).
  params_only = jit_step(tx, param_shardings, out_shardings=(param_shardings, None))
  free_state, compiled, cached = run(
    tx, params, param_shardings, state_shardings, batches, params_only
  )
  assert [mismatches(s, state_shardings) for _, s in free_state] == [[]] * STEPS
  assert (compiled, cached) == (1, 1)

  # Arithmetic does not depend on the layout: the same training, bit for bit.
  assert tree_equal(free_state[-1], history[-1])


# What XLA does with a step the docs tell users not to write: a release's check
# that docs/multi_device.md still describes the newest jax, for -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["data8", "data4xmodel2"])
def test_unpinned_params_come_back_split_like_their_masters_and_recompile(mesh_name):
  """What docs/multi_device.md says happens without ``out_shardings``."""
  mesh, tx, params, param_shardings, _, batches = setup(mesh_name, "full", True)
  state_shardings = mpx.zero1_shardings(tx, params, mesh)
  history, compiled, cached = run(
    tx, params, param_shardings, state_shardings, batches, jit_step(tx, param_shardings)
  )
  assert (compiled, cached) == (2, 2)  # the first call's outputs are laid out otherwise
  masters = history[0][1].inner_state.master_params
  adam = history[0][1].inner_state.inner_state[0]
  for name, param in history[0][0].items():
    # Each new param is computed from its master's slice (norm, with no master,
    # from its moments' slice) and left there: not replicated any more.
    state_leaf = adam.mu[name] if name == "norm" else masters[name]
    assert param.sharding.is_equivalent_to(state_leaf.sharding, param.ndim), name
    if name != "odd":
      assert not param.sharding.is_equivalent_to(param_shardings[name], param.ndim), name
  for _, state_after in history:
    assert mismatches(state_after, state_shardings) == []  # the state itself settles
  assert mismatches(history[-1][0], jax.tree.map(lambda a: a.sharding, history[0][0])) == []
