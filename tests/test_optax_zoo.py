"""Every optax and optax.contrib optimizer under mpx, bitwise against float32 optax.

The checks themselves are in ``tests/optax_zoo.py`` (see its docstring); they
run in two subprocesses of ``tests/tools/optax_zoo_cli.py`` with FMA
contraction off, one per core, and each optimizer is reported as its own test
here (``-m slow``: about 80 s on two cores), once with the CPU program's skip
and once with the GPU program's. The completeness test, quick, fails when
optax gains an optimizer the table does not list.
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


@pytest.fixture(scope="module", params=["CPU form", "GPU form"])
def zoo_results(request) -> dict:
  names = sorted(optax_zoo.CASES)
  env = {
    **{k: v for k, v in os.environ.items() if k != "MPX_TEST_FORM"},
    "JAX_PLATFORMS": "cpu",
    # No FMA instructions, hence no multiply-add contraction (checked below).
    "XLA_FLAGS": "--xla_cpu_max_isa=AVX",
    # The GPU program's skip (a select) and finite check, run on the CPU; empty
    # (unset): the CPU program's, as one CPU device lowers it.
    "MPX_TEST_FORM": "gpu" if request.param == "GPU form" else "",
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


@pytest.mark.slow
def test_fma_contraction_is_off_in_the_workers(zoo_results):
  assert zoo_results["contraction_off"] == [True] * PROCESSES


@pytest.mark.slow  # about 80 s on 2 cores: 4 compilations per optimizer
@pytest.mark.parametrize("name", sorted(optax_zoo.CASES))
def test_optimizer_conforms(zoo_results, name):
  assert name in zoo_results, f"{name}: the worker printed no result"
  failures = zoo_results[name]["failures"]
  assert not failures, f"{name}:\n  " + "\n  ".join(failures)
