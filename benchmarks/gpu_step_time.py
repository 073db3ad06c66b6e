"""One AdamW step timed on a real GPU: each masters/moments mode against plain optax.

Run on a machine with a GPU (`python benchmarks/gpu_step_time.py`): each
variant is one jitted, donated ``step(params, state, grads)`` on one bfloat16
leaf of ``(rows, 4096)`` (plain optax on float32 params for the baseline),
timed over ``--steps`` steps after a warm-up, all in one process so that the
ratios compare like with like. It also checks on the device what the CPU
tests check on XLA:CPU: remainder masters bitwise the full ones, a 24-bit
master's param its rounding, an eager step the jitted one, and no
conditional in the step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx

WIDTH = 4096


def _mpx(masters: str = "full", moments: str = "full") -> Callable[[], Any]:
  return lambda: mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments=moments)


# (name, param dtype, transformation factory), in the table's order.
VARIANTS: list[tuple[str, Any, Callable[[], optax.GradientTransformation]]] = [
  ("optax adamw, float32 params", jnp.float32, lambda: optax.adamw(1e-3)),
  ("optax adamw, bfloat16 params", jnp.bfloat16, lambda: optax.adamw(1e-3)),
  ("mpx full", jnp.bfloat16, _mpx()),
  ("mpx remainder", jnp.bfloat16, _mpx("remainder")),
  ("mpx remainder + 8bit", jnp.bfloat16, _mpx("remainder", "8bit")),
  ("mpx remainder + 4bit", jnp.bfloat16, _mpx("remainder", "4bit")),
  ("mpx 24bit + 8bit", jnp.bfloat16, _mpx("24bit", "8bit")),
  ("mpx 24bit + 4bit", jnp.bfloat16, _mpx("24bit", "4bit")),
  ("mpx stochastic + 4bit", jnp.bfloat16, _mpx("stochastic", "4bit")),
]


def _step(tx: optax.GradientTransformation) -> Callable[..., Any]:
  def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def time_variant(
  make: Callable[[], optax.GradientTransformation], dtype: Any, rows: int, steps: int
) -> tuple[float, float, bool]:
  """Returns (median ms a step, state B/param, whether the step has a conditional)."""
  tx = make()
  key = jax.random.PRNGKey(0)
  params = {"w": (0.02 * jax.random.normal(key, (rows, WIDTH))).astype(dtype)}
  grads = {"w": (1e-3 * jax.random.normal(jax.random.PRNGKey(1), (rows, WIDTH))).astype(dtype)}
  state = tx.init(params)
  n = rows * WIDTH
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state)) / n
  step = _step(tx)
  conditional = "conditional" in step.lower(params, state, grads).compile().as_text()
  for _ in range(3):
    params, state = step(params, state, grads)
  jax.block_until_ready((params, state))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times), state_bytes, conditional


def check_bits(rows: int, steps: int) -> list[str]:
  """Runs the device checks; returns one line each."""
  key = jax.random.PRNGKey(2)
  params = {"w": (0.05 * jax.random.normal(key, (rows, WIDTH))).astype(jnp.bfloat16)}
  grads = [
    {"w": jax.random.normal(jax.random.PRNGKey(10 + i), (rows, WIDTH)).astype(jnp.bfloat16)}
    for i in range(steps)
  ]

  def train(masters: str, moments: str) -> tuple[Any, Any]:
    """Returns the params and state after ``grads``, from a copy of ``params``."""
    tx = _mpx(masters, moments)()
    p = jax.tree.map(jnp.copy, params)  # the step donates them
    s = tx.init(p)
    step = _step(tx)
    for g in grads:
      p, s = step(p, s, g)
    return p, s

  lines = []
  for moments in ("full", "8bit", "4bit"):
    masters = {}
    for mode in ("full", "remainder"):
      p, s = train(mode, moments)
      masters[mode] = np.asarray(mpx.master_params(s, p)["w"]).view(np.uint32)
    same = bool(np.array_equal(masters["full"], masters["remainder"]))
    lines.append(f"remainder masters bitwise the full ones, {moments} moments: {same}")
  p, s = train("24bit", "4bit")
  master = mpx.master_params(s, p)["w"]
  bits = np.asarray(master).view(np.uint32)
  rounded = (bits + 0x8000) >> 16  # ties away: the bfloat16 param's bits
  param_bits = np.asarray(p["w"]).view(np.uint16).astype(np.uint32)
  lines.append(
    "24bit: low 8 bits zero, param its rounding: "
    f"{bool(np.all(bits & 0xFF == 0) and np.array_equal(rounded, param_bits))}; "
    f"stalled_steps {int(s.stalled_steps)} of {int(s.applied_steps)}"
  )
  lines.append(f"eager steps bitwise the jitted ones, every masters mode: {_eager_is_jitted(rows)}")
  return lines


def _eager_is_jitted(rows: int) -> bool:
  """Whether a step called eagerly (after a jitted one) computes the jitted
  step's bits: each masters mode with 4-bit moments, and float16 under
  loss_scale (where XLA:GPU's excess precision once dropped the rounding)."""
  rng = np.random.default_rng(3)
  cases = [(_mpx(m, "4bit")(), jnp.bfloat16) for m in ("full", "remainder", "24bit", "stochastic")]
  cases.append((mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-3))), jnp.float16))
  same = True
  for tx, dtype in cases:
    params = {"w": jnp.asarray(rng.normal(size=(rows, WIDTH)), dtype)}
    grads = [{"w": jnp.asarray(rng.normal(size=(rows, WIDTH)), dtype)} for _ in range(2)]
    updates, state = jax.jit(tx.update)(grads[0], tx.init(params), params)
    params = optax.apply_updates(params, updates)
    eager = tx.update(grads[1], state, params)
    jitted = jax.jit(tx.update)(grads[1], state, params)
    pairs = zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True)
    same &= all(np.array_equal(_bytes(a), _bytes(b)) for a, b in pairs)
  return bool(same)


def _bytes(x: Any) -> np.ndarray:
  return np.atleast_1d(np.asarray(x)).view(np.uint8)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", default="4096,16384", help="leaf rows (x 4096 elements)")
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args(argv)
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}, optax {optax.__version__}")
  for line in check_bits(256, 10):
    print(line)
  for rows in (int(r) for r in args.rows.split(",")):
    n = rows * WIDTH
    print(f"\nOne leaf of {rows} x {WIDTH} = {n / 2**20:.0f}M params; median of {args.steps} steps")
    print("| step | state B/param | conditional | ms | vs optax float32 |")
    print("|:--|--:|:--|--:|--:|")
    base = None
    for name, dtype, make in VARIANTS:
      try:
        ms, state_bytes, conditional = time_variant(make, dtype, rows, args.steps)
      except Exception as error:  # a variant's failure is a row, not the end
        print(f"| {name} | failed: {type(error).__name__}: {str(error)[:200]} | | | |")
        continue
      base = ms if base is None else base
      print(f"| {name} | {state_bytes:.2f} | {conditional} | {ms:.3f} | {ms / base:.2f}x |")


if __name__ == "__main__":
  main()
