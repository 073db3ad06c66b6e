"""Several devices: GSPMD shardings, shard_map/pmap axis_name, ZeRO-1 masters.

Runs in this process on the 8 host CPU devices that conftest.py asks XLA for.
Collectives are counted in the compiled HLO, by kind.
"""

import math
import re

import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from lowering_forms import forced
from treecheck import tree_equal

import mpx
from mpx import zero1_shardings
from mpx._src import compat

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def is_hole(x):
  return isinstance(x, optax.MaskedNode)


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  assert len(jax.devices()) == 8, (
    f"these tests need 8 devices (tests/conftest.py sets XLA_FLAGS), got {jax.devices()}"
  )


def make_mesh(shape):
  names = ("data", "model")[: len(shape)]
  return Mesh(np.array(jax.devices()).reshape(shape), names)


def count_collectives(compiled_text):
  """Collective instructions in compiled HLO, by kind (async pairs count once)."""
  return {kind: len(re.findall(rf" {kind}(?:-start)?\(", compiled_text)) for kind in COLLECTIVES}


def state_bytes_on(tree, device):
  return sum(
    shard.data.nbytes
    for leaf in jax.tree.leaves(tree)
    for shard in leaf.addressable_shards
    if shard.device == device
  )


# A small MLP whose widths divide by 8, so every layout below is even.
PARAM_SPECS = {
  "dp": {"w1": P(), "b1": P(), "w2": P(), "norm": P()},
  "tp": {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "norm": P()},
}


def fp32_params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {
    "w1": jax.random.normal(k1, (16, 64)) * 0.3,
    "b1": jnp.zeros(64),
    "w2": jax.random.normal(k2, (64, 8)) * 0.3,
    "norm": jnp.ones(64),
  }


def low_precision(params, dtype):
  return mpx.cast_tree(params, dtype, where=lambda path, x: "norm" not in path)


def batches(steps, overflow_at=None):
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  xs = np.array(jax.random.normal(k1, (steps, 32, 16)))
  ys = np.asarray(jax.random.normal(k2, (steps, 32, 8)))
  if overflow_at is not None:
    xs[overflow_at, 3, 0] = 1e30  # inf in fp16, in the batch shard of one device
  return xs, ys


def loss_fn(p, x, y):
  dtype = p["w1"].dtype
  h = jnp.tanh(x.astype(dtype) @ p["w1"] + p["b1"]) * p["norm"].astype(dtype)
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


def place(params, mesh, layout):
  shardings = {k: NamedSharding(mesh, s) for k, s in PARAM_SPECS[layout].items()}
  # From host memory: a fresh buffer per run, so donation cannot delete a shared one.
  return jax.device_put(jax.tree.map(np.asarray, params), shardings), shardings


def sharded_step(tx, mesh, param_shardings, state_shardings):
  """The documented GSPMD step: gradients constrained to the params' shardings,
  every input and output pinned."""
  batch = NamedSharding(mesh, P("data"))

  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x, y), opt_state))(params)
    grads = jax.lax.with_sharding_constraint(grads, param_shardings)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(
    step,
    in_shardings=(param_shardings, state_shardings, batch, batch),
    out_shardings=(param_shardings, state_shardings),
    donate_argnums=(0, 1),
  )


def sharded_step_text(tx, params, mesh, layout="dp", zero_axis="data"):
  """Returns the compiled text of the documented step (``sharded_step``)."""
  params, param_shardings = place(params, mesh, layout)
  state_shardings = zero1_shardings(tx, params, mesh, axis=zero_axis)
  step = sharded_step(tx, mesh, param_shardings, state_shardings)
  state = jax.eval_shape(tx.init, params)
  x = jax.ShapeDtypeStruct((32, 16), jnp.float32)
  y = jax.ShapeDtypeStruct((32, 8), jnp.float32)
  return step.lower(params, state, x, y).compile().as_text()


def compiled_collectives(tx, params, mesh, layout, zero_axis=None):
  return count_collectives(sharded_step_text(tx, params, mesh, layout, zero_axis))


def train(tx, params, mesh, layout, zero_axis, xs, ys):
  """Returns the final params and state, the state's bytes on each device and
  the step's collectives."""
  params, param_shardings = place(params, mesh, layout)
  state_shardings = zero1_shardings(tx, params, mesh, axis=zero_axis)
  opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  state_bytes = [state_bytes_on(opt_state, d) for d in mesh.devices.flat]
  step = sharded_step(tx, mesh, param_shardings, state_shardings)
  step = step.lower(params, opt_state, xs[0], ys[0]).compile()
  for x, y in zip(xs, ys, strict=True):
    params, opt_state = step(params, opt_state, x, y)
  return params, opt_state, state_bytes, count_collectives(step.as_text())


