"""Test configuration: 8 host CPU devices for the multi-device tests.

XLA reads the flag once, when jax initialises its backend, so it is set here,
before any test module imports jax.
"""

import os
from importlib import metadata

# jax-cuda12-plugin, where installed (CI installs it to compile for an H100 in
# tests/test_gpu_compile.py), would check for CUDA libraries when jax starts,
# fail on a machine without them and leave no CUDA compiler to use.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# jax's persistent compilation cache, in the checkout: a program that several
# tests (or both workers, or the slow tier after the quick one) build alike is
# compiled once. Keyed by the program, jax version and flags, so it never
# serves another jax's program; every compile is cached, however quick. From
# jax 0.10 only: at jax 0.5.3 (the floors) an executable read back from it
# trains test_multidevice.py's ZeRO-1 step to other values than compiled anew.
if tuple(int(part) for part in metadata.version("jax").split(".")[:2]) >= (0, 10):
  os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"),
  )
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import pytest
from lowering_forms import apply_environment, forced

# A whole run may take one form: MPX_TEST_FORM=gpu pytest (CONTRIBUTING.md).
apply_environment()

# The forms of the finite check and the skip, by the values of the tests' switch
# MPX_TEST_FORM (tests/lowering_forms.py; CONTRIBUTING.md).
FORMS = {"one CPU device": "one-cpu", "several devices": "several-devices", "GPU form": "gpu"}


# "several devices" differs from "one CPU device" only in the finite check's
# form (both skip by a lax.cond) and the compressed moments' write order: the
# quick tier runs the two forms that differ most, the slow tier adds it.
@pytest.fixture(
  params=[pytest.param(f, marks=pytest.mark.slow) if f == "several devices" else f for f in FORMS]
)
def finite_check_form(request):
  """Runs a test under each form of the finite check and the skip.

  The test process simulates 8 devices, where every leaf is reduced whole; on
  one CPU device (the demo, the benchmarks, most users' laptops) leaves are
  summed or folded instead (``verdict._single_cpu``). Both skip inside a
  ``lax.cond``. A program lowered for a GPU checks every leaf whole and skips
  by a select instead (``verdict.run_if_finite``): "GPU form" runs that program on
  the CPU. The skip guarantees must hold in all three. The fixture sets the
  documented switch (tests/lowering_forms.py) and nothing else.
  """
  with forced(FORMS[request.param]):
    yield request.param


@pytest.fixture(scope="session")
def computed_once(tmp_path_factory):
  """Returns ``computed_once(key, compute)``: ``compute()``'s result (JSON), computed
  by the first xdist worker that asks and read back by the others, which wait
  for it (idle) instead of computing it again beside it. For a result whose
  tests xdist may hand to both workers, each of which would set up its own
  module fixture."""
  import fcntl
  import json

  if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing to share
    return lambda key, compute: compute()
  # Under xdist each worker's basetemp is a folder of this run's own.
  shared = tmp_path_factory.getbasetemp().parent

  def once(key: str, compute):
    path = shared / f"computed_once-{key}.json"
    with open(f"{path}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
      if not path.exists():
        path.write_text(json.dumps(compute()))
      return json.loads(path.read_text())

  return once


def pytest_collection_modifyitems(config, items):
  """A param of a ``floors`` test that is itself marked slow was slow before its
  test left the quick tier: it stays off the dependency floors (``.ci/run``),
  where the test's other params run."""
  del config
  for item in items:
    spec = getattr(item, "callspec", None)
    if spec is not None and any(mark.name == "slow" for mark in spec.marks):
      item.own_markers = [mark for mark in item.own_markers if mark.name != "floors"]


@pytest.fixture
def without_persistent_cache():
  """Turns jax's persistent compilation cache off around a test that counts
  XLA compilations: an executable read back from it is no compilation, and
  its outputs' shardings may be spelled otherwise, so that a later call
  lowers again (jax reads whether the cache is on once, hence the resets)."""
  import jax
  from jax._src import compilation_cache

  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", enabled)
  compilation_cache.reset_cache()
