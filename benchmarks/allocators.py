"""Times the storage modes in fresh processes under each glibc malloc setting, for run.py."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks import optimizer_step as opt_bench
from benchmarks import rows
from benchmarks.cli import log
from benchmarks.targets import TARGET_MIN_PARAMS

RUN = pathlib.Path(__file__).resolve().with_name("run.py")
# glibc malloc told not to map and unmap large blocks: XLA:CPU
# allocates some steps' scratch afresh on every call, and with glibc's
# defaults a block that large is mmap-ed and unmapped each time, so every step
# pays page faults on it. The first three variables keep such blocks in the
# heap; they are not enough alone: XLA runs steps on threads of its own, whose
# malloc arenas are heaps of at most 64 MiB that map any larger block whatever
# the threshold (measured: remainder masters at 16M params, a 64 MiB scratch,
# still faulted in 4 bytes per parameter per step), so MALLOC_ARENA_MAX=1 puts
# every thread on the main heap. Read once, when the process starts.
NO_MMAP_MALLOC = {
  "MALLOC_MMAP_THRESHOLD_": "4294967296",
  "MALLOC_TRIM_THRESHOLD_": "68719476736",
  "MALLOC_TOP_PAD_": "1073741824",
  "MALLOC_ARENA_MAX": "1",
}
# The two settings the storage modes are timed under, each in a process of its
# own: (name, the environment variables set; those of NO_MMAP_MALLOC not named
# are removed).
ALLOCATORS = (("glibc defaults", {}), ("glibc, large blocks kept, one arena", NO_MMAP_MALLOC))
# What those processes time: the storage modes, next to the full-master step.
ALLOCATOR_VARIANTS = (
  opt_bench.BASELINE,
  opt_bench.MPX_BF16,
  opt_bench.MPX_REMAINDER,
  opt_bench.MPX_STOCHASTIC,
)


def allocator_sizes(args: argparse.Namespace) -> list[int]:
  """Returns the sizes the allocator runs time: the target sizes (the first with --smoke)."""
  if args.smoke:
    return args.sizes[:1]
  return [n for n in args.sizes if n >= TARGET_MIN_PARAMS]


def allocator_env(settings: dict[str, str]) -> dict[str, str]:
  """Returns this process's environment with ``settings`` for glibc malloc: each of
  :data:`NO_MMAP_MALLOC`'s variables set as ``settings`` says, or removed."""
  env = {k: v for k, v in os.environ.items() if k not in NO_MMAP_MALLOC}
  env.update(settings)
  return env


def allocator_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
  """Times the storage modes under each of :data:`ALLOCATORS`, each in a process
  of its own (glibc reads its settings when the process starts).

  Returns:
    One entry per setting: its name, the variables it sets, LD_PRELOAD if
    set (a preloaded allocator replaces glibc's), and the child's optimizer
    sizes, or ``error`` with the end of its output if it failed.
  """
  sizes = allocator_sizes(args)
  if not sizes:
    return []
  out = []
  for name, settings in ALLOCATORS:
    log(f"storage modes in a new process, malloc: {name}")
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "results.json"
      command = [
        sys.executable,
        str(RUN),
        "--allocator-child",
        "--sizes",
        ",".join(str(n) for n in sizes),
        "--json",
        str(path),
        "--layers",
        str(args.layers),
        "--steps",
        str(args.steps),
        "--window",
        str(args.window),
      ]
      if args.rounds:
        command += ["--rounds", str(args.rounds)]
      if args.smoke:
        command.append("--smoke")
      proc = subprocess.run(
        command, env=allocator_env(settings), capture_output=True, text=True, check=False
      )
      entry: dict[str, Any] = {
        "name": name,
        "env": dict(settings),
        "ld_preload": os.environ.get("LD_PRELOAD"),
      }
      if proc.returncode == 0 and path.exists():
        child = rows.load(path)
        entry["sizes"] = child["optimizer"]["sizes"]
        entry["runtime_s"] = child["runtime_s"]
        entry["malloc"] = child["machine"].get("malloc")
      else:
        entry["error"] = f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        log(f"  failed: {entry['error'][-300:]}")
    out.append(entry)
  return out
