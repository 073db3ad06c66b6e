"""Describes where a benchmark ran: the machine, the versions, the allocator."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

import jax


def cpu_model() -> str:
  """Names the CPU model."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def mpx_provenance() -> str:
  """Returns mpx's version and the commit of the checkout it was imported from."""
  import mpx

  text = mpx.__version__
  root = os.path.dirname(os.path.dirname(os.path.abspath(mpx.__file__)))
  try:
    commit = subprocess.run(
      ["git", "-C", root, "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      timeout=10,
      check=True,
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "-C", root, "status", "--porcelain", "--", "mpx"],
      capture_output=True,
      text=True,
      timeout=10,
      check=True,
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return text
  return f"{text} at commit {commit}" + (" with uncommitted changes in mpx/" if dirty else "")


def machine_info() -> dict[str, str]:
  """Describes where the benchmark runs, for the report's machine table."""
  import flax
  import optax

  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count() or 0
  try:
    with open("/proc/meminfo") as f:
      kib = int(f.readline().split()[1])
    memory = f"{kib / 2**20:.0f} GiB"
  except (OSError, ValueError, IndexError):
    memory = "?"
  device = jax.devices()[0]
  return {
    "mpx": mpx_provenance(),
    "cpu": cpu_model(),
    "cores": str(cores),
    "memory": memory,
    "device": f"{device.platform} ({device.device_kind})",
    "python": platform.python_version(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "flax": flax.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    "malloc": malloc_settings(),
  }


def malloc_settings() -> str:
  """Returns the allocator settings this process started with.

  glibc malloc's tunables and any preloaded library, from the environment.
  """
  names = sorted(k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
  if os.environ.get("LD_PRELOAD"):
    names.append("LD_PRELOAD")
  if not names:
    return "glibc defaults"
  return " ".join(f"{k}={os.environ[k]}" for k in names)
