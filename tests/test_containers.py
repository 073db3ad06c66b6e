"""Every storage mode in the containers users keep an optimizer state in.

``nnx.Optimizer`` (and ``nnx.ModelAndOptimizer``), equinox's
``eqx.partition``/``eqx.filter_jit``, linen's ``TrainState`` and orbax
checkpoints each hold the state their own way; nnx rewraps it in
``Variable``s and rebuilds it on every update. Each test drives mpx through
one container and compares, bit for bit, with the same transformation driven
by hand on plain dicts (``tx.update`` and ``optax.apply_updates``), fed the
same gradients.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from flax import nnx
from treecheck import tree_equal

import mpx
from mpx._src import compat

BF16 = jnp.bfloat16
MASTERS = ("full", "remainder", "24bit", "stochastic")
MOMENTS = ("full", "bfloat16", "8bit")
STEPS = 3
# One masters mode per moments format where a test covers the formats alone:
# each masters mode once, each moments format once (8-bit thrice: its codes and
# block scales are the state that differs most from optax's).
PAIRS = (("full", "bfloat16"), ("remainder", "8bit"), ("24bit", "8bit"), ("stochastic", "8bit"))
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def pairs(*quick: tuple[str, str]) -> list:
  """PAIRS, those not in ``quick`` behind the slow marker. Each case compiles
  its container's step; across the containers the quick tier still meets
  every masters mode and moments format, and each container the mode whose
  state it handles least like a plain tree."""
  return [pytest.param(*mode, marks=() if mode in quick else pytest.mark.slow) for mode in PAIRS]


@functools.cache
def make_tx(masters: str, moments: str) -> optax.GradientTransformationExtraArgs:
  """One transformation per mode, shared by the tests: a step jitted for it
  (by hand, or by a container for the same tree) is compiled once."""
  rule = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
  return mpx.mixed_precision(rule, masters=masters, moments=moments, seed=7)


def gradient(step: int, like: Any) -> Any:
  """The same made-up gradients in every container: a draw per step and per
  leaf's path (``"body/kernel"`` in a dict, an nnx ``State`` or a module)."""

  def draw(path: Any, x: Any) -> jax.Array:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    key = jax.random.fold_in(jax.random.PRNGKey(step), zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return jax.random.normal(key, np.shape(x), jnp.float32).astype(x.dtype)

  return jax.tree_util.tree_map_with_path(draw, like)


@functools.cache
def by_hand_step(tx: optax.GradientTransformation):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run_by_hand(
  tx: optax.GradientTransformation, params: dict, stop: int, state: Any = None, start: int = 0
) -> tuple[dict, Any]:
  """The reference: plain dicts, ``tx.update`` and ``optax.apply_updates``,
  steps ``start`` to ``stop`` from ``state`` (``tx.init``'s by default)."""
  step = by_hand_step(tx)
  state = tx.init(params) if state is None else state
  for i in range(start, stop):
    params, state = step(params, state, gradient(i, params))
  return params, state


def by_path(tree: Any) -> dict[str, Any]:
  """Leaves keyed by their path as ``"a/b/0"``: a dict and an nnx ``State``
  (or a NamedTuple and its fields) with the same keys give the same paths."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in flat}


def assert_same_leaves(actual: Any, expected: Any) -> None:
  a, e = by_path(actual), by_path(expected)
  assert a.keys() == e.keys()
  a = {path: np.asarray(x) for path, x in a.items()}
  e = {path: np.asarray(x) for path, x in e.items()}
  for path in a:
    assert a[path].dtype == e[path].dtype, path
    np.testing.assert_array_equal(a[path], e[path], err_msg=path)


@pytest.fixture
def count_compilations(without_persistent_cache):
  del without_persistent_cache
  compiled: list[float] = []

  def listener(event, duration_secs, **kwargs):
    if event == BACKEND_COMPILE:
      compiled.append(duration_secs)

  jax.monitoring.register_event_duration_secs_listener(listener)
  yield compiled
  jax_versions.unregister_event_duration_listener(listener)


# ----------------------------------------------------------------------------
# flax nnx


class NnxModel(nnx.Module):
  """A bf16 layer big enough for compressed moments (64 x 128), a small bf16
  head, and a float32 norm (a param with no master)."""

  def __init__(self, rngs: nnx.Rngs, sharded: bool = False):
    kernel_init = nnx.initializers.lecun_normal()
    bias_init = nnx.initializers.zeros_init()
    if sharded:
      kernel_init = nnx.with_partitioning(kernel_init, ("data", "model"))
      bias_init = nnx.with_partitioning(bias_init, ("model",))
    self.body = nnx.Linear(
      64, 128, param_dtype=BF16, kernel_init=kernel_init, bias_init=bias_init, rngs=rngs
    )
    self.norm = nnx.LayerNorm(128, param_dtype=jnp.float32, rngs=rngs)
    self.head = nnx.Linear(128, 4, param_dtype=BF16, rngs=rngs)


def pure_params(model: nnx.Module) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@nnx.jit
def nnx_step(model: nnx.Module, optimizer: nnx.Optimizer, grads: Any) -> None:
  optimizer.update(model, grads)


@functools.cache
def nnx_reference(masters: str, moments: str) -> tuple[dict, Any]:
  """``STEPS`` steps by hand from ``NnxModel``'s initial params."""
  return run_by_hand(make_tx(masters, moments), pure_params(NnxModel(nnx.Rngs(0))), STEPS)


def nnx_grads(model: nnx.Module, step: int) -> nnx.State:
  """``gradient(step)`` shaped like ``nnx.grad``'s output for ``model``."""
  grads = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(grads, gradient(step, pure_params(model)))
  return grads


@jax_versions.requires_flax("0.11.0", "an nnx.Optimizer that wraps its state in Variables")
def test_nnx_optimizer_on_flax_0_11_names_the_version_it_needs(monkeypatch):
  # flax 0.11 and 0.12.0 wrap the state in Variables mpx cannot rewrap.
  import flax

  monkeypatch.setattr(flax, "__version__", "0.11.2")
  model = NnxModel(nnx.Rngs(0))
  with pytest.raises(
    ValueError, match=r"nnx\.Optimizer needs flax >= 0\.12\.1.*this is flax 0\.11\.2"
  ):
    nnx.Optimizer(model, make_tx("full", "full"), wrt=nnx.Param)


# Each masters mode and each moments format once (-m slow): what nnx rewraps
# is each state class, and a masters mode's class does not change with the
# moments beside it. The dependency floors run remainder-8bit (masters and
# 8-bit codes: the state nnx rewraps least like a plain tree); full masters
# in nnx are also test_flax's, stochastic masters and bfloat16 moments the
# equinox, orbax and linen tests'.
NNX_FLOORS = (("remainder", "8bit"),)
NNX_MODES = (("full", "bfloat16"), ("remainder", "8bit"), ("24bit", "8bit"), ("stochastic", "full"))


def test_the_nnx_modes_hold_every_masters_mode_and_moments_format():
  assert {m for m, _ in NNX_MODES} == set(MASTERS) and {n for _, n in NNX_MODES} == set(MOMENTS)


@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "mpx inside nnx.Optimizer")
@pytest.mark.parametrize(
  ("masters", "moments"),
  [pytest.param(*mode, marks=() if mode in NNX_FLOORS else pytest.mark.slow) for mode in NNX_MODES],
)
@pytest.mark.slow
@pytest.mark.floors
def test_nnx_optimizer_trains_as_the_transformation_driven_by_hand(
  masters, moments, count_compilations
):
  tx = make_tx(masters, moments)
  model = NnxModel(nnx.Rngs(0))
  expected_params, expected_state = nnx_reference(masters, moments)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = [nnx_grads(model, i) for i in range(STEPS)]
  before = len(count_compilations)
  nnx_step(model, optimizer, grads[0])
  # At most one compilation (none where an earlier test compiled this step for
  # the same transformation), and none after: one step program for every step.
  assert len(count_compilations) - before <= 1
  before = len(count_compilations)
  for g in grads[1:]:
    nnx_step(model, optimizer, g)
  assert len(count_compilations) == before

  assert_same_leaves(pure_params(model), expected_params)
  state = nnx.as_pure(optimizer.opt_state)
  assert_same_leaves(state, expected_state)
  # The stored moments keep their types (nnx used to rebuild them as States).
  assert type(state) is type(expected_state)
  got, want = (optax.tree.get(s, "mu")["body"]["kernel"] for s in (state, expected_state))
  assert type(got) is type(want)


