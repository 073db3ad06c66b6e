"""Every masters x moments mode shards like its params (issue 35).

The state of each of the 9 modes is laid out from its params' shardings, the
params split on their first axis, their last, or both (a 4 x 2 mesh), three
ways: ``mpx.zero1_shardings`` with ``axis=None`` (shard like the params) and
``axis="data"`` (ZeRO-1), and optax's own recipe,
``optax.tree_utils.tree_map_params``, which maps every mode with full moments
and refuses compressed ones naming ``zero1_shardings``. A jitted step then
trains there, fed fixed gradients: every optimizer operation is elementwise
(an 8-bit block's scale is a max), so two sharded steps give params and
state bit for bit those of the same steps on one device. A flax linen
``TrainState`` whose params are boxed by ``nn.with_partitioning`` gets its
state's shardings from ``nn.get_sharding`` and trains on 8 devices.

Runs on the 8 host CPU devices that conftest.py asks XLA for.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpx

MODES = [
  (masters, moments)
  for masters in ("full", "remainder", "stochastic")
  for moments in ("full", "bfloat16", "8bit")
]
# (mesh shape, axis names, param specs). w1's last axis is one 8-bit block
# (scales (64, 1)); w2's is 8 blocks of 256 (scales (16, 8)). b is too small
# to compress; norm is float32 (no master, full moments).
LAYOUTS = {
  "first": ((8,), ("data",), {"w1": P("data"), "w2": P("data"), "b": P("data"), "norm": P()}),
  "last": (
    (8,),
    ("data",),
    {"w1": P(None, "data"), "w2": P(None, "data"), "b": P(), "norm": P("data")},
  ),
  "both": (
    (4, 2),
    ("data", "model"),
    {"w1": P("data", "model"), "w2": P("model", "data"), "b": P("model"), "norm": P()},
  ),
}
# The quick tier checks every mode's layouts (cheap: no compilation) and
# trains one mode, 8-bit moments in the layout the outside check found (where
# their scales cannot take the param's spec); a training compiles a sharded
# step and its one-device reference. test_zero1 trains every masters mode
# sharded, test_multidevice ZeRO-1 against replicated and test_moments 8-bit
# moments under ZeRO-1, all in the quick tier; the slow test here trains every
# mode in every layout.
QUICK_TRAINING = {("full", "8bit"): ("last", None)}
TRAINING = [(layout, axis) for layout in LAYOUTS for axis in (None, "data")]


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  assert jax.device_count() == 8, (
    f"these tests need 8 devices (tests/conftest.py sets XLA_FLAGS), got {jax.devices()}"
  )


def make_params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {
    "w1": (jax.random.normal(k1, (64, 128)) * 0.3).astype(jnp.bfloat16),
    "w2": (jax.random.normal(k2, (16, 2048)) * 0.3).astype(jnp.bfloat16),
    "b": jnp.zeros(64, jnp.bfloat16),
    "norm": jnp.ones(64, jnp.float32),
  }


def make_grads(params):
  """Two steps of fixed gradients, in the params' dtypes."""
  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  return [
    jax.tree.map(
      lambda p, k: jax.random.normal(k, p.shape).astype(p.dtype),
      params,
      dict(zip(params, jax.random.split(key, len(params)), strict=True)),
    )
    for key in keys
  ]


def make_tx(masters, moments):
  return mpx.mixed_precision(optax.adamw(1e-2), masters=masters, moments=moments)


def train_step(tx, params, opt_state, grads):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


COMPRESSED = (mpx.Bfloat16Moment, mpx.Signed8bitMoment, mpx.Nonnegative8bitMoment)


def is_hole(x):
  return isinstance(x, optax.MaskedNode)


def on_mesh(layout):
  shape, names, specs = LAYOUTS[layout]
  mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
  return mesh, {k: NamedSharding(mesh, s) for k, s in specs.items()}


def compressed(state):
  """Returns the compressed moments of ``state``, by param name."""
  found = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: isinstance(x, COMPRESSED)
  )[0]:
    if isinstance(leaf, COMPRESSED):
      found.setdefault(path[-1].key, []).append(leaf)
  return found


