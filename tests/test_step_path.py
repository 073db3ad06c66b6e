"""What a reader follows through one fp16 step, counted as
``benchmarks/maintainability.py`` counts it (docs/design.md, "The step, top to bottom")."""

from __future__ import annotations

import collections
import pathlib
import sys
from unittest import mock

import pytest
from lowering_forms import forced

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import maintainability  # noqa: E402


def traced(step: str = "fp16 step"):
  """``maintainability.trace_step(step)`` in the form a one-device process
  lowers, as the benchmark counts it (this process has 8 host devices), and
  as if flax were not imported (the benchmark's process has no linen boxes to
  look for; another test may have imported it here)."""
  with forced("one-cpu"), mock.patch.dict(sys.modules, {"flax.core.meta": None}):
    return maintainability.trace_step(step)


@pytest.fixture(scope="module")
def calls():
  return traced()


@pytest.mark.slow  # the fixture traces the fp16 step: 5 s
def test_one_fp16_step_reads_6_modules_45_functions_12_of_them_for_its_checks(calls):
  path = maintainability.step_path(calls)
  assert len(path.files) <= 6, path.files
  assert len(path.functions) <= 45, "\n".join(f"{f}:{name}" for f, name in path.functions)
  assert len(path.checks_only) <= 12, "\n".join(
    f"{f}:{name}" for f, name in sorted(path.checks_only)
  )
  # The checks are a side road: nothing in validation.py runs outside them.
  outside = set(path.functions) - path.checks_only
  assert not any(f.endswith("validation.py") for f, _ in outside)


@pytest.mark.slow
def test_each_transformation_checks_its_inputs_once_per_trace(calls):
  entries = collections.Counter(name for _, name, _ in calls)
  assert entries["check_loss_scale_inputs"] == 1
  assert entries["check_mixed_precision_inputs"] == 1
  assert entries["check_inner_results"] == 1  # inside the one step on the masters
  assert entries["check_gradients"] == 1  # the handover checks them in mixed_precision alone


# The compressed steps' ceilings, checks included, each traced as if first in
# its process (``trace_step`` clears jax's caches: a function whose trace jax
# kept from an earlier step is counted again). Issue 48 aims at 75 for both.
# The 8-bit step's 74 include the float-like code's rounding and decoding
# (``_float_level``, ``_float_level_bits``) and the first pass's reduction
# (each kind's ``reduced`` and ``scales_of``, the blocks cut by ``_blocked``);
# the per-field step reads those and 18 more: the 4-bit codec (its kind's
# five methods, layout and four packings, one of each pair per platform), the
# range levels of its nu (``range_words``, ``_range_fields``, ``_range_code``,
# ``_complement``) and the 24-bit masters' rounding and stall count.
COMPRESSED_CEILINGS = {"remainder + 8bit step": (9, 74), "24bit + per-field step": (9, 92)}


@pytest.mark.slow  # two traces of compressed steps: 15 s on 2 cores
@pytest.mark.parametrize("step", sorted(COMPRESSED_CEILINGS))
def test_the_compressed_steps_read_no_more_modules_and_functions_than_today(step):
  path = maintainability.step_path(traced(step))
  files, functions = COMPRESSED_CEILINGS[step]
  assert len(path.files) <= files, path.files
  assert len(path.functions) <= functions, len(path.functions)


def test_module_docstrings_public_docstrings_and_benchmark_files_stay_within_their_limits():
  # Issue 48's limits: a module says its one job in a line or few; the long
  # story is in docs/, and a benchmark that outgrows a file is two.
  module_total, public = maintainability.docstrings(ROOT)
  assert module_total <= 80, module_total
  assert [(n, name) for n, name in public if n > 45] == []
  long_files = [
    (p.name, n)
    for p in sorted((ROOT / "benchmarks").glob("*.py"))
    if (n := len(p.read_text().splitlines())) > 400
  ]
  assert long_files == []
