"""`mpx.scan_layers`: scanned layers updated in the backward scan, a layer at a time.

The reference is independent of it: the same layers under a plain
``lax.scan``, ``jax.grad`` of the loss and the same rule's step on the
stacked params after it. Elementwise rules give each layer the step the
stacked step gives it, bit for bit, random bits included; a rule's verdict
is each layer's own.
"""

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from lowering_forms import forced
from treecheck import tree_equal

import mpx

LAYERS, WIDTH = 3, 32  # "w" and "v": 4096 elements a layer, the least that moments compress


def block(p, x):
  return x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def plain_loss(params, x):
  x, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, params)
  return jnp.mean(jnp.square(x.astype(jnp.float32)))


def setup(dtype=jnp.bfloat16, seed=0):
  rng = np.random.default_rng(seed)
  shapes = {
    "w": (LAYERS, WIDTH, 4 * WIDTH),
    "b": (LAYERS, 4 * WIDTH),
    "v": (LAYERS, 4 * WIDTH, WIDTH),
  }
  params = {
    k: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 2 else 8), dtype)
    for k, s in shapes.items()
  }
  batches = [jnp.asarray(rng.standard_normal((8, WIDTH)), dtype) for _ in range(3)]
  return params, batches


def train_plain(tx, params, batches, loss=plain_loss):
  """The plain scanned step: ``jax.grad``, then ``tx`` on the stacked params."""
  state = tx.init(params)

  @jax.jit
  def step(params, state, x):
    updates, state = tx.update(jax.grad(loss)(params, x), state, params)
    return optax.apply_updates(params, updates), state

  for x in batches:
    params, state = step(params, state, x)
  return params, state


def train_in_backward(tx, params, batches, layer=block):
  """``mpx.scan_layers(layer, tx)``'s step: the layers updated in the backward scan."""
  stack = mpx.scan_layers(layer, tx)
  layers = stack.init(params)

  def loss(layers, x):
    return jnp.mean(jnp.square(stack(layers, x).astype(jnp.float32)))

  step = jax.jit(jax.grad(loss))
  for x in batches:
    layers = step(layers, x)
  return stack, layers


def mp(masters, moments="full", skip="step"):
  return lambda: mpx.mixed_precision(optax.adamw(1e-2), masters=masters, moments=moments, skip=skip)


MASTERS = ("full", "remainder", "24bit", "stochastic")
MOMENTS = ("full", "bfloat16", "8bit", "4bit", {"mu": "8bit", "nu": "4bit"})
# Each masters and moments mode once, in every lowering form; the other pairs
# (slow) in the accelerators' form, the program an H100 runs (two-pass coder,
# skip by a select).
QUICK = [
  ("remainder", "full", "step"),
  ("24bit", "4bit", "leaf"),
  ("stochastic", "8bit", "step"),
  ("full", {"mu": "8bit", "nu": "4bit"}, "leaf"),
  ("remainder", "bfloat16", "leaf"),
]
OTHERS = [
  (m, f, s) for m in MASTERS for f in MOMENTS for s in ("step", "leaf") if (m, f, s) not in QUICK
]


def test_each_layer_takes_optax_adamws_stacked_update_bit_for_bit():
  params, batches = setup()
  expected, _ = train_plain(optax.adamw(1e-2), params, batches)
  _, layers = train_in_backward(optax.adamw(1e-2), params, batches)
  assert tree_equal(layers.params, expected)


@pytest.mark.parametrize("masters, moments, skip", QUICK)
def test_each_layer_takes_the_stacked_steps_update_bit_for_bit(
  masters, moments, skip, finite_check_form
):
  check_layers_take_the_stacked_update(masters, moments, skip)


@pytest.mark.slow  # 35 pairs, two trainings each: 2 minutes on 2 cores
@pytest.mark.parametrize("masters, moments, skip", OTHERS)
def test_in_every_mode_each_layer_takes_the_stacked_steps_update_bit_for_bit(
  masters, moments, skip
):
  with forced("gpu"):
    check_layers_take_the_stacked_update(masters, moments, skip)


