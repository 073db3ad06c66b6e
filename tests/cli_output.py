"""Running the example scripts as a user would, and reading what they print."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
BENCHMARKS = EXAMPLES.parent / "benchmarks"


def run_example(
  script: str, *args: str, smoke: bool = True, timeout: int = 600, xla_flags: str = ""
) -> subprocess.CompletedProcess[str]:
  """Runs ``examples/<script>`` as :func:`run_script` does, with ``MPX_SMOKE``
  unless not ``smoke``."""
  return run_script(EXAMPLES / script, *args, smoke=smoke, timeout=timeout, xla_flags=xla_flags)


def run_script(
  path: pathlib.Path, *args: str, smoke: bool = False, timeout: int = 600, xla_flags: str = ""
) -> subprocess.CompletedProcess[str]:
  """Runs the script at ``path`` (an example, or one of ``BENCHMARKS``) in a
  subprocess from the repository root.

  Without the test suite's 8 host devices (conftest.py) and, unless ``smoke``,
  without ``MPX_SMOKE``: the environment a user runs it in, with ``XLA_FLAGS``
  set to ``xla_flags`` where given.
  """
  env = {k: v for k, v in os.environ.items() if k not in ("MPX_SMOKE", "XLA_FLAGS")}
  if smoke:
    env["MPX_SMOKE"] = "1"
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  return subprocess.run(
    [sys.executable, str(path), *args],
    cwd=EXAMPLES.parent,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def markdown_rows(stdout: str) -> dict[str, list[str]]:
  """The rows of the first markdown table in ``stdout`` (its header too, not
  the ``|:--|`` rule), keyed by their first cell, each the other cells, stripped."""
  rows: dict[str, list[str]] = {}
  for line in stdout.splitlines():
    if line.startswith("| "):
      first, *others = (cell.strip() for cell in line.strip().strip("|").split("|"))
      rows[first] = others
    elif rows and not line.startswith("|"):
      break
  return rows


def table_rows(stdout: str, modes) -> dict[str, list[str]]:
  """The table's rows keyed by mode name, each split into its other cells."""
  rows = {}
  for line in stdout.splitlines():
    for mode in modes:
      if line.startswith(mode + " "):
        rows[mode] = line[len(mode) :].split()
  return rows
