"""The step XLA would run on an H100, compiled here without one.

``benchmarks/gpu_compile.py`` compiles each mode's step for an H100
(deviceless ahead-of-time compilation; needs ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` at jax's version, which CI installs) and reads the
optimized HLO. These tests pin what a GPU program must be: no conditional (a
host sync per step on XLA:GPU), bytes moved at the mode's floor, no copies
and almost no scratch.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_compile  # noqa: E402


def require_cuda_compiler() -> None:
  """Skips where XLA's CUDA compiler is not installed; CI installs it, so
  there a missing one fails the test instead."""
  try:
    found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    found = False
  if found:
    return
  reason = (
    "compiling for an H100 needs jax-cuda12-plugin and jax-cuda12-pjrt at jax's version "
    "(pip install --no-deps)"
  )
  if os.environ.get("CI"):
    pytest.fail(f"{reason}: .ci/run installs them")
  pytest.skip(reason)


SCALE = 0.05  # the 26-leaf tree at 3.2M params: the kernels of the 67M one, smaller
EIGHT_BIT = {name for name in gpu_compile.FLOORS if "8bit" in name}
EIGHT_BIT_WHY = (
  "8-bit moments: XLA:GPU writes the new moments of leaves up to ~1M elements to float32 "
  "scratch and reads the gradients once more per block-max pass "
  "(docs/design.md, 'Why 8-bit moments miss the floor on the GPU')"
)


@pytest.fixture(scope="module")
def profiles() -> dict:
  require_cuda_compiler()
  shapes = gpu_compile.model_shapes(SCALE)
  n = gpu_compile.param_count(shapes)
  topology = gpu_compile.topology()
  out = {}
  for variant in gpu_compile.variants():
    compiled = gpu_compile.compile_step(variant.make(), shapes, variant.param_dtype, topology)
    out[variant.name] = (gpu_compile.profile(compiled), n)
  return out


NAMES = [v.name for v in gpu_compile.variants()]


@pytest.mark.parametrize("name", NAMES)
def test_no_conditional_in_a_gpu_program(profiles, name):
  profile, _ = profiles[name]
  assert profile.conditionals == 0


@pytest.mark.xla_cost
@pytest.mark.parametrize("name", NAMES)
def test_bytes_moved_within_2_per_param_of_the_floor(profiles, name, request):
  if name in EIGHT_BIT:
    request.applymarker(pytest.mark.xfail(strict=True, reason=EIGHT_BIT_WHY))
  profile, n = profiles[name]
  assert profile.bytes / n <= gpu_compile.FLOORS[name] + 2


@pytest.mark.xla_cost
@pytest.mark.parametrize("name", NAMES)
def test_no_copies_and_scratch_under_a_tenth_of_a_byte_per_param(profiles, name, request):
  if name in EIGHT_BIT:
    request.applymarker(pytest.mark.xfail(strict=True, reason=EIGHT_BIT_WHY))
  profile, n = profiles[name]
  assert profile.copied_bytes / n < 0.01  # a scalar counter may be copied
  assert profile.scratch / n <= 0.1


@pytest.fixture(scope="module")
def zero1() -> dict:
  require_cuda_compiler()
  shapes = gpu_compile.model_shapes(SCALE)
  topology = gpu_compile.topology(8)
  return {
    v.name: gpu_compile.zero1_profile(v, shapes, topology)
    for v in gpu_compile.variants()
    if v.name.startswith("mpx")
  }


MPX_NAMES = [name for name in NAMES if name.startswith("mpx")]


@pytest.mark.parametrize("name", MPX_NAMES)
def test_on_8_gpus_with_zero1_no_conditional_and_only_the_params_all_gather(zero1, name):
  profile, found = zero1[name].profile, zero1[name].collectives
  assert profile.conditionals == 0
  # The new params, gathered from the state's shards (XLA combines the
  # gathers into a few), and at most one reduction for the verdict. Nothing
  # else crosses devices.
  assert set(found) <= {"all-gather", "all-reduce"}, found
  assert found.get("all-reduce", 0) <= 1, found


@pytest.mark.xla_cost
@pytest.mark.parametrize("name", MPX_NAMES)
def test_on_8_gpus_with_zero1_scratch_at_most_the_state_per_device(zero1, name, request):
  if name in EIGHT_BIT:
    request.applymarker(pytest.mark.xfail(strict=True, reason=EIGHT_BIT_WHY))
  assert zero1[name].profile.scratch <= zero1[name].state_bytes
