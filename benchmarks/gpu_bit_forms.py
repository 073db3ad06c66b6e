"""Runs the bit operations of mpx's masters on a GPU and on the CPU, and compares.

Run on a machine with a GPU (``python benchmarks/gpu_bit_forms.py``). Each row
jits one small function of float32 bits on both devices and prints how many
output bytes differ; XLA:CPU is the reference. The first rows are the forms
XLA:GPU computed wrongly (jax 0.11.2 on an H200, docs/benchmarks_gpu_timed.md):
a truncating convert of a computed float's low bits became a float-to-int
conversion, and a round trip to float16 inside a fusion was dropped. The
last rows are mpx's forms, which must show 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import rounding, tree

U32 = np.uint32


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _forms() -> dict[str, tuple[Callable[..., Any], bool]]:
  """Name: (function of one float32 array, whether mpx relies on its form)."""
  return {
    "low 16 bits of x*3 by a truncating convert": (
      lambda x: jax.lax.bitwise_and(_bits(x * 3), U32(0xFFFF)).astype(jnp.uint16),
      False,
    ),
    "high 16 bits of x*3 (a shift, then the convert)": (
      lambda x: jax.lax.shift_right_logical(_bits(x * 3), U32(16)).astype(jnp.uint16),
      False,
    ),
    "x*3 to float16 and back (the round trip)": (
      lambda x: (x * 3).astype(jnp.float16).astype(jnp.float32) - x,
      False,
    ),
    "rounding.remainder(x*3)": (lambda x: rounding.remainder(rounding.canonical(x * 3)), True),
    "rounding.split(x*3)": (lambda x: rounding.split(rounding.canonical(x * 3)), True),
    "tree.round_as(x*3, float16)": (
      lambda x: tree.round_as(x * 3, jnp.float16) - x,
      True,
    ),
    "the 24-bit correction of round_to_24bit(x*3)": (
      lambda x: jax.lax.shift_right_arithmetic(
        rounding.remainder(rounding.round_to_24bit(x * 3)), np.int16(8)
      ).astype(jnp.int8),
      True,
    ),
  }


def main() -> None:
  cpu, device = jax.devices("cpu")[0], jax.devices()[0]
  print(f"device: {device.device_kind}, jax {jax.__version__}")
  x = np.random.default_rng(0).normal(size=(32, 128)).astype(np.float32)
  failed = []
  for name, (fn, relied_on) in _forms().items():
    outs = [jax.tree.leaves(jax.jit(fn)(jax.device_put(x, d))) for d in (device, cpu)]
    wrong = sum(
      int((np.asarray(a).view(np.uint8) != np.asarray(b).view(np.uint8)).sum())
      for a, b in zip(*outs, strict=True)
    )
    print(f"{wrong:6d} bytes differ  {name}")
    if relied_on and wrong:
      failed.append(name)
  if failed:
    raise SystemExit(f"mpx's forms differ from XLA:CPU's on {device.device_kind}: {failed}")


if __name__ == "__main__":
  main()
