"""Every masters x moments mode shards like its params, in every place.

The modes are read from the code (``storage.MODES`` for ``masters=``,
``moments.FORMATS`` for ``moments=``, plus a per-field mapping and a rule
with its own ``moment_fields``), so a new mode joins this matrix by being
added to the library. Each mode's state is laid out from its params'
shardings, the params split on their first axis, their last, or both (a
4 x 2 mesh), four ways: ``mpx.zero1_shardings`` with ``axis=None`` (shard
like the params) and ``axis="data"`` (ZeRO-1); optax's own recipe,
``optax.tree_utils.tree_map_params``, which maps every mode with full
moments and refuses compressed ones naming ``zero1_shardings``; and flax
linen boxes (``nn.Partitioned``, as ``nn.with_partitioning`` makes them),
whose names ``nn.get_sharding`` turns into shardings. Each public function
is tried on the boxed params against the same call on the bare ones.

A jitted step then trains there, fed fixed gradients: every optimizer
operation is elementwise (a block's scale is a max), so the sharded steps
give params and state bit for bit those of the same steps on one device.
With -m slow each mode trains so in one of the six layout x axis pairs (each
pair by four modes) and through linen boxes in one layout.

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
from mpx._src import moments as moments_lib
from mpx._src import storage

MASTERS = tuple(storage.MODES)
# Adan's fields, named with their signs: a rule whose moments are not optax's mu/nu.
ADAN_FIELDS = {"m": "signed", "v": "signed", "n": "nonnegative"}
MOMENTS = {
  **{name: {"moments": name} for name in moments_lib.FORMATS},
  "per-field": {"moments": {"mu": "8bit", "nu": "4bit"}},
  "adan fields": {"moments": "4bit", "moment_fields": ADAN_FIELDS},
}
MODES = [(masters, moments) for masters in MASTERS for moments in MOMENTS]
# (mesh shape, axis names, param specs). w1's last axis is one 8-bit block, two
# 4-bit ones; w2's is 8 blocks of 256 (16 of 128 in 4 bits). b is too small
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
# The floors lay every mode out (no compilation) and try the public
# functions on boxes for the mode of the outside checks (4-bit codes and the
# stochastic keys under boxes); tests/test_zero1.py and test_multidevice.py
# train sharded there. With -m slow every mode trains, sharded and through
# boxes (after the public functions' checks on them).
FLOORS_BOXES = {("stochastic", "4bit")}
TRAINING = [(layout, axis) for layout in LAYOUTS for axis in (None, "data")]


def slow_training(mode):
  """Returns the (layout, axis) pair ``mode`` trains in with -m slow, in turn
  over the modes: each pair is trained by a sixth of them (every mode in every
  pair would take CI's budget; the layouts of every pair are checked for every
  mode, on the floors too, and every mode also trains through linen boxes)."""
  return [TRAINING[MODES.index(mode) % len(TRAINING)]]


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  assert len(jax.devices()) == 8, (
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
  setting = MOMENTS[moments]
  rule = optax.adan(1e-2) if "moment_fields" in setting else optax.adamw(1e-2)
  return mpx.mixed_precision(rule, masters=masters, **setting)


def train_step(tx, params, opt_state, grads):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


COMPRESSED = (
  mpx.Bfloat16Moment,
  mpx.Signed8bitMoment,
  mpx.Nonnegative8bitMoment,
  mpx.Signed4bitMoment,
  mpx.Nonnegative4bitMoment,
)


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


def entries(sharding, ndim):
  """Returns a sharding's (or a PartitionSpec's) entries, one per axis of ``ndim``."""
  spec = sharding if isinstance(sharding, P) else sharding.spec
  return (tuple(spec) + (None,) * ndim)[:ndim]


def check_layout(state, shardings, param_shardings, axis):
  """Every state leaf lies where ``shardings`` says, and each compressed
  moment follows its param: with ``axis=None`` its codes (or bfloat16 values)
  take the param's spec, its block scales the param's entries before the last
  axis; with ZeRO-1 each part is split over ``axis`` too, where it divides."""
  placed = jax.device_put(state, shardings)  # raises for a spec a leaf's shape refuses
  for (path, leaf), sharding in zip(
    jax.tree_util.tree_flatten_with_path(placed)[0], jax.tree.leaves(shardings), strict=True
  ):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), jax.tree_util.keystr(path)
  for name, moments in compressed(placed).items():
    param_entries = entries(param_shardings[name], 2)
    for moment in moments:
      codes, *scales = moment
      if axis is None:
        assert entries(codes.sharding, codes.ndim) == param_entries, (name, type(moment))
        for part in scales:
          assert entries(part.sharding, part.ndim)[:-1] == param_entries[:-1], name
      else:
        # ZeRO-1 on 8 devices: each of these codes is split over "data".
        assert any("data" in str(e) for e in entries(codes.sharding, codes.ndim)), name
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


def bits_equal(a, b):
  """Tells whether two trees hold the same structure and the same bits."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(
    np.asarray(x).dtype == np.asarray(y).dtype
    and np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


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


