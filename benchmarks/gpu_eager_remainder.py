"""Reproduces, on a GPU, the eager remainder step that stores zero remainders.

``OUT=DIR python benchmarks/gpu_eager_remainder.py`` runs two jitted AdamW steps
with remainder masters, then a third called eagerly, and captures that step's
one jitted function (``verdict.run_if_finite``'s ``on_arrays``; its optimized
HLO goes to ``DIR/on_arrays.hlo``). On an H100 (jax 0.11.2) the function's
new remainders were zero in 3,456 of 4,096 elements, where the same function
run op by op (``jax.disable_jit``) and the whole step jitted gave the right
ones; its HLO is benchmarks/gpu/h100_eager_remainder_step.hlo. On a CPU all
three agree. An open issue: docs/benchmarks_gpu_timed.md.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx
from mpx._src import lowering, verdict


def _first(tree: Any) -> np.ndarray:
  return np.asarray(jax.tree.leaves(tree)[0])


def main() -> None:
  out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
  picks = jax.lax.platform_dependent(cpu=lambda: jnp.int32(0), default=lambda: jnp.int32(1))
  print("eager platform_dependent picks the accelerator form:", bool(picks))
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(32, 128)), jnp.bfloat16)}
  grads = [{"w": jnp.asarray(rng.normal(size=(32, 128)), jnp.bfloat16)} for _ in range(3)]
  tx = mpx.mixed_precision(optax.adamw(1e-2, weight_decay=0.1), masters="remainder")
  state = tx.init(params)
  jitted = jax.jit(tx.update)
  for g in grads[:2]:
    updates, state = jitted(g, state, params)
    params = optax.apply_updates(params, updates)

  real_jit, captured = jax.jit, {}

  def capturing_jit(fn: Any, *args: Any, **kwargs: Any) -> Any:
    compiled = real_jit(fn, *args, **kwargs)

    def call(*call_args: Any) -> Any:
      captured.update(fn=fn, args=call_args, out=compiled(*call_args))
      hlo = compiled.lower(*call_args).compile().as_text()
      (out_dir / "on_arrays.hlo").write_text(hlo)
      return captured["out"]

    return call

  verdict.jax.jit = capturing_jit
  try:
    # The GPU's form on any machine (a GPU lowers to it anyway).
    with lowering.forced(lowering.ACCELERATOR):
      _, eager_state = tx.update(grads[2], state, params)
  finally:
    verdict.jax.jit = real_jit
  from_step = _first(captured["out"][0])
  print(
    "the jitted function's remainders:", from_step.ravel()[:4], "zeros", int((from_step == 0).sum())
  )
  print(
    "the eager step's stored remainders:",
    np.asarray(eager_state.master_remainders["w"]).ravel()[:4],
  )
  with jax.disable_jit():
    op_by_op = _first(captured["fn"](*captured["args"])[0])
  print("op by op:", op_by_op.ravel()[:4], "zeros", int((op_by_op == 0).sum()))
  _, jitted_state = jitted(grads[2], state, params)
  print("the whole step jitted:", np.asarray(jitted_state.master_remainders["w"]).ravel()[:4])


if __name__ == "__main__":
  main()