def check_layout(tx, state, shardings, param_shardings, axis):
  """Every state leaf lies where ``shardings`` says, and each leaf derived
  from a param follows it: its spec (axis=None) or a refinement of it."""
  placed = jax.device_put(state, shardings)  # raises for a spec a leaf's shape refuses
  for (path, leaf), sharding in zip(
    jax.tree_util.tree_flatten_with_path(placed)[0], jax.tree.leaves(shardings), strict=True
  ):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), jax.tree_util.keystr(path)
  for name, moments in compressed(placed).items():
    param_entries = tuple(param_shardings[name].spec) + (None,) * 2
    for moment in moments:
      codes = moment[0]
      if axis is None:
        assert codes.sharding.is_equivalent_to(param_shardings[name], codes.ndim), name
        for part in moment[1:]:  # the block scales: the param's entries where they divide
          entries = tuple(part.sharding.spec) + (None,) * part.ndim
          assert entries[: part.ndim - 1] == param_entries[: part.ndim - 1], name
  if isinstance(state, mpx.MixedPrecisionStochasticState):
    for key in jax.tree.leaves(placed.rounding_keys):
      assert key.sharding.is_fully_replicated
  return placed


def check_tree_map_params(tx, state, moments, mesh, param_shardings, zero1):
  """optax's recipe maps a state with full moments like zero1_shardings(axis=None)
  does, the stochastic mode's keys through transform_non_params; it refuses
  compressed moments, naming mpx's way."""
  replicated = NamedSharding(mesh, P())

  def recipe():
    return optax.tree_utils.tree_map_params(
      tx,
      lambda leaf, sharding: leaf if is_hole(leaf) else sharding,
      state,
      param_shardings,
      transform_non_params=lambda _: replicated,
      is_leaf=is_hole,
    )

  if moments != "full":
    with pytest.raises(ValueError, match=r"mpx\.zero1_shardings\(tx, params, mesh, axis=None\)"):
      recipe()
    return
  placed = jax.device_put(state, recipe())
  expected = jax.device_put(state, zero1)
  for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(expected), strict=True):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@functools.cache
def reference(masters, moments):
  """Two steps on one device, unsharded: (params, state) after each."""
  tx = make_tx(masters, moments)
  params = make_params()
  state = tx.init(params)
  step = jax.jit(functools.partial(train_step, tx))
  history = []
  for grads in make_grads(params):
    params, state = step(params, state, grads)
    history.append((params, state))
  return history


def train_sharded(masters, moments, layout, axis):
  tx = make_tx(masters, moments)
  mesh, param_shardings = on_mesh(layout)
  params = jax.device_put(make_params(), param_shardings)
  shardings = mpx.zero1_shardings(tx, params, mesh, axis=axis)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  step = jax.jit(
    functools.partial(train_step, tx),
    in_shardings=(param_shardings, shardings, param_shardings),
    out_shardings=(param_shardings, shardings),
  )
  for (want_params, want_state), grads in zip(
    reference(masters, moments), make_grads(make_params()), strict=True
  ):
    params, state = step(params, state, jax.device_put(grads, param_shardings))
    same = jax.tree.map(
      lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
      (params, state),
      (want_params, want_state),
    )
    assert all(jax.tree.leaves(same)), (layout, axis, same)


@pytest.mark.parametrize("masters, moments", MODES)
def test_every_mode_shards_like_its_params(masters, moments):
  tx = make_tx(masters, moments)
  state = tx.init(make_params())
  if moments == "8bit":  # w1's and w2's moments are 8-bit, b's are not compressed
    assert set(compressed(state)) == {"w1", "w2"}
  for layout in LAYOUTS:
    mesh, param_shardings = on_mesh(layout)
    params = jax.device_put(make_params(), param_shardings)
    for axis in (None, "data"):
      shardings = mpx.zero1_shardings(tx, params, mesh, axis=axis)
      check_layout(tx, state, shardings, param_shardings, axis)
      if axis is None:
        check_tree_map_params(tx, state, moments, mesh, param_shardings, shardings)
  if (masters, moments) in QUICK_TRAINING:
    train_sharded(masters, moments, *QUICK_TRAINING[masters, moments])


@pytest.mark.slow
@pytest.mark.parametrize("masters, moments", MODES)
def test_every_mode_trains_in_every_layout(masters, moments):
  for layout, axis in TRAINING:
    train_sharded(masters, moments, layout, axis)


def test_eight_bit_scales_of_a_param_split_on_its_last_axis():
  """The outside check's case: a (64, 128) leaf split P(None, "data") on 8
  devices; its 8-bit block scales (64, 1) cannot take that spec."""
  mesh, _ = on_mesh("last")
  sharding = NamedSharding(mesh, P(None, "data"))
  params = {"w": jax.device_put(jnp.ones((64, 128), jnp.bfloat16), sharding)}
  tx = make_tx("full", "8bit")
  shardings = mpx.zero1_shardings(tx, params, mesh, axis=None)
  mu = shardings.inner_state[0].mu["w"]
  assert (mu.codes.spec, mu.scales.spec) == (P(None, "data"), P())
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  assert state.inner_state[0].nu["w"].scales.shape == (64, 1)


