"""Runs the quickstart as a user would, in a subprocess, at its default size.

The default size is what a user gets and the only one that checks itself
against FP32; it takes 80 s to 2 minutes on 2 CPU cores, depending on their load.
"""

from __future__ import annotations

import subprocess

import cli_output
import pytest

# Minutes in all: behind the marker; CI runs them with `pytest -m slow`.
pytestmark = pytest.mark.slow

MODES = ("fp32", "bf16+mpx", "fp16+mpx+scale", "bf16 no masters")


def run_quickstart(*args: str, smoke: bool) -> subprocess.CompletedProcess[str]:
  return cli_output.run_example("quickstart.py", *args, smoke=smoke, timeout=600)


def table_rows(stdout: str) -> dict[str, list[str]]:
  return cli_output.table_rows(stdout, MODES)


def test_quickstart_at_its_default_size_passes_its_checks():
  result = run_quickstart(smoke=False)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  assert "1500 steps x 256 windows, width 256" in result.stdout, output
  assert "train loss" in result.stdout and "state B/param" in result.stdout
  rows = table_rows(result.stdout)
  assert set(rows) == set(MODES), result.stdout
  assert rows["fp32"][0] == "float32"
  assert rows["bf16+mpx"][0] == "bfloat16"
  assert rows["fp16+mpx+scale"][0] == "float16"
  # Optimizer-state bytes per parameter: Adam's two moments, plus a float32
  # master with mpx; only the loss-scaled mode has a skip count and a scale.
  assert float(rows["fp32"][5]) == pytest.approx(8.0, abs=0.1)
  assert float(rows["bf16+mpx"][5]) == pytest.approx(12.0, abs=0.1)
  assert float(rows["bf16 no masters"][5]) == pytest.approx(4.0, abs=0.1)
  assert rows["fp16+mpx+scale"][6].isdigit() and float(rows["fp16+mpx+scale"][7]) > 0
  assert rows["fp32"][6] == rows["fp32"][7] == "-"
  # The self-check: each checked mode's row says ok, and the verdict line.
  assert rows["bf16+mpx"][-1] == rows["fp16+mpx+scale"][-1] == "ok", result.stdout
  assert "OK: each mixed mode's validation loss is within 1.0% of FP32's" in result.stdout
  assert "FAIL" not in result.stdout, output


@pytest.mark.slow
def test_quickstart_fails_when_tolerance_is_missed():
  # No gap can be at most -100%, so the self-check must fail and exit 1.
  result = run_quickstart(
    "--steps", "2", "--batch", "8", "--width", "8", "--tolerance", "-1", smoke=False
  )
  assert result.returncode == 1, result.stdout + result.stderr
  assert "FAIL: validation loss of bf16+mpx, fp16+mpx+scale" in result.stdout
