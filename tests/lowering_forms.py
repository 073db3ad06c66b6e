"""The tests' switch between the step's lowered forms, ``MPX_TEST_FORM``.

Read here, outside mpx, and applied through mpx's seam
``mpx._src.lowering.force_form``; CONTRIBUTING.md documents the values.
"""

import os

from mpx._src import lowering
from mpx._src.lowering import forced  # noqa: F401 (the tests' context manager)

ENVIRONMENT_VARIABLE = "MPX_TEST_FORM"


def apply_environment() -> None:
  """Forces the form ``MPX_TEST_FORM`` names, for a whole process (a test's subprocess)."""
  lowering.force_form(os.environ.get(ENVIRONMENT_VARIABLE) or None)
