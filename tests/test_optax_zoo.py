"""Every optax and optax.contrib optimizer under mpx, bitwise against float32 optax.

The checks themselves are in ``tests/optax_zoo.py`` (see its docstring); they
run in two subprocesses of ``tests/tools/optax_zoo_cli.py`` with FMA
contraction off, one per core, and each optimizer is reported as its own test
here (``-m slow``: about 80 s on two cores) with the CPU program's skip, and
the optimizers of ``GPU_FORM`` also with the GPU program's. The completeness
test, quick, fails when optax gains an optimizer the table does not list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optax_zoo
import pytest

WORKER = Path(__file__).parent / "tools" / "optax_zoo_cli.py"
PROCESSES = 2


def test_every_optimizer_in_optax_is_listed():
  discovered = optax_zoo.discover()
  listed = set(optax_zoo.CASES) | set(optax_zoo.EXCLUDED)
  assert not discovered - listed, (
    f"optax exports optimizers the conformance table does not list: {sorted(discovered - listed)}. "
    "Add a Case to tests/optax_zoo.py (or an EXCLUDED entry with the reason)."
  )
  assert not listed - discovered, f"listed but not exported by optax: {sorted(listed - discovered)}"
  assert len(optax_zoo.CASES) >= 60


# The GPU program's skip is a select over every leaf of the state, where the
# CPU's is a cond; they differ in no arithmetic. So the GPU form runs on the
# rules whose state holds more than float arrays shaped like the params and
# int32 counters (scalar floats, bools, PRNG keys, factored or history
# arrays; one rule of each family), whose update takes extra arguments, or
# which wrap params or gradients; and on adam. The CPU form runs every rule.
GPU_FORM = (
  "optax.adam",
  "optax.adafactor",
  "optax.contrib.dadapt_adamw",
  "optax.contrib.dog",
  "optax.contrib.dpsgd",
  "optax.contrib.galore",
  "optax.contrib.mechanize",
  "optax.contrib.momo_adam",
  "optax.contrib.prodigy",
  "optax.contrib.sam",
  "optax.contrib.schedule_free_adamw",
  "optax.contrib.sophia",
  "optax.lbfgs",
  "optax.lookahead",
  "optax.noisy_sgd",
  "optax.novograd",
  "optax.optimistic_adam",
  "optax.polyak_sgd",
  "optax.scale_by_zoom_linesearch",
  "optax.selective_transform",
  "optax.sm3",
)
NAMES = {"CPU form": sorted(optax_zoo.CASES), "GPU form": sorted(GPU_FORM)}


def run_zoo(form: str) -> dict:
  """Runs the workers on ``NAMES[form]``; returns their results by name."""
  names = NAMES[form]
  env = {
    **{k: v for k, v in os.environ.items() if k != "MPX_TEST_FORM"},
    "JAX_PLATFORMS": "cpu",
    # No FMA instructions, hence no multiply-add contraction (checked below).
    "XLA_FLAGS": "--xla_cpu_max_isa=AVX",
    # The GPU program's skip (a select) and finite check, run on the CPU; empty
    # (unset): the CPU program's, as one CPU device lowers it.
    "MPX_TEST_FORM": "gpu" if form == "GPU form" else "",
  }
  workers = [
    subprocess.Popen(
      [sys.executable, str(WORKER), *names[i::PROCESSES]],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(PROCESSES)
  ]
  results: dict = {"contraction_off": []}
  for worker in workers:
    stdout, stderr = worker.communicate(timeout=600)
    assert worker.returncode == 0, stderr[-3000:]
    for line in stdout.splitlines():
      tag, _, payload = line.partition(" ")
      if tag == "CONTRACTION_OFF":
        results["contraction_off"].append(json.loads(payload))
      elif tag == "RESULT":
        result = json.loads(payload)
        results[result["name"]] = result
  return results


# A fixture a form, each run once in the whole session: xdist hands a form's
# tests to both workers, and each would run the zoo again beside the other.
@pytest.fixture(scope="module")
def cpu_form(computed_once) -> dict:
  return computed_once("optax-zoo-cpu-form", lambda: run_zoo("CPU form"))


@pytest.fixture(scope="module")
def gpu_form(computed_once) -> dict:
  return computed_once("optax-zoo-gpu-form", lambda: run_zoo("GPU form"))


def test_the_gpu_form_runs_listed_rules():
  assert set(GPU_FORM) <= set(optax_zoo.CASES)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["cpu_form", "gpu_form"])
def test_fma_contraction_is_off_in_the_workers(form, request):
  assert request.getfixturevalue(form)["contraction_off"] == [True] * PROCESSES


@pytest.mark.slow  # about 80 s on 2 cores: 4 compilations per optimizer
@pytest.mark.parametrize("name", NAMES["CPU form"])
def test_optimizer_conforms(cpu_form, name):
  check_conforms(cpu_form, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES["GPU form"])
def test_optimizer_conforms_in_the_gpu_form(gpu_form, name):
  check_conforms(gpu_form, name)


def check_conforms(zoo_results: dict, name: str) -> None:
  assert name in zoo_results, f"{name}: the worker printed no result"
  failures = zoo_results[name]["failures"]
  assert not failures, f"{name}:\n  " + "\n  ".join(failures)