def test_tree_map_params_hands_rounding_keys_to_transform_non_params():
  """optax's recipe gives the stochastic mode's scalar keys to
  transform_non_params, never the param's sharding."""
  mesh, _ = on_mesh("last")
  sharding = NamedSharding(mesh, P(None, "data"))
  params = {"w": jax.device_put(jnp.ones((64, 128), jnp.bfloat16), sharding)}
  tx = make_tx("stochastic", "full")
  state = tx.init(params)
  seen = []
  specs = optax.tree_utils.tree_map_params(
    tx,
    lambda leaf, s: seen.append(leaf.shape) or s,
    state,
    {"w": sharding},
    transform_non_params=lambda _: NamedSharding(mesh, P()),
  )
  assert seen == [(64, 128), (64, 128)]  # mu and nu, not the key
  placed = jax.device_put(state, specs)
  assert placed.rounding_keys["w"].sharding.is_fully_replicated
  assert placed.inner_state[0].mu["w"].sharding.spec == P(None, "data")


# flax linen: params boxed by nn.with_partitioning, shardings from nn.get_sharding


# Both frictions at once (the key and the scales), and each alone; -m slow
# (four compilations for the mesh and one device each). The quick tier puts
# mpx's state on a mesh through a container in test_containers (nnx, the box
# rule linen's shares) and lays out every mode here with zero1_shardings.
LINEN_MODES = [
  pytest.param("stochastic", "full", marks=pytest.mark.slow),
  pytest.param("full", "8bit", marks=pytest.mark.slow),
  pytest.param("stochastic", "8bit", marks=pytest.mark.slow),
]


def linen_setup(masters, moments):
  from flax import linen as nn
  from flax.training import train_state

  init = nn.initializers.lecun_normal()

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(
        128,
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
        kernel_init=nn.with_partitioning(init, (None, "data")),
        bias_init=nn.with_partitioning(nn.initializers.zeros, ("data",)),
      )(x)
      out = nn.DenseGeneral(
        (8, 64),
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
        kernel_init=nn.with_partitioning(init, (None, None, "data")),
        use_bias=False,
      )(jnp.tanh(h))
      return out.reshape(x.shape[0], -1).astype(jnp.float32)

  model = Model()
  tx = make_tx(masters, moments)
  x = jax.random.normal(jax.random.PRNGKey(2), (16, 32))
  y = jax.random.normal(jax.random.PRNGKey(3), (16, 512))

  def make_state(rng):
    params = model.init(rng, x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def step(state, x, y):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  return nn, make_state, step, x, y


@pytest.mark.parametrize("masters, moments", LINEN_MODES)
def test_linen_partitioned_state_shards_and_trains(masters, moments):
  nn, make_state, step, x, y = linen_setup(masters, moments)
  rng = jax.random.PRNGKey(0)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  abstract = jax.eval_shape(make_state, rng)
  shardings = nn.get_sharding(abstract, mesh)
  state = jax.jit(make_state, out_shardings=shardings)(rng)
  inner = state.opt_state.inner_state[0]
  if masters == "stochastic":  # a scalar: unboxed, replicated
    key = state.opt_state.rounding_keys["Dense_0"]["kernel"]
    assert not isinstance(key, nn.Partitioned) and key.sharding.is_fully_replicated
  if moments == "8bit":  # the scales keep the names of the axes they share
    nu = inner.nu["DenseGeneral_0"]["kernel"]
    assert nu.codes.names == (None, None, "data") and nu.scales.names == (None, None, None)
    assert nu.scales.value.shape == (128, 8, 1)
    assert nu.codes.value.sharding.spec == P(None, None, "data")
  batch = NamedSharding(mesh, P("data"))
  sharded_step = jax.jit(step, in_shardings=(shardings, batch, batch), out_shardings=shardings)
  one_device = jax.jit(step)
  # The same initial state, copied to one device: compiling the init again for
  # one device would cost as much as a step.
  reference = jax.device_put(state, jax.devices()[0])
  for _ in range(2):
    state = sharded_step(state, x, y)
    reference = one_device(reference, x, y)
  assert jax.tree.structure(state) == jax.tree.structure(reference)
  assert int(state.opt_state.applied_steps) == 2
  got, want = nn.unbox(state.params), nn.unbox(reference.params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    # The sharded gradients are summed in another order: the params agree to
    # a bfloat16 rounding (stochastic rounding may land a float32 ulp apart).
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2)