def check_steps_bitwise(tx, reference_steps, params, state, shardings, param_shardings, put):
  """Two jitted steps placed by ``shardings``, fed the fixed gradients (placed
  by ``put``), give the one-device ``reference_steps``' bits (unboxed)."""
  step = jax.jit(
    functools.partial(train_step, tx),
    in_shardings=(param_shardings, shardings, param_shardings),
    out_shardings=(param_shardings, shardings),
  )
  for (want_params, want_state), grads in zip(
    reference_steps, make_grads(make_params()), strict=True
  ):
    params, state = step(params, state, jax.device_put(put(grads), param_shardings))
    assert bits_equal(unboxed((params, state)), (want_params, want_state))


def train_sharded(masters, moments, layout, axis):
  tx = make_tx(masters, moments)
  mesh, param_shardings = on_mesh(layout)
  params = jax.device_put(make_params(), param_shardings)
  shardings = mpx.zero1_shardings(tx, params, mesh, axis=axis)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  reference_steps = reference(masters, moments)
  check_steps_bitwise(tx, reference_steps, params, state, shardings, param_shardings, lambda g: g)


@pytest.mark.slow
@pytest.mark.floors
@pytest.mark.parametrize("masters, moments", MODES)
def test_every_mode_shards_like_its_params(masters, moments):
  tx = make_tx(masters, moments)
  state = tx.init(make_params())
  if moments not in ("full", "adan fields"):  # w1's and w2's moments only: b is too small
    assert set(compressed(state)) == {"w1", "w2"}
  for layout in LAYOUTS:
    mesh, param_shardings = on_mesh(layout)
    params = jax.device_put(make_params(), param_shardings)
    for axis in (None, "data"):
      shardings = mpx.zero1_shardings(tx, params, mesh, axis=axis)
      check_layout(state, shardings, param_shardings, axis)
      if axis is None:
        check_tree_map_params(tx, state, moments, mesh, param_shardings, shardings)


def test_every_layout_and_axis_is_trained_by_some_modes():
  trained = [pair for mode in MODES for pair in slow_training(mode)]
  assert {pair: trained.count(pair) for pair in TRAINING} == {
    pair: len(MODES) // len(TRAINING) for pair in TRAINING
  }


def test_the_matrix_holds_every_mode_of_the_library():
  """A new masters= mode or moments= format joins the matrix by being added to
  the library: the lists above are read from it."""
  assert {m for m, _ in MODES} == set(storage.MODES) == {"full", "remainder", "24bit", "stochastic"}
  formats = {name for name in MOMENTS if name in moments_lib.FORMATS}
  assert formats == set(moments_lib.FORMATS) == {"full", "bfloat16", "8bit", "4bit"}


# flax linen: params boxed as nn.with_partitioning boxes them, shardings from
# nn.get_sharding, and every public function on the boxes.


