"""XLA:CPU's scratch for mpx's finite check and step, on the running jax.

The figures that change between jax releases (docs/design.md, "Supported
versions"), in bytes of scratch per parameter: ``python benchmarks/xla_cpu_figures.py``.
``--check-time`` also times a 16M-parameter AdamW step in XLA:CPU's forms
against the same step with the accelerators' finite check, then with their
skip as well (what each CPU form earns, docs/design.md's workaround table).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

import mpx

# The tests' switch between the step's lowered forms (CONTRIBUTING.md).
TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:
  sys.path.insert(0, str(TESTS))

from lowering_forms import ACCELERATOR, ONE_CPU, SEVERAL_DEVICES, forced  # noqa: E402


def check_scratch(dtype, n: int = 1 << 20) -> float:
  """Measures the single-CPU finite check's scratch per element over ``n`` elements."""
  tree = {"w": jnp.ones((n // 1024, 1024), dtype), "b": jnp.ones(1024, dtype)}
  with forced(ONE_CPU):
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

  with forced(ONE_CPU):
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
  n = sum(math.prod(s) for s in shapes.values())
  return compiled.memory_analysis().temp_size_in_bytes / n


def step_seconds(dtype, tx: optax.GradientTransformation, form: str, rounds: int = 5) -> float:
  """Returns the fastest of ``rounds`` medians of 10 donated steps on 16 1024x1024
  leaves (16.8M parameters) with the step lowered in ``form``."""
  params = {f"w{i}": jnp.full((1024, 1024), 0.5, dtype) for i in range(16)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with forced(form):
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  params, state = jax.block_until_ready(compiled(params, state, grads))
  medians = []
  for _ in range(rounds):
    times = []
    for _ in range(10):
      start = time.perf_counter()
      params, state = jax.block_until_ready(compiled(params, state, grads))
      times.append(time.perf_counter() - start)
    medians.append(sorted(times)[len(times) // 2])
  return min(medians)


def check_time() -> None:
  """Prints the step time with each of the accelerators' forms over XLA:CPU's:
  the finite check, then the skip as a select instead of a ``lax.cond``."""
  cases = {
    "fp16 loss_scale(mixed_precision(adamw))": (
      jnp.float16,
      mpx.loss_scale(mpx.mixed_precision(optax.adamw(1e-3))),
    ),
    "bf16 mixed_precision(adamw)": (jnp.bfloat16, mpx.mixed_precision(optax.adamw(1e-3))),
  }
  for name, (dtype, tx) in cases.items():
    # SEVERAL_DEVICES keeps the CPU's skip and takes the accelerators' check;
    # ACCELERATOR takes both (with full moments nothing else differs).
    single, check, select = (
      step_seconds(dtype, tx, f) for f in (ONE_CPU, SEVERAL_DEVICES, ACCELERATOR)
    )
    print(
      f"{name}: XLA:CPU's forms {single * 1e3:.1f} ms per step; with the accelerators' "
      f"check {check * 1e3:.1f} ms ({check / single:.2f}x); and their skip by select "
      f"{select * 1e3:.1f} ms ({select / check:.2f}x the cond)"
    )


def main() -> None:
  """Prints one row of docs/design.md's table for the running jax."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check-time", action="store_true", help="also time the check's forms")
  args = parser.parse_args()
  checks = ", ".join(
    f"{jnp.dtype(d).name} {check_scratch(d):.2f}" for d in (jnp.float32, jnp.bfloat16, jnp.float16)
  )
  fp16 = step_scratch(jnp.float16, mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3))))
  bf16 = step_scratch(jnp.bfloat16, mpx.mixed_precision(optax.adam(1e-3)))
  print(f"| {jax.__version__} | {checks} | {bf16:.2f} | {fp16:.2f} |")
  if args.check_time:
    check_time()


if __name__ == "__main__":
  main()
