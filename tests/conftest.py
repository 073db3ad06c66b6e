"""Test configuration: 8 host CPU devices for the multi-device tests.

XLA reads the flag once, when jax initialises its backend, so it is set here,
before any test module imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
