"""Hashes the programs every masters x moments step lowers to, to show a refactor changed none.

``python tests/tools/lowered_hashes.py OUT.json`` writes, for each lowered
form (the process's own, the GPU's, several devices') and each mode, the
sha256 of the step's and of init's StableHLO text;
``python tests/tools/lowered_hashes.py OUT.json --against BEFORE.json``
also prints each entry that differs and exits 1 if any does; ``--skip leaf``
hashes the ``skip="leaf"`` steps instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import mpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowering_forms import forced  # the tests folder, put on the path above

FORMS = (None, "gpu", "several-devices")
MASTERS = ("full", "remainder", "24bit", "stochastic")
MOMENTS: tuple[Any, ...] = ("full", "bfloat16", "8bit", "4bit", {"mu": "8bit", "nu": "4bit"})


def params(dtype: Any = jnp.bfloat16) -> dict[str, jax.Array]:
  """Leaves of each shape class a coder meets: blocked, long rows, a vector, an odd tail, f32."""
  return {
    "a": jnp.ones((64, 128), dtype),
    "b": jnp.ones((16, 2048), dtype),
    "c": jnp.ones((64,), dtype),
    "e": jnp.ones((3, 37), dtype),
    "d": jnp.ones((64,), jnp.float32),
  }


def digest(tx: optax.GradientTransformation, tree: Any) -> list[str]:
  """The sha256 of ``tx.update``'s and ``tx.init``'s lowered text."""
  state = jax.eval_shape(tx.init, tree)
  texts = (
    jax.jit(tx.update).lower(tree, state, tree).as_text(),
    jax.jit(tx.init).lower(tree).as_text(),
  )
  return [hashlib.sha256(text.encode()).hexdigest() for text in texts]


def hashes(skip: str = "step") -> dict[str, list[str]]:
  """Every entry: ``form|masters|moments`` (with ``skip``) and, for
  ``skip="step"``, the fp16 loss-scaled steps."""
  out = {}
  for form in FORMS:
    with forced(form):
      for masters in MASTERS:
        for moments in MOMENTS:
          tx = mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments=moments, skip=skip)
          out[f"{form}|{masters}|{json.dumps(moments)}"] = digest(tx, params())
      if skip == "leaf":  # loss_scale refuses skip="leaf"
        continue
      for moments in ("full", "8bit"):
        tx = mpx.loss_scale(mpx.mixed_precision(optax.adamw(1e-3), moments=moments))
        out[f"{form}|fp16 loss_scale|{moments}"] = digest(tx, params(jnp.float16))
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("--against", help="a file an earlier run wrote")
  parser.add_argument("--skip", choices=("step", "leaf"), default="step")
  args = parser.parse_args()
  out = hashes(args.skip)
  Path(args.out).write_text(json.dumps(out, indent=0) + "\n")
  print(f"{len(out)} programs hashed ({jax.device_count()} devices)")
  if args.against is None:
    return 0
  before = json.loads(Path(args.against).read_text())
  differ = [key for key in before.keys() | out.keys() if before.get(key) != out.get(key)]
  for key in sorted(differ):
    print(f"differs: {key}")
  return 1 if differ else 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  sys.exit(main())
