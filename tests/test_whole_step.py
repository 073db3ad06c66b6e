"""The whole training step compiled for an H100 (benchmarks/whole_step.py), at a small size.

What accumulation must be on a GPU: a micro-step with no conditional that
holds and moves about what adding a gradient needs, and a step ending the
window that holds far less than mpx inside `optax.MultiSteps`.
"""

from __future__ import annotations

import pathlib
import sys

import optax
import pytest

import mpx

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from test_gpu_compile import require_cuda_compiler  # noqa: E402

from benchmarks import whole_step  # noqa: E402

MODEL = whole_step.Model(blocks=2, width=256, batch=16)


def mpx_24bit_4bit() -> optax.GradientTransformation:
  return mpx.mixed_precision(optax.adamw(1e-3), masters="24bit", moments="4bit")


@pytest.fixture(scope="module")
def rows() -> dict[str, whole_step.Row]:
  require_cuda_compiler()
  k = whole_step.K
  steps = {
    "adamw": (optax.adamw(1e-3), False),
    "multisteps": (optax.MultiSteps(mpx_24bit_4bit(), k), False),
    "applying": (mpx.accumulate(mpx_24bit_4bit(), k, accumulator="bfloat16"), False),
    "micro": (mpx.accumulate(mpx_24bit_4bit(), k, accumulator="bfloat16"), True),
  }
  topo = whole_step.topology()
  return {
    name: whole_step.measure(name, MODEL, tx, micro, topo) for name, (tx, micro) in steps.items()
  }


def test_no_step_has_a_conditional(rows):
  assert {name: row.conditionals for name, row in rows.items()} == dict.fromkeys(rows, 0)


def test_the_micro_step_keeps_params_state_and_a_2_byte_accumulator(rows):
  # params 2 + 24-bit corrections 1 + 4-bit moments 1.06 + accumulator 2
  assert rows["micro"].kept == pytest.approx(6.06, abs=0.01)


def test_the_micro_step_moves_what_adding_a_gradient_needs(rows):
  """Beside the forward and backward passes (plain AdamW's step less its
  update), at most the gradient's read, the accumulator's read and write
  (6 bytes a param) and one more."""
  adamw_update = 2 + 2 + 2 * 2 + 2 * 2 + 2  # grad, param, moments in and out, param out
  passes = rows["adamw"].moved - adamw_update
  assert rows["micro"].moved <= passes + 6 + 1


def test_both_programs_hold_no_more_beside_params_state_and_accumulator_than_adamw(rows):
  """Each leaf's gradient is averaged in as it arrives: no kernel waits for
  several (docs/benchmarks_whole_step.md: 6.34 in all on the 67M stack)."""
  for name in ("applying", "micro"):
    assert rows[name].transient <= rows["adamw"].transient + 0.1, name
  assert rows["applying"].total <= 6.8 < rows["multisteps"].total - 2


def test_exact_masters_with_a_float32_accumulator_hold_no_copy_of_the_state(rows):
  """The step ending a window selects the state once, in the skip's select:
  remainder masters with a float32 accumulator keep params 2 + state 3.06 +
  accumulator 4, and hold no more beside them than adamw (9.33 in all on the
  67M stack)."""
  tx = mpx.accumulate(
    mpx.mixed_precision(optax.adamw(1e-3), masters="remainder", moments="4bit"), whole_step.K
  )
  row = whole_step.measure("applying", MODEL, tx)
  assert row.kept == pytest.approx(9.06, abs=0.01)
  assert row.transient <= rows["adamw"].transient + 0.1


def test_under_scan_stochastic_masters_hold_no_second_gradient():
  """Scanned over its layers, a model's backward pass starts the stacked
  gradient from zeros; stochastic masters' step holds nothing beside it that
  the other modes do not (2.56 B/param of transient on the 67M stack, as 24bit)."""
  require_cuda_compiler()
  scanned = whole_step.Model(blocks=4, width=256, batch=16, scanned=True)
  topo = whole_step.topology()
  transient = {
    masters: whole_step.measure(
      masters,
      scanned,
      mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments="4bit"),
      topo=topo,
    ).transient
    for masters in ("remainder", "24bit", "stochastic")
  }
  others = min(transient["remainder"], transient["24bit"])
  assert transient["stochastic"] <= others + 0.01, transient


# 16 leaves, as on the 67M stack: a step that holds one leaf's gradient more
# than adamw shows it as the 67M stack does (an eighth of a byte a param).
MANY_LEAVES = whole_step.Model(blocks=8, width=256, batch=16)


