"""XLA:CPU's scratch for mpx's finite check and step, on the running jax.

The figures that change between jax releases (docs/design.md, "Supported
versions"), in bytes of scratch per parameter: ``python benchmarks/xla_cpu_figures.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

import mpx
from mpx._src import lowering


def check_scratch(dtype, n: int = 1 << 20) -> float:
  """Measures the single-CPU finite check's scratch per element over ``n`` elements."""
  tree = {"w": jnp.ones((n // 1024, 1024), dtype), "b": jnp.ones(1024, dtype)}
  with lowering.forced(lowering.ONE_CPU):
    compiled = jax.jit(lambda tree: mpx.all_finite(tree)).lower(tree).compile()
  return compiled.memory_analysis().temp_size_in_bytes / n


def step_scratch(dtype, tx: optax.GradientTransformation) -> float:
  """Measures the donated step's scratch per parameter on a small tree."""
  shapes = {"a": (256, 512), "b": (512, 256), "c": (512,), "d": (512,)}
  params = {k: jnp.ones(s, dtype) for k, s in shapes.items()}
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with lowering.forced(lowering.ONE_CPU):
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
  n = sum(math.prod(s) for s in shapes.values())
  return compiled.memory_analysis().temp_size_in_bytes / n


def main() -> None:
  """Prints one row of docs/design.md's table for the running jax."""
  checks = ", ".join(
    f"{jnp.dtype(d).name} {check_scratch(d):.2f}" for d in (jnp.float32, jnp.bfloat16, jnp.float16)
  )
  fp16 = step_scratch(jnp.float16, mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3))))
  bf16 = step_scratch(jnp.bfloat16, mpx.mixed_precision(optax.adam(1e-3)))
  print(f"| {jax.__version__} | {checks} | {bf16:.2f} | {fp16:.2f} |")


if __name__ == "__main__":
  main()
