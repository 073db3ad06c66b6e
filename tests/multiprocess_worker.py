"""One process of the two-process mixed-precision check (see test_multiprocess.py).

Run as ``python tests/multiprocess_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID``
with ``JAX_PLATFORMS=cpu``, once per process. Each process joins the job with
``jax.distributed.initialize``, sees every device of the job in one global
mesh and trains fp16 + loss scaling + float32 masters for a few steps, one of
which overflows in the batch shard of the last process only:

* a GSPMD step (jit with shardings): parameters replicated, the batch sharded
  over the ``"data"`` axis, the optimizer state either mirroring the
  parameters or ZeRO-1 sharded over ``"data"`` (``zero1_shardings``);
* a ``shard_map`` step on per-device gradients with ``loss_scale(...,
  axis_name="data")``, where the overflow sits on one device of the last
  process only.

It prints one ``RESULT {json}`` line with digests of what this process holds,
for the parent test to compare across processes. Importing this module does
nothing.
"""

from __future__ import annotations

import hashlib
import json
import sys


def _digest(tree) -> str:
  import jax
  import numpy as np

  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


def main(coordinator: str, num_processes: int, process_id: int) -> None:
  import jax
  import jax_versions

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax_versions.distributed_initialize(
    coordinator_address=coordinator,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=30,
    heartbeat_timeout_seconds=10,
    shutdown_timeout_seconds=10,
  )
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpx
  from mpx import zero1_shardings

  devices = jax.devices()
  n = len(devices)
  assert jax.process_count() == num_processes, jax.process_count()
  assert n > jax.local_device_count(), "the mesh must span processes"
  mesh = Mesh(np.array(devices), ("data",))
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P("data"))

  def global_array(value, sharding):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  def host(x):
    """The full value of a (possibly sharded) global array, on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  rng = np.random.default_rng(0)
  fp32 = {
    "w": rng.normal(size=(4, 2 * n)).astype(np.float32) * 0.5,
    "b": np.zeros(2 * n, np.float32),
  }
  params16 = mpx.cast_tree(jax.tree.map(jnp.asarray, fp32), jnp.float16)
  xs = rng.normal(size=(5, 2 * n, 4)).astype(np.float32)
  ys = rng.normal(size=(5, 2 * n, 2 * n)).astype(np.float32)
  xs[2, -1, 0] = 3e4  # step 2 overflows in fp16, in the last process's shard

  def loss_fn(p, x, y):
    pred = x.astype(jnp.float16) @ p["w"] + p["b"]
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  results = {"process_id": process_id, "devices": n}
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-2)), init_scale=2.0**10, growth_interval=2)
  for name, axis in (("replicated", None), ("zero1", "data")):
    params = jax.tree.map(lambda v: global_array(v, replicated), params16)
    shardings = zero1_shardings(tx, params, mesh, axis=axis)
    state = jax.jit(tx.init, out_shardings=shardings)(params)
    param_shardings = jax.tree.map(lambda _: replicated, params)

    def step(params, state, x, y, param_shardings=param_shardings):
      grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, x, y), state))(params)
      grads = jax.lax.with_sharding_constraint(grads, param_shardings)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(
      step,
      in_shardings=(param_shardings, shardings, batch_sharding, batch_sharding),
      out_shardings=(param_shardings, shardings),
    )
    scales = []
    for x, y in zip(xs, ys, strict=True):
      params, state = step(
        params, state, global_array(x, batch_sharding), global_array(y, batch_sharding)
      )
      scales.append(float(host(mpx.get_loss_scale(state))))
    masters = optax.tree.get(state, "master_params")
    results[name] = {
      "params": _digest(jax.tree.map(host, params)),
      "masters": _digest(jax.tree.map(host, masters)),
      "scales": scales,
      "skipped": int(host(state.skipped_steps)),
      "master_w_shard_rows": masters["w"].addressable_shards[0].data.shape[0],
    }

  # shard_map: each device gets its own gradients; one device of the last
  # process overflows. Every leaf is returned per device, stacked.
  smap_tx = mpx.loss_scale(mpx.mixed_precision(optax.sgd(0.5)), init_scale=8.0, axis_name="data")
  w16 = np.tile(np.asarray(params16["w"][:1]), (n, 1))  # one row per device
  stacked_params = global_array(w16, batch_sharding)
  stacked_state = jax.jit(jax.vmap(smap_tx.init), out_shardings=batch_sharding)(stacked_params)

  def per_device(grads, state, params):
    local = jax.tree.map(lambda x: x[0], (grads, state, params))
    updates, new_state = smap_tx.update(*local)
    new_params = optax.apply_updates(local[2], updates)
    return jax.tree.map(lambda x: x[None], (new_params, new_state))

  smap_step = jax.jit(
    jax_versions.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(P("data"), P("data"), P("data")),
      out_specs=(P("data"), P("data")),
      check_vma=False,
    )
  )
  grads = np.ones_like(w16)
  grads[-1, 0] = np.inf
  for g in (np.ones_like(w16), grads, np.ones_like(w16)):
    stacked_params, stacked_state = smap_step(
      global_array(g, batch_sharding), stacked_state, stacked_params
    )
  results["shard_map"] = {
    "scales": host(stacked_state.loss_scale).tolist(),
    "skipped": host(stacked_state.skipped_steps).tolist(),
    "params": _digest(host(stacked_params)),
  }
  print("RESULT " + json.dumps(results), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
