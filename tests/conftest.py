"""Test configuration: 8 host CPU devices for the multi-device tests.

XLA reads the flag once, when jax initialises its backend, so it is set here,
before any test module imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


import pytest


@pytest.fixture(params=["one CPU device", "several devices"])
def finite_check_form(request, monkeypatch):
  """Runs a test under both forms of ``mpx.all_finite``.

  The test process simulates 8 devices, where every leaf is reduced whole; on
  one CPU device (the demo, the benchmarks, most users' laptops) leaves are
  summed or folded instead (see mpx/_src/finite.py). The skip guarantees must
  hold in both.
  """
  from mpx._src import finite

  monkeypatch.setattr(finite, "_single_cpu_device", lambda: request.param == "one CPU device")
  return request.param