def boxed(tree, layout):
  """Returns ``tree`` (shaped like make_params()) with each leaf in an
  ``nn.Partitioned`` box named after the layout's spec."""
  from flax import linen as nn

  specs = LAYOUTS[layout][2]
  return {k: nn.Partitioned(v, names=entries(specs[k], np.ndim(v))) for k, v in tree.items()}


def unboxed(tree):
  from flax import linen as nn

  return nn.unbox(tree)


def raised(call):
  """Returns the message of the ValueError ``call()`` raises, or None."""
  try:
    call()
  except ValueError as error:
    return str(error)
  return None


def check_public_functions_on_boxes(masters, moments, layout):
  """Each public function takes the boxed params (and the state made of them)
  and gives what it gives on the bare ones, unboxed; every message that names
  leaves names them as for the bare ones."""
  from flax import linen as nn

  tx = make_tx(masters, moments)
  bare = make_params()
  params = boxed(bare, layout)
  state, bare_state = tx.init(params), tx.init(bare)
  assert bits_equal(unboxed(state), bare_state)
  # The masters: float32 for every leaf with one, inside a box or not.
  masters_tree = mpx.master_params(state, params)
  assert all(isinstance(v, nn.Partitioned) for v in masters_tree.values())
  assert bits_equal(unboxed(masters_tree), mpx.master_params(bare_state, bare))
  assert {str(v.dtype) for v in unboxed(masters_tree).values()} == {"float32"}
  assert bits_equal(unboxed(mpx.inner_state(state)), mpx.inner_state(bare_state))
  assert bits_equal(unboxed(mpx.sync_masters(state, params)), mpx.sync_masters(bare_state, bare))
  mpx.check_master_precision(state)
  # A step, through the boxes.
  grads = make_grads(bare)[0]
  updates, new_state = tx.update(boxed(grads, layout), state, params)
  assert bits_equal(unboxed((updates, new_state)), tx.update(grads, bare_state, bare))
  # Seeded from float32 weights: the same masters, or the same refusal.
  full = jax.tree.map(lambda v: v.astype(jnp.float32), bare)
  boxed_full = boxed(full, layout)
  init = functools.partial(mpx.init_from_full_precision, tx, param_dtype=jnp.bfloat16)
  assert raised(lambda: init(boxed_full)) == raised(lambda: init(full))
  if masters in ("24bit", "stochastic"):  # every cast leaf, by the name it has in the tree
    assert "4 (b, norm, w1, w2) are under masters=" in raised(lambda: init(boxed_full))
  got = init(boxed_full, allow_rounding=True)
  assert bits_equal(unboxed(got), init(full, allow_rounding=True))
  # Another masters= mode, from the boxed state.
  other = "full" if masters != "full" else "remainder"
  other_tx = make_tx(other, moments)
  switched = mpx.switch_masters(other_tx, state, params)
  assert bits_equal(unboxed(switched), mpx.switch_masters(other_tx, bare_state, bare))
  return tx, params, state


def check_boxed_layout(tx, params, state, layout):
  """nn.get_sharding lays the boxed state out as zero1_shardings(axis=None)
  lays the bare one out from the params' shardings, and zero1_shardings takes
  the boxed params itself."""
  from flax import linen as nn

  mesh, param_shardings = on_mesh(layout)
  by_names = nn.get_sharding(state, mesh)
  placed = jax.device_put(state, by_names)
  like_params = mpx.zero1_shardings(tx, jax.device_put(make_params(), param_shardings), mesh, None)
  check_layout(unboxed(placed), like_params, param_shardings, None)
  for axis in (None, "data"):
    from_boxes = mpx.zero1_shardings(tx, params, mesh, axis)
    want = mpx.zero1_shardings(tx, jax.device_put(make_params(), param_shardings), mesh, axis)
    for a, b in zip(jax.tree.leaves(from_boxes), jax.tree.leaves(want), strict=True):
      assert a == b
    jax.device_put(state, from_boxes)  # the boxed state takes them


