"""Which program a step is lowered to: XLA:CPU's or the accelerators'
(docs/design.md, "Two platforms, one step")."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

# The programs a test may force: a one-CPU-device process's, a
# several-device CPU process's, and a GPU's (lowered for the CPU).
ONE_CPU, SEVERAL_DEVICES, ACCELERATOR = "one-cpu", "several-devices", "gpu"
FORMS = (ONE_CPU, SEVERAL_DEVICES, ACCELERATOR)

_forced: str | None = None


def force_form(form: str | None) -> None:
  """Makes every later trace lower ``form``'s programs (None: the process's own).

  The tests' seam (tests/lowering_forms.py reads their switch,
  ``MPX_TEST_FORM``): it lets one CPU process run the GPU program's forms,
  or a one-device process's in a process of 8 host devices.
  """
  global _forced
  if form is not None and form not in FORMS:
    raise ValueError(f"lowering form {form!r}: expected one of {', '.join(FORMS)} or None")
  _forced = form


def forced_form() -> str | None:
  """Returns the form :func:`force_form` set, or None."""
  return _forced


@contextlib.contextmanager
def forced(form: str | None) -> Iterator[None]:
  """Lowers every step traced inside to ``form``'s programs (None: the
  process's own), then restores the form before it."""
  before = _forced
  force_form(form)
  try:
    yield
  finally:
    force_form(before)


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
  several = _forced == SEVERAL_DEVICES or (_forced is None and jax.device_count() > 1)
  if _forced == ACCELERATOR or (cpu_needs_one_device and several):
    return accelerator(*operands)
  return jax.lax.platform_dependent(*operands, cpu=cpu, default=accelerator)
