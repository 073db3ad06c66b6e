"""The tests' switch between the step's lowered forms, ``MPX_TEST_FORM``.

Read here, outside mpx, and applied through mpx's seam
``mpx._src.lowering.force_form``; CONTRIBUTING.md documents the values.
"""

import contextlib
import os

from mpx._src import lowering

ENVIRONMENT_VARIABLE = "MPX_TEST_FORM"


@contextlib.contextmanager
def forced(form: str | None):
  """Lowers every step traced inside to ``form``'s programs (None: the process's own)."""
  before = lowering.forced_form()
  lowering.force_form(form or None)
  try:
    yield
  finally:
    lowering.force_form(before)


def apply_environment() -> None:
  """Forces the form ``MPX_TEST_FORM`` names, for a whole process (a test's subprocess)."""
  lowering.force_form(os.environ.get(ENVIRONMENT_VARIABLE) or None)