@pytest.mark.slow  # 12 s; test_flax.py trains nnx.Optimizer in the quick tier
@pytest.mark.floors
@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "mpx inside nnx.Optimizer")
def test_nnx_model_and_optimizer_trains_as_the_transformation_driven_by_hand():
  if not hasattr(nnx, "ModelAndOptimizer"):
    pytest.skip("this flax has no nnx.ModelAndOptimizer")
  tx = make_tx("remainder", "8bit")
  model = NnxModel(nnx.Rngs(0))
  expected_params, expected_state = nnx_reference("remainder", "8bit")
  optimizer = nnx.ModelAndOptimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(optimizer, grads):
    optimizer.update(grads)

  for i in range(STEPS):
    step(optimizer, nnx_grads(model, i))
  assert_same_leaves(pure_params(model), expected_params)
  assert_same_leaves(nnx.as_pure(optimizer.opt_state), expected_state)


# On the floors: masters that sync_masters edits (remainder), beside 8-bit moments that
# the functions must leave as stored (stochastic, with no masters to sync, is
# test_sync_masters' in the quick tier).
@pytest.mark.slow
@pytest.mark.floors
@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "mpx inside nnx.Optimizer")
@pytest.mark.parametrize(("masters", "moments"), pairs(("remainder", "8bit")))
def test_mpx_functions_work_on_an_nnx_optimizer_state(masters, moments):
  tx = make_tx(masters, moments)
  model = NnxModel(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for i in range(STEPS):
    nnx_step(model, optimizer, nnx_grads(model, i))
  _, expected_state = nnx_reference(masters, moments)
  state = nnx.as_pure(optimizer.opt_state)
  params = nnx.as_pure(nnx.state(model, nnx.Param))  # the tree the state was made for

  assert_same_leaves(mpx.inner_state(state), mpx.inner_state(expected_state))
  masters_view = mpx.master_params(state, params)
  assert by_path(masters_view).keys() == by_path(params).keys()
  assert {np.dtype(x.dtype) for x in jax.tree.leaves(masters_view)} == {np.dtype(jnp.float32)}
  assert_same_leaves(masters_view, mpx.master_params(expected_state, pure_params(model)))

  adjusted = mpx.adjust(state, learning_rate=3e-3)
  assert float(optax.tree.get(adjusted, "learning_rate")) == pytest.approx(3e-3)
  nnx.update(optimizer.opt_state, nnx.state(adjusted))
  nnx_step(model, optimizer, nnx_grads(model, STEPS))
  lr = optax.tree.get(nnx.as_pure(optimizer.opt_state), "learning_rate")
  assert float(lr) == pytest.approx(3e-3)

  # An edit outside the optimizer (a pruned row) is taken up by the masters.
  model.body.kernel[...] = model.body.kernel[...].at[0].set(0)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  synced = mpx.sync_masters(nnx.as_pure(optimizer.opt_state), params)
  if masters != "stochastic":  # the pruned row's masters round to the pruned params
    row = mpx.master_params(synced, params)["body"]["kernel"][0]
    np.testing.assert_array_equal(row.astype(BF16).astype(jnp.float32), 0)
  nnx.update(optimizer.opt_state, nnx.state(synced))
  nnx_step(model, optimizer, nnx_grads(model, STEPS + 1))  # the synced state still steps
  assert np.abs(np.asarray(model.body.kernel[...][0], np.float32)).max() < 0.1


# The optimizer is built eagerly (each operation of its init compiled for the
# mesh on its own: about 10 s for 8-bit moments on 2 cores) or under nnx.jit,
# as flax's guide builds sharded state. The floors run remainder-8bit
# under nnx.jit: the stored leaves of the kernel's shape are then its masters'
# remainders and its moments' codes, beside block scales. The slow tier builds
# every pair of PAIRS eagerly (full-bfloat16: bfloat16 values).
@jax_versions.requires_flax(compat.NNX_NEEDS_FLAX, "mpx inside nnx.Optimizer")
@pytest.mark.parametrize(
  ("masters", "moments", "init"),
  [pytest.param("remainder", "8bit", "nnx.jit")]
  + [pytest.param(*mode, "eager", marks=pytest.mark.slow) for mode in PAIRS]
  # 4-bit codes, two a byte along the kernel's last axis, split as it is.
  + [pytest.param("24bit", "4bit", "eager", marks=pytest.mark.slow)],
)
@pytest.mark.slow
@pytest.mark.floors
def test_nnx_optimizer_state_is_sharded_like_the_params_on_a_mesh(masters, moments, init):
  assert len(jax.devices()) == 8, "tests/conftest.py sets 8 host devices"
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tx = make_tx(masters, moments)

  def make_optimizer(model):
    return nnx.Optimizer(model, tx, wrt=nnx.Param)

  with jax_versions.set_mesh(mesh):
    model = NnxModel(nnx.Rngs(0), sharded=True)
    optimizer = (nnx.jit(make_optimizer) if init == "nnx.jit" else make_optimizer)(model)
    for i in range(2):
      nnx_step(model, optimizer, nnx_grads(model, i))
  specs = {
    path: tuple(x.sharding.spec)
    for path, x in by_path(nnx.as_pure(optimizer.opt_state)).items()
    if path.endswith(("body/kernel", "body/kernel/codes", "body/kernel/values")) and x.ndim
  }
  assert specs  # every stored leaf of the kernel's shape, sharded as the kernel is
  assert set(specs.values()) == {("data", "model")}, specs
  scales = {
    path: tuple(x.sharding.spec)
    for path, x in by_path(nnx.as_pure(optimizer.opt_state)).items()
    if path.endswith("body/kernel/scales")
  }
  # A block scale per row: rows sharded as the kernel's, its blocks whole.
  assert set(scales.values()) <= {("data", None)}
  assert bool(scales) == (moments in ("8bit", "4bit"))


# ----------------------------------------------------------------------------
# equinox, linen TrainState, orbax


def dict_params() -> dict:
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  return {
    "body": jax.random.normal(keys[0], (64, 128)).astype(BF16) * 0.1,
    "bias": jnp.zeros((128,), BF16),
    "scale": jnp.ones((128,), jnp.float32),
  }


@functools.cache
def dict_reference(masters: str, moments: str, stop: int) -> tuple[dict, Any]:
  """``stop`` steps by hand from ``dict_params()``."""
  return run_by_hand(make_tx(masters, moments), dict_params(), stop)


# Quick: rounding keys and 8-bit codes through eqx.partition and eqx.filter.
@pytest.mark.parametrize(("masters", "moments"), pairs(("stochastic", "8bit")))
def test_equinox_partitioned_model_and_state_train_as_by_hand(masters, moments):
  eqx = pytest.importorskip("equinox")

  class Model(eqx.Module):
    body: jax.Array
    bias: jax.Array
    scale: jax.Array
    name: str = eqx.field(static=True, default="m")

  params = dict_params()
  tx = make_tx(masters, moments)
  model = Model(params["body"], params["bias"], params["scale"])
  trainable, static = eqx.partition(model, eqx.is_inexact_array)
  # The reference runs on the same tree: the moments' random bits follow the
  # order of the leaves, which a module's fields set.
  expected_params, expected_state = run_by_hand(tx, trainable, STEPS)
  state = tx.init(trainable)

  @eqx.filter_jit
  def step(trainable, state, grads):
    updates, state = tx.update(grads, state, trainable)
    return optax.apply_updates(trainable, updates), state  # keeps each dtype

  for i in range(STEPS):
    trainable, state = step(trainable, state, gradient(i, trainable))
    state = eqx.filter(state, eqx.is_array)  # as a user filtering a saved pytree would
  model = eqx.combine(trainable, static)
  assert model.name == "m"
  assert tree_equal(eqx.filter(model, eqx.is_array), expected_params)
  assert tree_equal(state, expected_state)


# Quick: full masters with bfloat16 moments, a pair no other quick container
# test takes (the nnx tests, -m slow, take every pair).
@pytest.mark.parametrize(("masters", "moments"), pairs(("full", "bfloat16")))
def test_linen_train_state_trains_as_by_hand(masters, moments):
  from flax.training import train_state

  params = dict_params()
  tx = make_tx(masters, moments)
  expected_params, expected_state = dict_reference(masters, moments, STEPS)
  ts = train_state.TrainState.create(apply_fn=lambda p, x: x, params=params, tx=tx)
  step = jax.jit(lambda ts, grads: ts.apply_gradients(grads=grads))
  for i in range(STEPS):
    ts = step(ts, gradient(i, ts.params))
  assert tree_equal(ts.params, expected_params)
  assert tree_equal(ts.opt_state, expected_state)


# Quick: rounding keys and 8-bit codes restored into the init state's types.
@pytest.mark.parametrize(("masters", "moments"), pairs(("stochastic", "8bit")))
def test_orbax_restore_with_the_init_state_as_target_continues_bitwise(tmp_path, masters, moments):
  ocp = pytest.importorskip("orbax.checkpoint")
  params = dict_params()
  tx = make_tx(masters, moments)
  expected_params, expected_state = dict_reference(masters, moments, STEPS + 1)

  params_1, state_1 = dict_reference(masters, moments, STEPS)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params_1, "opt_state": state_1})
  checkpointer.wait_until_finished()
  target = {"params": params, "opt_state": tx.init(params)}
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  assert tree_equal(restored["opt_state"], state_1)

  resumed = run_by_hand(tx, restored["params"], STEPS + 1, restored["opt_state"], STEPS)
  assert tree_equal(resumed, (expected_params, expected_state))

  bare = checkpointer.restore(tmp_path / "ckpt")  # no target: dicts
  with pytest.raises(TypeError, match=r"restore it with the state from tx\.init as the target"):
    tx.update(gradient(STEPS, params), bare["opt_state"], restored["params"])