# --- zero1_shardings itself -------------------------------------------------


def test_zero1_shardings_specs_for_every_kind_of_leaf():
  mesh = make_mesh((4, 2))

  def abstract(shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  params = {
    "w": abstract((16, 6), jnp.bfloat16, P(None, "model")),  # dim 0 is free and divides
    "v": abstract((6, 8), jnp.bfloat16, P("model", None)),  # 6 % 4 != 0: dim 1 instead
    "t": abstract((8,), jnp.bfloat16, P("model")),  # only dim: shared ("model", "data")
    "odd": abstract((3, 5), jnp.bfloat16, P()),  # nothing divides: stays replicated
    "fsdp": abstract((8, 4), jnp.bfloat16, P("data", None)),  # already over data: kept
    "norm": abstract((8,), jnp.float32, P()),  # float32: no master, moments sharded
  }
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adamw(1e-3)))
  shardings = zero1_shardings(tx, params, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(jax.eval_shape(tx.init, params))
  expected = {
    "w": P("data", "model"),
    "v": P("model", "data"),
    "t": P(("model", "data")),
    "odd": P(),  # spelled as jax names XLA's choice: no trailing None
    "fsdp": P("data"),
    "norm": P("data"),
  }
  masters = shardings.inner_state.master_params
  assert is_hole(masters["norm"])
  adam = shardings.inner_state.inner_state[0]
  for name, spec in expected.items():
    for tree in (adam.mu, adam.nu) + (() if name == "norm" else (masters,)):
      assert tree[name].spec == spec, (name, tree[name].spec)
  for scalar in (shardings.loss_scale, shardings.skipped_steps, adam.count):
    assert scalar.spec == P() and scalar.mesh.shape_tuple == mesh.shape_tuple

  mirrored = zero1_shardings(tx, params, mesh, axis=None)
  adam = mirrored.inner_state.inner_state[0]
  for name, param in params.items():
    assert adam.mu[name].is_equivalent_to(param.sharding, param.ndim), name
  with pytest.raises(ValueError, match="'batch' is not an axis"):
    zero1_shardings(tx, params, mesh, axis="batch")


# --- GSPMD -----------------------------------------------------------------


@pytest.mark.slow  # test_zero1.py pins the shardings; here nothing is pinned
def test_gspmd_state_follows_each_params_sharding_through_unpinned_steps():
  """2x4 mesh, tensor-parallel params: with nothing pinned but the inputs,
  after every step (one skipped) each master and moment is sharded exactly
  like its parameter, wherever XLA put the parameter."""
  mesh = make_mesh((2, 4))
  params, _ = place(low_precision(fp32_params(), jnp.float16), mesh, "tp")
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adamw(1e-2)))
  opt_state = jax.jit(tx.init, out_shardings=zero1_shardings(tx, params, mesh, axis=None))(params)

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x, y), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def mismatches(opt_state, params):
    found = []

    def check(leaf, param):
      if not is_hole(leaf) and not leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim):
        found.append((leaf.sharding.spec, param.sharding.spec))
      return leaf

    optax.tree_utils.tree_map_params(tx, check, opt_state, params, is_leaf=is_hole)
    return found

  assert mismatches(opt_state, params) == []
  assert opt_state.inner_state.master_params["w1"].sharding.spec == P(None, "model")
  batch = NamedSharding(mesh, P("data"))
  for x, y in zip(*batches(2, overflow_at=1), strict=True):
    params, opt_state = step(params, opt_state, jax.device_put(x, batch), jax.device_put(y, batch))
    assert mismatches(opt_state, params) == []
  assert int(opt_state.skipped_steps) == 1
  assert params["w1"].sharding.spec == P(None, "model")


