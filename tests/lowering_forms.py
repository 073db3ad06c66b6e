"""The tests' switch between the step's lowered forms, ``MPX_TEST_FORM``.

mpx asks jax which program it lowers (``tree.by_platform`` in ``mpx/_src/tree.py``): the platform
(``jax.lax.platform_dependent``) and whether the process has several devices
(``jax.device_count``). A form answers those two questions differently, from
outside mpx; CONTRIBUTING.md documents the values.

jax keeps a trace by the function traced, whatever a jit of it: a function
traced in one form and called in another would run the first form's program.
Switching evicts the traces of the jitted functions that outlive a form
(:data:`OUTLIVE_A_FORM`) and nothing else: every compiled program stays, and
a test's own steps are jitted afresh per form, or cached by :func:`current`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

from mpx._src import tree

ENVIRONMENT_VARIABLE = "MPX_TEST_FORM"

# A one-CPU-device process's program, a several-device CPU process's, and a
# GPU's (lowered for the CPU, and run there).
ONE_CPU, SEVERAL_DEVICES, ACCELERATOR = "one-cpu", "several-devices", "gpu"
FORMS = (ONE_CPU, SEVERAL_DEVICES, ACCELERATOR)

# The module-level jitted functions that trace mpx's steps: eager init,
# master_params and moment compression run through tree.jitted_when_eager's
# one jit, cached by the function it calls and the shapes, not by the form.
OUTLIVE_A_FORM: tuple[Any, ...] = (tree._jitted,)

_platform_dependent, _device_count = jax.lax.platform_dependent, jax.device_count
_form: str | None = None


def _accelerators_branch(*operands: Any, default: Callable[..., Any], **branches: Any) -> Any:
  """``jax.lax.platform_dependent`` as a program lowered for a GPU takes it."""
  del branches
  return default(*operands)


def _one_device(backend: Any = None) -> int:
  del backend
  return 1


def _several_devices(backend: Any = None) -> int:
  return max(2, _device_count(backend))


def _apply(form: str | None) -> None:
  """Makes every later trace lower ``form``'s programs (None: the process's own)."""
  global _form
  if form is not None and form not in FORMS:
    raise ValueError(f"lowering form {form!r}: expected one of {', '.join(FORMS)} or None")
  if form == _form:
    return
  jax.lax.platform_dependent = _accelerators_branch if form == ACCELERATOR else _platform_dependent
  jax.device_count = {ONE_CPU: _one_device, SEVERAL_DEVICES: _several_devices}.get(
    form, _device_count
  )
  for jitted in OUTLIVE_A_FORM:
    # The C++ cache of its programs, its traces and jit's cache of traced
    # parameters (jax's pjit.py: the jitted function's clear_cache).
    jitted.clear_cache()
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
