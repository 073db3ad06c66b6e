"""When XLA:GPU updates a scanned layer's slice of a stacked array in place.

A ``lax.scan`` over 8 layers of float32 ``(4096, 1024)`` slices, each
iteration updating its layer of one to three stacked arrays from a bfloat16
gradient, as an optimizer step inside the backward scan does (``a`` and
``b`` as Adam's moments; ``m``, a master, from both new moments). Compiled
for an H100 (donated, not run), it prints the step's scratch in layer slices:
0 where every new slice is computed into its stack in place, 1 for each new
slice written out before its copy into the stack. ``squeeze`` slices a
layer by ``dynamic_index_in_dim`` (a slice, then a bitcast that drops the
layer axis), ``slice`` keeps the axis. ``python benchmarks/scan_in_place.py``.
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.gpu_variants import topology  # noqa: E402

LAYERS, ROWS, COLUMNS = 8, 4096, 1024


def scratch_in_slices(updated: int, squeeze: bool, topo: object) -> float:
  """The compiled step's scratch over one float32 layer slice, with the first
  ``updated`` of ``a``, ``b``, ``m`` written back each iteration."""

  def layer(carry: tuple, i: jax.Array) -> tuple:
    a, b, m, g = carry
    take = lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=not squeeze)  # noqa: E731
    a_i, b_i, m_i, g_i = take(a), take(b), take(m), take(g).astype(jnp.float32)
    new_a = 0.9 * a_i + 0.1 * g_i
    new_b = 0.999 * b_i + 0.001 * g_i * g_i
    new_m = m_i - 1e-3 * new_a / (jnp.sqrt(new_b) + 1e-8)
    put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0)  # noqa: E731
    arrays = [a, b, m]
    for k, new in enumerate((new_a, new_b, new_m)[:updated]):
      arrays[k] = put(arrays[k], new)
    return (*arrays, g), None

  def step(a: jax.Array, b: jax.Array, m: jax.Array, g: jax.Array) -> tuple:
    (a, b, m, _), _ = jax.lax.scan(layer, (a, b, m, g), jnp.arange(LAYERS), reverse=True)
    return a, b, m

  sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])  # type: ignore[attr-defined]
  stack = jax.ShapeDtypeStruct((LAYERS, ROWS, COLUMNS), jnp.float32, sharding=sharding)
  grads = jax.ShapeDtypeStruct((LAYERS, ROWS, COLUMNS), jnp.bfloat16, sharding=sharding)
  jitted = jax.jit(step, donate_argnums=(0, 1, 2))
  compiled = jitted.trace(stack, stack, stack, grads).lower(lowering_platforms=("cuda",)).compile()
  return compiled.memory_analysis().temp_size_in_bytes / (ROWS * COLUMNS * 4)


def main() -> None:
  topo = topology()
  print(f"{LAYERS} layers of float32 ({ROWS}, {COLUMNS}); XLA (jax {jax.__version__}), H100")
  print("\n| arrays updated | squeeze: scratch, in slices | slice: scratch, in slices |")
  print("|:--|--:|--:|")
  names = ("a", "a, b", "a, b, m (m from the new a and b)")
  for updated, name in enumerate(names, start=1):
    row = [scratch_in_slices(updated, squeeze, topo) for squeeze in (True, False)]
    print(f"| {name} | {row[0]:.2f} | {row[1]:.2f} |")


if __name__ == "__main__":
  main()
