"""Reads ``MPX_TEST_FORM``, the tests' switch between the step's lowered forms.

Unset, each form follows the process and the lowering platform; CONTRIBUTING.md
documents the values.
"""

from __future__ import annotations

import os

# The forms of the finite check and the skip that the switch can force.
ONE_CPU, SEVERAL_DEVICES, GPU = "one-cpu", "several-devices", "gpu"
FORMS = (ONE_CPU, SEVERAL_DEVICES, GPU)


def forced_form() -> str | None:
  """Returns the form ``MPX_TEST_FORM`` forces (one of :data:`FORMS`), or None.

  Read on every call, so a test may switch it between traces.
  """
  value = os.environ.get("MPX_TEST_FORM", "")
  if value:
    if value not in FORMS:
      raise ValueError(f"MPX_TEST_FORM={value!r}: expected one of {', '.join(FORMS)} or unset")
    return value
  return None