# Every mode's public functions take boxes in
# test_every_mode_trains_sharded_and_through_linen_boxes_bitwise, which
# trains after the same checks; this one runs them alone, without training,
# at the floors too.
@pytest.mark.parametrize("masters, moments", sorted(FLOORS_BOXES))
@pytest.mark.slow
@pytest.mark.floors
def test_every_public_function_takes_linen_boxes(masters, moments):
  tx, params, state = check_public_functions_on_boxes(masters, moments, "last")
  check_boxed_layout(tx, params, state, "last")


# One test a mode for both trainings: they share the one-device reference steps.
@pytest.mark.slow
@pytest.mark.parametrize("masters, moments", MODES)
def test_every_mode_trains_sharded_and_through_linen_boxes_bitwise(masters, moments):
  """Placed by zero1_shardings in the mode's (layout, axis) pair, and sharded
  by the boxes' names (on 8 devices or on 4 x 2, in turn over the modes), two
  steps give the one-device steps' bits."""
  for layout, axis in slow_training((masters, moments)):
    train_sharded(masters, moments, layout, axis)
  for layout in [("last", "both")[MODES.index((masters, moments)) % 2]]:
    tx, params, state = check_public_functions_on_boxes(masters, moments, layout)
    check_boxed_layout(tx, params, state, layout)
    from flax import linen as nn

    mesh, _ = on_mesh(layout)
    shardings = nn.get_sharding(state, mesh)
    param_shardings = nn.get_sharding(params, mesh)
    state = jax.device_put(state, shardings)
    params = jax.device_put(params, param_shardings)
    check_steps_bitwise(
      tx,
      reference(masters, moments),
      params,
      state,
      shardings,
      param_shardings,
      lambda grads, layout=layout: boxed(grads, layout),
    )


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
# (four compilations for the mesh and one device each). The floors put
# mpx's state on a mesh through a container in test_containers (nnx, the box
# rule linen's shares) and lays out every mode here with zero1_shardings.
LINEN_MODES = [
  pytest.param("stochastic", "full", marks=pytest.mark.slow),
  pytest.param("full", "8bit", marks=pytest.mark.slow),
  pytest.param("stochastic", "4bit", marks=pytest.mark.slow),
  pytest.param("24bit", "per-field", marks=pytest.mark.slow),
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
  if moments != "full":  # codes split like the param; scales keep the axes they share
    for nu in (inner.nu["DenseGeneral_0"]["kernel"], inner.mu["DenseGeneral_0"]["kernel"]):
      assert nu.codes.names == (None, None, "data") and nu[1].names == (None, None, None)
      assert nu.codes.value.sharding.spec == P(None, None, "data")
      assert nu.codes.value.addressable_shards[0].data.shape[-1] == nu.codes.value.shape[-1] // 8
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


def test_zero1_shardings_maps_logically_partitioned_boxes_by_the_rules_in_force():
  """nn.with_logical_partitioning's boxes hold logical names: zero1_shardings
  maps them by flax's rules, as nn.logical_to_mesh_sharding maps the params."""
  from flax import linen as nn

  mesh, param_shardings = on_mesh("both")
  bare = make_params()
  names = {"w1": ("batch", "hidden"), "w2": ("hidden", "batch"), "b": ("hidden",), "norm": (None,)}
  logical = {k: nn.LogicallyPartitioned(v, names=names[k]) for k, v in bare.items()}
  tx = make_tx("remainder", "per-field")
  with nn.logical_axis_rules([("batch", "data"), ("hidden", "model")]):
    for axis in (None, "data"):
      got = mpx.zero1_shardings(tx, logical, mesh, axis)
      want = mpx.zero1_shardings(tx, jax.device_put(bare, param_shardings), mesh, axis)
      assert jax.tree.leaves(got) == jax.tree.leaves(want), axis
  # Without rules the logical names are no mesh axes: every leaf replicated but for ZeRO-1.
  got = mpx.zero1_shardings(tx, logical, mesh, None)
  assert all(s.spec == P() for s in jax.tree.leaves(got))
