"""The tests' switch between the step's lowered forms, ``MPX_TEST_FORM``.

mpx asks jax which program it lowers (``mpx/_src/lowering.py``): the platform
(``jax.lax.platform_dependent``) and whether the process has several devices
(``jax.device_count``). A form answers those two questions differently, from
outside mpx; CONTRIBUTING.md documents the values.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax

ENVIRONMENT_VARIABLE = "MPX_TEST_FORM"

# A one-CPU-device process's program, a several-device CPU process's, and a
# GPU's (lowered for the CPU, and run there).
ONE_CPU, SEVERAL_DEVICES, ACCELERATOR = "one-cpu", "several-devices", "gpu"
FORMS = (ONE_CPU, SEVERAL_DEVICES, ACCELERATOR)

_platform_dependent, _device_count = jax.lax.platform_dependent, jax.device_count
_form: str | None = None


def _accelerators_branch(*operands, default, **branches):
  """``jax.lax.platform_dependent`` as a program lowered for a GPU takes it."""
  del branches
  return default(*operands)


def _apply(form: str | None) -> None:
  """Makes every later trace lower ``form``'s programs (None: the process's own)."""
  global _form
  if form is not None and form not in FORMS:
    raise ValueError(f"lowering form {form!r}: expected one of {', '.join(FORMS)} or None")
  counts = {
    ONE_CPU: lambda backend=None: 1,
    SEVERAL_DEVICES: lambda backend=None: max(2, _device_count(backend)),
  }
  jax.lax.platform_dependent = _accelerators_branch if form == ACCELERATOR else _platform_dependent
  jax.device_count = counts.get(form, _device_count)
  jax.clear_caches()  # no jitted program traced in one form is reused in another
  _form = form


def current() -> str | None:
  """Returns the form in force, or None (the process's own)."""
  return _form


@contextlib.contextmanager
def forced(form: str | None) -> Iterator[None]:
  """Lowers every step traced inside to ``form``'s programs (None: the
  process's own), then restores the form before it."""
  before = _form
  _apply(form)
  try:
    yield
  finally:
    _apply(before)


def apply_environment() -> None:
  """Forces the form ``MPX_TEST_FORM`` names, for a whole process (a test's subprocess)."""
  _apply(os.environ.get(ENVIRONMENT_VARIABLE) or None)