def check_layers_take_the_stacked_update(masters, moments, skip):
  # Random bits included (stochastic masters, compressed moments): a layer
  # draws the bits the stacked leaf draws for its elements.
  params, batches = setup()
  expected, expected_state = train_plain(mp(masters, moments, skip)(), params, batches)
  stack, layers = train_in_backward(mp(masters, moments, skip)(), params, batches)
  assert tree_equal(layers.params, expected)
  # Each layer's state is its slice of the stacked state (to XLA's choice of
  # where to contract a multiply-add, which the program around the step
  # moves: the params hide it, the masters' low bits and the moments may
  # not), its counters the stacked state's, once a layer.
  state = stack.inner_state(layers)
  for got, want in zip(
    jax.tree.leaves(mpx.inner_state(state)[0]),
    jax.tree.leaves(mpx.inner_state(expected_state)[0]),
    strict=True,
  ):
    assert float(jnp.abs(got - want).mean()) <= 1e-3 * float(jnp.abs(want).mean())
  got_masters = mpx.master_params(state, layers.params)
  expected_masters = mpx.master_params(expected_state, expected)
  pairs = zip(jax.tree.leaves(got_masters), jax.tree.leaves(expected_masters), strict=True)
  for got, want in pairs:
    # An ulp of a 1e-2 update apart, or (24-bit masters) where it tips the
    # master's rounding, a 24-bit ulp.
    rtol = 2**-15 if masters == "24bit" else 2e-6
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-8)
  np.testing.assert_array_equal(state.applied_steps, np.full(LAYERS, len(batches)))
  np.testing.assert_array_equal(state.nonfinite_steps, np.zeros(LAYERS))
  assert state.applied_steps.dtype == jnp.int32


def gated_block(p, x):
  # d/dc of sqrt(c) * 0 is 0 * inf at c = 0: NaN in that layer's "c" gradient
  # alone (the term reads no x, so the cotangent passed on stays finite).
  return block(p, x) + jnp.sqrt(p["c"]) * 0


@pytest.mark.parametrize("skip", ["step", "leaf"])
def test_a_non_finite_gradient_skips_its_layer_alone_and_is_counted_there(skip, finite_check_form):
  params, batches = setup()
  params["c"] = jnp.asarray([1.0, 0.0, 1.0], jnp.bfloat16)  # layer 1's gradient: NaN
  stack = mpx.scan_layers(gated_block, mp("24bit", "4bit", skip=skip)())
  layers = stack.init(params)

  def loss(layers, x):
    return jnp.mean(jnp.square(stack(layers, x).astype(jnp.float32)))

  before = stack.inner_state(layers)
  new = jax.jit(jax.grad(loss))(layers, batches[0])
  state = stack.inner_state(new)
  floating = [
    x for x in jax.tree.leaves(mpx.inner_state(state)) if jnp.issubdtype(x.dtype, jnp.floating)
  ]
  assert all(bool(jnp.isfinite(x).all()) for x in floating)
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(new.params))
  np.testing.assert_array_equal(state.nonfinite_steps, [0, 1, 0])
  np.testing.assert_array_equal(state.applied_steps, [1, 1 if skip == "leaf" else 0, 1])
  for i in (0, 2):
    assert not np.array_equal(new.params["w"][i], params["w"][i])
  # skip="step": the layer is kept whole; skip="leaf": the leaf alone.
  kept = ("w", "b", "v", "c") if skip == "step" else ("c",)
  for name in ("w", "b", "v", "c"):
    assert np.array_equal(new.params[name][1], params[name][1]) == (name in kept), name
    same = np.array_equal(state.master_corrections[name][1], before.master_corrections[name][1])
    assert same or name not in kept, name


def test_the_carried_state_restores_every_leaf_bit_for_bit():
  params, _ = setup()
  for tx in (
    mp("stochastic", "4bit")(),
    mp("24bit", {"mu": "8bit", "nu": "4bit"})(),
    optax.adamw(1e-2),
  ):
    stack = mpx.scan_layers(block, tx)
    layers = stack.init(params)
    assert all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(layers))
    assert tree_equal(stack.inner_state(layers), jax.vmap(tx.init)(params))