# On the floors: data parallelism. -m slow adds the tensor-parallel count (one extra
# all-reduce), here and in the ZeRO-1 test on the 4 x 2 mesh.
@jax_versions.requires_jax("0.7.0", "GSPMD before Shardy adds two all-reduces")
@pytest.mark.parametrize(
  "layout, mesh_shape",
  [("dp", (8,)), pytest.param("tp", (2, 4), marks=pytest.mark.slow)],
)
@pytest.mark.slow
@pytest.mark.floors
def test_gspmd_collectives_against_plain_optax(layout, mesh_shape):
  """mpx adds no collective to plain optax on FP32 params, except, when the
  gradients are sharded (tensor parallelism), the one all-reduce of the
  finite flag, which optax.apply_if_finite needs too."""
  mesh = make_mesh(mesh_shape)
  fp32 = fp32_params()
  counts = {
    "adam": compiled_collectives(optax.adam(1e-3), fp32, mesh, layout),
    "apply_if_finite": compiled_collectives(
      optax.apply_if_finite(optax.adam(1e-3), 3), fp32, mesh, layout
    ),
    "mixed_precision": compiled_collectives(
      mpx.mixed_precision(optax.adam(1e-3)), low_precision(fp32, jnp.bfloat16), mesh, layout
    ),
    "loss_scale": compiled_collectives(
      mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3))),
      low_precision(fp32, jnp.float16),
      mesh,
      layout,
    ),
  }
  assert counts["adam"]["all-reduce"] >= 1, counts  # the gradient reduction is there
  extra = {"all-reduce": 1} if layout == "tp" else {}
  expected = {k: counts["adam"][k] + extra.get(k, 0) for k in COLLECTIVES}
  assert counts["apply_if_finite"] == expected, counts
  assert counts["mixed_precision"] == expected, counts
  assert counts["loss_scale"] == expected, counts


