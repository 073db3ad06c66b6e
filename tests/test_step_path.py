"""What a reader follows through one fp16 step, counted as
``benchmarks/maintainability.py`` counts it (docs/design.md, "The step, top to bottom")."""

from __future__ import annotations

import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import maintainability  # noqa: E402


def test_one_fp16_step_reads_8_modules_35_functions_and_12_more_for_its_checks():
  calls = maintainability.trace_step()
  files = {f for f, _, _ in calls}
  outside = {(f, name) for f, name, checking in calls if not checking}
  assert len(files) <= 8, sorted(files)
  assert len(outside) <= 35, "\n".join(f"{f}:{name}" for f, name in sorted(outside))
  checks_only = {(f, name) for f, name, _ in calls} - outside
  assert len(checks_only) <= 12, "\n".join(f"{f}:{name}" for f, name in sorted(checks_only))
  # The checks are a side road: nothing in validation.py runs outside them.
  assert not any(f.endswith("validation.py") for f, _ in outside)


def test_each_transformation_checks_its_inputs_once_per_trace():
  entries = collections.Counter(name for f, name, _ in maintainability.trace_step())
  assert entries["check_loss_scale_inputs"] == 1
  assert entries["check_mixed_precision_inputs"] == 1
  assert entries["check_inner_results"] == 1  # inside the one step on the masters
  assert entries["check_gradients"] == 1  # the handover checks them in mixed_precision alone
