"""Eager ``tx.init`` and ``mpx.master_params`` against the same calls jitted.

Each moments format's ``mixed_precision`` on one tree of bf16 leaves (three
copies of 8 transformer-like shapes), in a fresh process per format: the
first call (which compiles) and a repeat, eagerly and under ``jax.jit``.
Eagerly, init makes and views each master and codes each compressed moment
by one jitted call a leaf, cached by shape (``tree.jitted_when_eager``, from
``storage.initialized``, ``storage.viewed`` and ``moments._coded``).
``--smoke``: one copy of smaller shapes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

SHAPES = [
  *[(256, 256), (256, 1024), (1024, 256), (256,)],
  *[(512, 512), (512, 2048), (2048, 512), (512,)],
]
SMOKE_SHAPES = [(32, 256), (256,)]
FORMATS = ("full", "8bit", "4bit")


def _seconds(call: Any) -> float:
  import jax

  start = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - start


def measure(moments: str, smoke: bool) -> dict[str, float]:
  """Returns the seconds of each call, in this process (its caches cold)."""
  import jax
  import jax.numpy as jnp
  import optax

  import mpx

  shapes, copies = (SMOKE_SHAPES, 1) if smoke else (SHAPES, 3)
  leaves = [(f"l{i}_{j}", shape) for i in range(copies) for j, shape in enumerate(shapes)]
  params = {name: jnp.ones(shape, jnp.bfloat16) for name, shape in leaves}
  tx = mpx.mixed_precision(optax.adamw(1e-3), masters="remainder", moments=moments)
  jitted_init = jax.jit(tx.init)
  state = jitted_init(params)
  jitted_view = jax.jit(mpx.master_params)
  return {
    "eager init, first": _seconds(lambda: tx.init(params)),
    "eager init, again": _seconds(lambda: tx.init(params)),
    "jit init, again": _seconds(lambda: jitted_init(params)),
    "eager master_params": _seconds(lambda: mpx.master_params(state, params)),
    "jit master_params, first": _seconds(lambda: jitted_view(state, params)),
    "jit master_params, again": _seconds(lambda: jitted_view(state, params)),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="one copy of two small shapes")
  parser.add_argument("--one", choices=FORMATS, help=argparse.SUPPRESS)  # the child process
  args = parser.parse_args(argv)
  if args.one:
    for name, seconds in measure(args.one, args.smoke).items():
      print(f"{name}\t{seconds:.4f}")
    return
  print("| moments | eager init, first (s) | eager init, again / jit init, again |"
        " eager master_params / jit's, again |")  # fmt: skip
  print("|:--|--:|--:|--:|")
  for moments in FORMATS:
    child = [sys.executable, __file__, "--one", moments, *(["--smoke"] if args.smoke else [])]
    out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
    t = dict((name, float(s)) for name, s in (line.split("\t") for line in out.splitlines()))
    init_ratio = t["eager init, again"] / t["jit init, again"]
    view_ratio = t["eager master_params"] / t["jit master_params, again"]
    print(f"| {moments} | {t['eager init, first']:.2f} | {init_ratio:.1f}x | {view_ratio:.1f}x |")


if __name__ == "__main__":
  main()