def test_bits_that_read_as_nan_floats_ride_through_a_step_unchanged():
  # Carried as float32, these keys are signalling and quiet NaNs, an
  # infinity and a negative zero: only moved (sliced, written), never computed
  # with, so every bit survives.
  params, batches = setup()
  tx = mp("stochastic", "4bit")()
  stack = mpx.scan_layers(block, tx)
  layers = stack.init(params)
  keys = np.array([0x7F800001, 0xFFC00001, 0x7F800000, 0x80000000], np.uint32)
  state = stack.inner_state(layers)
  crafted = {k: jnp.asarray(keys[:LAYERS] + i) for i, k in enumerate(state.rounding_keys)}
  layers = layers._replace(
    inner_state=layers.inner_state._replace(
      rounding_keys=jax.tree.map(lambda k: jax.lax.bitcast_convert_type(k, jnp.float32), crafted)
    )
  )

  def loss(layers, x):
    return jnp.mean(jnp.square(stack(layers, x).astype(jnp.float32)))

  new = jax.jit(jax.grad(loss))(layers, batches[0])
  assert tree_equal(stack.inner_state(new).rounding_keys, crafted)
  assert not tree_equal(new.params, layers.params)


def test_refuses_a_loss_scale_and_layers_without_one_leading_axis():
  params, _ = setup(jnp.float16)
  with pytest.raises(ValueError, match="loss_scale"):
    mpx.scan_layers(block, mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3)))).init(params)
  stack = mpx.scan_layers(block, optax.adam(1e-3))
  with pytest.raises(ValueError, match="leading layer axis"):
    stack.init(dict(params, b=params["b"][:2]))
  with pytest.raises(TypeError, match="ScanLayersState"):
    stack(params, jnp.ones((2, WIDTH)))


def train_both(tx_maker, plain_loss_fn, block_fn, params, batches):
  """The params after the plain scanned step's training and after scan_layers'."""
  expected, _ = train_plain(tx_maker(), params, batches, plain_loss_fn)
  return expected, train_in_backward(tx_maker(), params, batches, block_fn)[1].params


@pytest.mark.parametrize(
  "make",
  [lambda: optax.adamw(1e-2), mp("24bit", skip="leaf"), mp("stochastic", "4bit")],
  ids=["adamw", "24bit", "stochastic + 4bit"],
)
def test_a_linen_nn_scan_model_trains_as_its_plain_step(make):
  from flax import linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      dense = lambda n: nn.Dense(n, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)  # noqa: E731
      return x + dense(WIDTH)(jnp.tanh(dense(4 * WIDTH)(x))), None

  Stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
  _, batches = setup()
  params = Stack().init(jax.random.key(0), batches[0], None)["params"]

  def plain(params, x):
    return jnp.mean(jnp.square(Stack().apply({"params": params}, x, None)[0].astype(jnp.float32)))

  expected, got = train_both(
    make, plain, lambda p, x: Block().apply({"params": p}, x, None)[0], params, batches
  )
  assert tree_equal(got, expected)


@pytest.mark.parametrize(
  "make",
  [lambda: optax.adamw(1e-2), mp("24bit", skip="leaf"), mp("stochastic", "4bit")],
  ids=["adamw", "24bit", "stochastic + 4bit"],
)
def test_nnx_layers_train_as_their_plain_scanned_step(make):
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      def linear(a, b):
        return nnx.Linear(a, b, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)

      self.up, self.down = linear(WIDTH, 4 * WIDTH), linear(4 * WIDTH, WIDTH)

    def __call__(self, x):
      return x + self.down(jnp.tanh(self.up(x)))

  blocks = [Block(nnx.Rngs(i)) for i in range(LAYERS)]
  graphdef, _ = nnx.split(blocks[0])
  params = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b, nnx.Param) for b in blocks])
  run = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
  _, batches = setup()

  def plain(params, x):
    x, _ = jax.lax.scan(lambda h, p: (run(p, h), None), x, params)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))

  expected, got = train_both(make, plain, run, params, batches)
  assert tree_equal(got, expected)