@pytest.mark.parametrize("zero", [False, True], ids=["replicated", "zero1"])
def test_overflow_only_in_the_cross_device_sum_is_skipped(zero):
  """Each device's fp16 partial gradient is finite (16384); only their sum
  over the 8 devices (131072) overflows. The step must still be skipped."""
  mesh = make_mesh((8,))
  replicated = NamedSharding(mesh, P())
  tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(1e-3)))
  params = jax.device_put({"w": jnp.ones((8, 8), jnp.float16)}, replicated)
  state_shardings = zero1_shardings(tx, params, mesh, axis="data" if zero else None)
  opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: mpx.scale_loss(jnp.sum(x @ p["w"]), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads

  step = jax.jit(
    step,
    in_shardings=(replicated, state_shardings, NamedSharding(mesh, P("data"))),
    out_shardings=(replicated, state_shardings, replicated),
  )
  x = jnp.full((8, 8), 0.5, jnp.float16)  # one row per device
  new_params, opt_state, grads = step(params, opt_state, x)
  assert bool(jnp.isinf(grads["w"]).all())
  assert int(opt_state.skipped_steps) == 1
  assert float(opt_state.loss_scale) == 2.0**14
  assert tree_equal(new_params, params)
  assert tree_equal(opt_state.inner_state.master_params, {"w": jnp.ones((8, 8))})


# --- ZeRO-1 ----------------------------------------------------------------


# The floors run plain data parallelism over 8 devices (test_zero1.py's
# floors cases place tensor-parallel params); -m slow adds the 4 x 2 mesh.
@pytest.mark.parametrize(
  "mesh_shape",
  [pytest.param((8,), id="data8"), pytest.param((4, 2), id="data4xmodel2", marks=pytest.mark.slow)],
)
@pytest.mark.slow
@pytest.mark.floors
def test_zero1_divides_state_memory_and_trains_bitwise_like_replicated(mesh_shape):
  mesh = make_mesh(mesh_shape)
  layout = "dp" if len(mesh_shape) == 1 else "tp"
  n_data = mesh.shape["data"]
  params = low_precision(fp32_params(), jnp.float16)
  xs, ys = batches(4, overflow_at=2)

  def tx():
    return mpx.loss_scale(mpx.mixed_precision(optax.adamw(1e-2)), growth_interval=2)

  rep_params, rep_state, rep_bytes, _ = train(tx(), params, mesh, layout, None, xs, ys)
  zero_params, zero_state, zero_bytes, mixed = train(tx(), params, mesh, layout, "data", xs, ys)

  # Same training, bit for bit, including the skipped step and the scale.
  assert int(zero_state.skipped_steps) == 1
  assert tree_equal(zero_params, rep_params)
  assert tree_equal(zero_state, rep_state)

  # Parameters keep their (data-replicated) sharding; the state is split.
  for name, spec in PARAM_SPECS[layout].items():
    assert zero_params[name].sharding.is_equivalent_to(
      NamedSharding(mesh, spec), zero_params[name].ndim
    )
  master = zero_state.inner_state.master_params["w1"]
  assert master.sharding.spec == (P("data", "model") if layout == "tp" else P("data"))
  assert master.addressable_shards[0].data.shape[0] == 16 // n_data
  ratios = [r / z for r, z in zip(rep_bytes, zero_bytes, strict=True)]
  assert len(set(rep_bytes)) == 1 and len(set(zero_bytes)) == 1  # balanced
  assert 0.97 * n_data < ratios[0] <= n_data, (rep_bytes[0], zero_bytes[0])

  # ZeRO costs mpx no collective beyond what it costs plain optax (from jax
  # 0.7, whose Shardy partitioner does not add GSPMD's two all-reduces).
  if compat.jax_at_least("0.7.0"):
    plain = compiled_collectives(optax.adam(1e-2), fp32_params(), mesh, layout, "data")
    extra = {"all-reduce": 1} if layout == "tp" else {}
    assert mixed == {k: plain[k] + extra.get(k, 0) for k in COLLECTIVES}, (mixed, plain)


@pytest.mark.parametrize(
  "form",
  [pytest.param(None, id="CPU form", marks=pytest.mark.slow), pytest.param("gpu", id="GPU form")],
)
def test_zero1_24bit_stall_check_reads_each_devices_own_shard(form):
  """The 24-bit masters' stall check samples every dimension evenly, so under
  ZeRO-1 each device reduces a sample of its own rows and the step adds only
  the gathers of one maximum a device to the remainder masters' collectives.
  A sample of each leaf's first elements sat on the first devices and was
  sent to the rest (12 collective-permutes on this tree)."""
  mesh = make_mesh((8,))
  params = low_precision(fp32_params(), jnp.bfloat16)
  with forced(form):
    steps = {
      masters: sharded_step_text(
        mpx.mixed_precision(optax.adamw(1e-2), masters=masters), params, mesh
      )
      for masters in ("remainder", "24bit")
    }
  found = {masters: count_collectives(text) for masters, text in steps.items()}
  gathered = re.findall(r"= f32\[([\d,]*)\]\S* all-gather(?:-start)?\(", steps["24bit"])
  maxima = sum(1 for dims in gathered if math.prod(map(int, dims.split(","))) == mesh.size)
  assert found["24bit"]["collective-permute"] == 0, found
  assert maxima > 0 and found["24bit"] == {
    **found["remainder"],
    "all-gather": found["remainder"]["all-gather"] + maxima,
  }, found


# --- shard_map and pmap: axis_name -----------------------------------------

# Per step, the devices whose gradients hold an inf.
INF_DEVICES = [(), (3,), (), (0, 7), (), (), (5,)]


def local_grads(step):
  grads = np.ones((8, 4), np.float16) * np.float16(1 + step)
  for d in INF_DEVICES[step]:
    grads[d, step % 4] = np.inf
  return grads


def lockstep_tx(axis_name):
  return mpx.loss_scale(
    mpx.mixed_precision(optax.adam(0.1)), init_scale=8.0, growth_interval=2, axis_name=axis_name
  )


def run_replicas(tx, step_fn):
  """Steps 8 replicas, each holding one row of the params, with their own
  state (stacked on a leading device axis). Returns the states seen."""
  params = jnp.linspace(-1, 1, 32, dtype=jnp.float16).reshape(8, 1, 4)
  states = jax.vmap(tx.init)(params)
  seen = []
  for step in range(len(INF_DEVICES)):
    grads = jnp.asarray(local_grads(step)).reshape(8, 1, 4)
    params, states = step_fn(grads, states, params)
    seen.append((params, states))
  return seen


def shard_map_step(tx):
  mesh = make_mesh((8,))

  def per_device(grads, state, params):
    local = jax.tree.map(lambda x: x[0], (grads, state, params))
    updates, new_state = tx.update(*local)
    new_params = optax.apply_updates(local[2], updates)
    return jax.tree.map(lambda x: x[None], (new_params, new_state))

  spec = P("data")
  return jax.jit(
    jax_versions.shard_map(
      per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec), check_vma=False
    )
  )


def pmap_step(tx):
  def per_device(grads, state, params):
    updates, new_state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), new_state

  return jax.pmap(per_device, axis_name="data")


def single_device_reference():
  """The same steps on one device, on the whole (8, 4) parameter."""
  tx = lockstep_tx(None)
  params = jnp.linspace(-1, 1, 32, dtype=jnp.float16).reshape(8, 4)
  state = tx.init(params)
  seen = []
  for step in range(len(INF_DEVICES)):
    updates, state = tx.update(jnp.asarray(local_grads(step)), state, params)
    params = optax.apply_updates(params, updates)
    seen.append((params, state))
  return seen


