"""Which program a step is lowered to: XLA:CPU's or the accelerators'
(docs/design.md, "Two platforms, one step")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def by_platform(
  *operands: Any,
  cpu: Callable[..., Any],
  accelerator: Callable[..., Any],
  cpu_needs_one_device: bool = False,
) -> Any:
  """Returns ``cpu(*operands)`` in a program lowered for XLA:CPU, else
  ``accelerator(*operands)``.

  The platform the step is lowered for decides (``lax.platform_dependent``),
  never the process's devices: a CPU process compiles for an H100 ahead of
  time, a GPU process runs CPU programs too. ``cpu_needs_one_device`` keeps
  the accelerator form in a process of several devices, for CPU forms that
  read single elements of leaves a mesh may split (XLA would gather them).
  """
  if cpu_needs_one_device and jax.device_count() > 1:
    return accelerator(*operands)
  return jax.lax.platform_dependent(*operands, cpu=cpu, default=accelerator)
