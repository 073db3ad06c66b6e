"""What differs between the jax and flax releases mpx supports
(docs/design.md, "Supported versions")."""

from __future__ import annotations

import re
import sys
from typing import Any

import jax


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


JAX = _version(jax.__version__)


def jax_at_least(version: str) -> bool:
  """Returns whether the running jax is ``version`` or newer (e.g. ``"0.7.0"``)."""
  return _version(version) <= JAX


FLOAT8_NEEDS_JAX = "0.7.0"


def check_float8_supported(dtypes: set[Any]) -> None:
  """Raises where float8 params meet a jax whose XLA rounds to float8 wrongly
  (below 0.7.0), so the params would not be the rounded masters. Pinned by
  tests/test_fp8.py."""
  names = sorted(str(d) for d in dtypes if "float8" in str(d))
  if names and not jax_at_least(FLOAT8_NEEDS_JAX):
    raise ValueError(
      f"mixed_precision: float8 params ({', '.join(names)}) need jax >= {FLOAT8_NEEDS_JAX}; "
      f"this is jax {jax.__version__}, whose XLA rounds float32 to float8 wrongly for about "
      "one value in 250"
    )


NNX_NEEDS_FLAX = "0.12.1"


def check_nnx_supported() -> None:
  """Raises where ``nnx.Optimizer`` holds mpx's state under a flax older than
  0.12.1, whose ``Variable.get_value`` and ``out_sharding`` mpx's rewrapping
  needs. Pinned by tests/test_containers.py."""
  flax = sys.modules.get("flax")
  found = getattr(flax, "__version__", "0")
  if _version(found) < _version(NNX_NEEDS_FLAX):
    raise ValueError(
      f"mpx inside flax nnx.Optimizer needs flax >= {NNX_NEEDS_FLAX} (which needs jax >= "
      f"0.8.1); this is flax {found}. flax's linen TrainState works with older flax."
    )