# On the floors: shard_map; -m slow adds pmap (which newer jax runs through shard_map).
@pytest.mark.parametrize(
  "mapper",
  [
    pytest.param(shard_map_step, id="shard_map"),
    pytest.param(pmap_step, id="pmap", marks=pytest.mark.slow),
  ],
)
@pytest.mark.slow
@pytest.mark.floors
def test_axis_name_keeps_all_replicas_in_lockstep_over_many_steps(mapper):
  reference = single_device_reference()
  seen = run_replicas(lockstep_tx("data"), mapper(lockstep_tx("data")))
  for step, ((params, states), (ref_params, ref_state)) in enumerate(
    zip(seen, reference, strict=True)
  ):
    scales = np.asarray(states.loss_scale)
    assert (scales == float(ref_state.loss_scale)).all(), (step, scales)
    assert (np.asarray(states.skipped_steps) == int(ref_state.skipped_steps)).all(), step
    assert (np.asarray(states.growth_tracker) == int(ref_state.growth_tracker)).all(), step
    # Each device's row equals the single-device run on the whole gradient.
    assert tree_equal(params.reshape(8, 4), ref_params), step
    masters = states.inner_state.master_params.reshape(8, 4)
    assert tree_equal(masters, ref_state.inner_state.master_params), step
  assert int(reference[-1][1].skipped_steps) == 3
  assert [float(s.loss_scale) for _, s in reference] == [8, 4, 4, 2, 2, 4, 2]


def test_without_axis_name_the_replicas_diverge():
  """The control: same run, no axis_name. Device 3 alone skips step 1 and
  backs off; the other seven apply it and grow their scale."""
  seen = run_replicas(lockstep_tx(None), shard_map_step(lockstep_tx(None)))
  _, states = seen[1]
  scales = np.asarray(states.loss_scale)
  assert scales[3] == 4.0 and (np.delete(scales, 3) == 16.0).all(), scales
  assert list(np.asarray(states.skipped_steps)) == [0, 0, 0, 1, 0, 0, 0, 0]


# --- shard_map with check_vma and explicit meshes -------------------------------


def shard_map_checking_replication():
  """One skipped step of ``lockstep_tx`` under ``shard_map`` with its check of
  replication on (``check_vma``; ``check_rep`` before jax 0.6.1)."""
  mesh = make_mesh((8,))
  tx = lockstep_tx("data")
  params = jax.device_put(
    jnp.linspace(-1, 1, 32, dtype=jnp.float16).reshape(8, 4), NamedSharding(mesh, P("data"))
  )
  shardings = zero1_shardings(tx, params, mesh, axis=None)
  specs = jax.tree.map(lambda s: s.spec, shardings)
  opt_state = jax.jit(tx.init, out_shardings=shardings)(params)

  def per_device(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax_versions.shard_map(
      per_device, mesh=mesh, in_specs=(P("data"), specs, P("data")), out_specs=(P("data"), specs)
    )
  )
  new_params, opt_state = step(jnp.asarray(local_grads(1)), opt_state, params)
  return params, new_params, opt_state


@jax_versions.requires_jax("0.6.1", "check_vma")
def test_shard_map_with_check_vma_proves_the_state_replicated():
  """With check_vma (shard_map's default), out_specs P() for the loss scale
  is accepted only if jax can prove it identical on every device."""
  params, new_params, opt_state = shard_map_checking_replication()
  assert float(opt_state.loss_scale) == 4.0
  assert tree_equal(new_params, params)


@jax_versions.below_jax("0.6.1", "what an older jax says")
def test_shard_map_checking_replication_on_an_older_jax_names_the_fix():
  # jax < 0.6.1 refuses the CPU step's lax.cond under check_rep=True after
  # tracing, outside mpx, with the fix in its message (docs/design.md).
  with pytest.raises(Exception, match=r"mismatched replication types.*check_rep=False"):
    shard_map_checking_replication()


def test_explicit_sharding_mesh():
  """jax.make_mesh's default axis types are Explicit (sharding in types)."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3)))
  with jax_versions.set_mesh(mesh):
    params = jax.device_put(jnp.ones((8, 16), jnp.float16), P(None, "model"))
    opt_state = jax.jit(tx.init)(params)
    updates, opt_state = jax.jit(tx.update)(jnp.ones((8, 16), jnp.float16), opt_state, params)
  assert updates.sharding.spec == P(None, "model")
  assert opt_state.inner_state.master_params.sharding.spec == P(None, "model")