@pytest.fixture(scope="module")
def adamw_many_leaves() -> whole_step.Row:
  require_cuda_compiler()
  return whole_step.measure("adamw", MANY_LEAVES, optax.adamw(1e-3))


@pytest.mark.parametrize(
  "masters, moments",
  [
    ("full", "full"),
    ("remainder", "bfloat16"),
    ("24bit", "bfloat16"),
    ("stochastic", "bfloat16"),
    ("24bit", "4bit"),
    ("stochastic", "4bit"),
    ("full", "4bit"),
    ("full", {"mu": "8bit", "nu": "4bit"}),
    ("remainder", "8bit"),
  ],
)
def test_skip_by_leaf_holds_what_adamw_holds(adamw_many_leaves, masters, moments):
  """With `skip="leaf"` each leaf is updated as its gradient arrives: beside
  params and state the step holds what optax's adamw holds and at most one
  leaf's gradient more (its verdict is read before the leaf is written;
  docs/benchmarks_whole_step.md), where the default step holds the whole
  gradient (2 B/param more). With 8- and 4-bit moments the accelerator codes
  them in two passes leaf by leaf (``two_pass.maxima_by_leaf``) and keeps
  a skipped leaf's as the default step does (``two_pass.kept``): selected
  as bytes, float32 masters with 4-bit moments held 1.19 B/param here."""

  def step(skip):
    tx = mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments=moments, skip=skip)
    return whole_step.measure(skip, MANY_LEAVES, tx)

  largest_leaf = 2 * max(s[0] * s[1] for s in MANY_LEAVES.shapes().values()) / MANY_LEAVES.params
  assert step("leaf").transient <= adamw_many_leaves.transient + largest_leaf + 0.01
  assert step("step").transient >= adamw_many_leaves.transient + 1.5


@pytest.mark.parametrize(
  "masters, moments",
  [
    ("24bit", "bfloat16"),
    ("24bit", "4bit"),
    ("remainder", "8bit"),
    ("stochastic", {"mu": "8bit", "nu": "4bit"}),
  ],
)
def test_two_pass_clipping_holds_what_adamw_holds(adamw_many_leaves, masters, moments):
  """With the norm from a first backward pass (``mpx.clipped_grad``) and
  ``skip="leaf"``, the step holds what adamw holds and at most one leaf's
  gradient more, for a second backward pass's bytes (docs/howto.md, "Clip
  by the global norm"). With 8- and 4-bit moments the first of the two
  coding passes reads each clipped gradient as it is, not behind a barrier
  (``two_pass.maxima_by_leaf``): behind one, 24-bit masters with 4-bit
  moments held 2.25 B/param here, and the other modes 0.47."""
  two_pass = mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments=moments, skip="leaf")
  unclipped = whole_step.measure("unclipped", MANY_LEAVES, two_pass)
  clipped = whole_step.measure("clipped", MANY_LEAVES, two_pass, clip=1.0)
  largest_leaf = 2 * max(s[0] * s[1] for s in MANY_LEAVES.shapes().values()) / MANY_LEAVES.params
  assert clipped.transient <= adamw_many_leaves.transient + largest_leaf + 0.01
  # The second pass: its forward and backward kernels' bytes again, no more.
  assert unclipped.moved < clipped.moved < 2 * unclipped.moved
  assert clipped.conditionals == 0


def test_clipping_in_one_pass_holds_the_gradient(adamw_many_leaves):
  """Clipped by the global norm in one pass (optax's), the step holds the whole
  gradient, as two-pass clipping does not."""
  clip_first = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  one_pass = mpx.mixed_precision(clip_first, masters="24bit", moments="bfloat16")
  assert whole_step.measure("one pass", MANY_LEAVES, one_pass).transient >= (
    adamw_many_leaves.transient + 1.5
  )


@pytest.mark.parametrize("masters", ["remainder", "24bit", "stochastic"])
def test_scan_layers_holds_a_layer_as_stored_beside_its_gradient(masters):
  """Under ``mpx.scan_layers`` each layer's new params and state are written out
  as stored (a layer's share of what the step keeps), beside that layer's
  bfloat16 gradient, not in the float32 they are computed in (1.03 B/param
  here with 24-bit masters before, 0.78 now)."""
  require_cuda_compiler()
  layers = whole_step.Model(blocks=8, width=256, batch=16, scanned=True)
  tx = mpx.mixed_precision(optax.adamw(1e-3), masters=masters, moments="4bit")
  row = whole_step.measure_scan_layers(masters, layers, tx, whole_step.topology())
  per_layer = 1 / layers.blocks
  assert row.transient <= (row.kept + 2) * per_layer + 0.1, row