@pytest.mark.slow  # 3 x 2 trainings on 8 devices: 10 s
@pytest.mark.parametrize(
  "masters, moments",
  [("24bit", "4bit"), ("stochastic", {"mu": "8bit", "nu": "4bit"}), ("remainder", "full")],
)
def test_zero1_sharded_layers_store_the_replicated_steps_bits(masters, moments):
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  params, batches = setup()
  params = {k: v for k, v in params.items()}
  tx = mp(masters, moments, skip="leaf")()
  stack = mpx.scan_layers(block, tx)
  shardings = stack.zero1_shardings(params, mesh)
  mu = shardings.inner_state.inner_state[0].mu["w"]
  assert (mu if moments == "full" else mu.codes).spec == P(None, "data")

  def loss(layers, x):
    return jnp.mean(jnp.square(stack(layers, x).astype(jnp.float32)))

  def sharded_step(batch_spec):
    batch = NamedSharding(mesh, batch_spec)
    return jax.jit(jax.grad(loss), in_shardings=(shardings, batch), out_shardings=shardings)

  replicated = stack.init(params)
  # The state split, the batch whole: the replicated step's bits.
  sharded = jax.jit(stack.init, out_shardings=shardings)(params)
  # The batch split too: each gradient summed over the devices' rows in
  # another order, so close to them.
  data_parallel = sharded
  step = jax.jit(jax.grad(loss))
  for x in batches:
    replicated = step(replicated, x)
    sharded = sharded_step(P())(sharded, x)
    data_parallel = sharded_step(P("data"))(data_parallel, x)
  assert tree_equal(sharded, replicated)
  pairs = zip(
    jax.tree.leaves(data_parallel.params), jax.tree.leaves(replicated.params), strict=True
  )
  for a, b in pairs:
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2)
  leaf = jax.tree.leaves(sharded.inner_state)[-1]
  assert leaf.sharding.spec[0] is None


@jax_versions.requires_jax("0.6.1", "shard_map's check_vma types (vma)")
def test_refuses_a_carry_that_varies_over_shard_map_axes():
  # There the layers' update would read the device's own gradient, and their
  # broadcast's transpose would sum the devices' new layers.
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  params, batches = setup()
  stack = mpx.scan_layers(block, optax.sgd(0.1))

  def local(layers, x):
    return jax.grad(lambda layers: jnp.sum(stack(layers, x).astype(jnp.float32)))(layers)

  run = jax_versions.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  with pytest.raises(ValueError, match="shard_map axes"):
    jax.jit(run)(stack.init(params), batches[0])


@pytest.mark.slow  # compiles 4 steps for an H100: 20 s
def test_on_an_h100_the_step_holds_a_layer_not_the_stack():
  """Compiled for an H100 (benchmarks/whole_step.py, scanned, at a small
  size): beside params and state the plain scanned step holds the stacked
  gradient (2 B/param and more); updated in the backward scan, one layer's
  gradient and temporaries, a share that falls with the layer count. The
  layers are updated in place: a copy of the stack would hold 2 B/param."""
  import sys

  from test_gpu_compile import require_cuda_compiler

  require_cuda_compiler()
  sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
  from benchmarks import whole_step

  topo = whole_step.topology()
  held = {}
  for blocks, width in ((8, 256), (32, 128)):
    model = whole_step.Model(blocks, width, batch=16, scanned=True)
    tx = mp("24bit", "4bit")
    plain = whole_step.measure("plain", model, tx(), topo=topo)
    layered = whole_step.measure_scan_layers("layers", model, tx(), topo)
    assert plain.transient >= 2.0
    assert layered.conditionals == 0
    assert layered.kept == pytest.approx(plain.kept, abs=1e-3)  # each layer counts its steps
    assert layered.moved <= 1.6 * plain.moved
    held[blocks] = layered.transient
  assert held[8] <= 1.3
  assert held[32] <= held[8] / 2.5


def test_the_layers_checkpoint_with_orbax_as_they_are(tmp_path):
  # Float leaves only: the carried bits come back as saved, and the next step
  # is the one an unsaved run takes.
  ocp = pytest.importorskip("orbax.checkpoint")
  params, batches = setup()
  stack, layers = train_in_backward(mp("stochastic", "4bit")(), params, batches[:2])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", layers)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "ckpt", stack.init(params))
  assert tree_equal(restored, layers)

  def loss(layers, x):
    return jnp.mean(jnp.square(stack(layers, x).astype(jnp.float32)))

  step = jax.jit(jax.grad(loss))
  assert tree_equal(step(restored, batches[2]), step(layers, batches[2]))


@pytest.mark.parametrize(
  "masters, moments, skip", [("24bit", "4bit", "leaf"), ("stochastic", "8bit", "step")]
)
def test_an_eager_step_stores_the_jitted_steps_bits(masters, moments, skip):
  params, batches = setup()
  stack = mpx.scan_layers(block, mp(masters, moments, skip)())
  layers = stack.init(params)

  def loss(layers, x):
    return jnp.mean(jnp.square(stack(layers, x).astype(jnp.float32)))

  eager = jax.grad(loss)(layers, batches[0])
  assert tree_equal(eager, jax.jit(jax.grad(loss))(layers, batches[0]))
