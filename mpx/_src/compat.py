"""What differs between the jax and flax releases mpx supports, in one place.

Each entry names the releases it serves and the test that pins it; the table
is docs/design.md's "Supported versions".
"""

from __future__ import annotations

import re
import sys
from typing import Any

import jax


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


JAX = _version(jax.__version__)


def jax_at_least(version: str) -> bool:
  """Whether the running jax is ``version`` or newer (e.g. ``"0.7.0"``)."""
  return _version(version) <= JAX


def shape_dtype_struct_like(x: Any) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct.like(x)``: shape, dtype, sharding and weak type.

  ``ShapeDtypeStruct.like`` is jax 0.10.2's; below, the same struct is built
  from ``jax.typeof``. Pinned by tests/test_fault_injection.py (the skipped
  branch's zeros take these structs) at the floor and at the newest jax.
  """
  like = getattr(jax.ShapeDtypeStruct, "like", None)
  if like is not None:
    return like(x)
  aval = jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  if sharding is not None and getattr(sharding.mesh, "empty", False):
    sharding = None  # an abstract sharding of no mesh: what `like` leaves out
  return jax.ShapeDtypeStruct(
    aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False)
  )


def varying_axes_of(aval: Any) -> frozenset[Any]:
  """The mesh axes a value of type ``aval`` varies over inside ``shard_map``.

  jax 0.10 records them as ``aval.manual_axis_type.varying``, jax 0.6.1 to
  0.9 as ``aval.vma``; below 0.6.1 types carry none, so this is empty and
  the checks that need it cannot fire. Pinned by tests/test_shard_map_vma.py.
  """
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", None) or getattr(aval, "vma", None) or ())


FLOAT8_NEEDS_JAX = "0.7.0"


def check_float8_supported(dtypes: set[Any]) -> None:
  """Raise where float8 params meet a jax whose XLA rounds to float8 wrongly.

  Before jax 0.7.0, XLA:CPU's float32 to float8 conversion rounds about one
  value in 250 to the wrong neighbour, so the params would not be the rounded
  masters. Pinned by tests/test_fp8.py.
  """
  names = sorted(str(d) for d in dtypes if "float8" in str(d))
  if names and not jax_at_least(FLOAT8_NEEDS_JAX):
    raise ValueError(
      f"mixed_precision: float8 params ({', '.join(names)}) need jax >= {FLOAT8_NEEDS_JAX}; "
      f"this is jax {jax.__version__}, whose XLA rounds float32 to float8 wrongly for about "
      "one value in 250"
    )


NNX_NEEDS_FLAX = "0.12.1"


def check_nnx_supported() -> None:
  """Raise where ``nnx.Optimizer`` holds mpx's state under a flax too old for it.

  mpx rewraps the ``Variable``s that ``nnx.Optimizer`` (flax 0.11 and later)
  puts around its state leaves with ``Variable.get_value`` and the
  ``out_sharding`` metadata of flax 0.12.1 and later. flax's linen
  ``TrainState`` works with every flax. Pinned by tests/test_containers.py.
  """
  flax = sys.modules.get("flax")
  found = getattr(flax, "__version__", "0")
  if _version(found) < _version(NNX_NEEDS_FLAX):
    raise ValueError(
      f"mpx inside flax nnx.Optimizer needs flax >= {NNX_NEEDS_FLAX} (which needs jax >= "
      f"0.8.1); this is flax {found}. flax's linen TrainState works with older flax."
    )
