"""Runs the main demo (examples/demo.py) as a user would, in a subprocess."""

from __future__ import annotations

import pathlib
import subprocess

import cli_output
import pytest

MODES = ("fp32", "bf16+mpx", "fp16+mpx+scale", "bf16 no masters")
# Cells after the mode name: params dtype, train loss, val loss, vs fp32,
# tokens/s, state bytes per param, skipped steps, loss scale.
DTYPE, TRAIN, VAL, GAP, TOKENS, STATE, SKIPPED, SCALE = range(8)


def run_demo(*args: str, smoke: bool = False) -> subprocess.CompletedProcess[str]:
  return cli_output.run_example("demo.py", *args, smoke=smoke, timeout=900)


def table_rows(stdout: str) -> dict[str, list[str]]:
  return cli_output.table_rows(stdout, MODES)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], pathlib.Path]:
  # MPX_SMOKE=1, as CI runs it; the plot goes to a folder that does not exist yet.
  png = tmp_path_factory.mktemp("demo") / "plots" / "demo.png"
  return run_demo("--out", str(png), smoke=True), png


def test_smoke_run_exits_zero_and_writes_png(smoke):
  result, png = smoke
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.startswith("1-layer transformer, width 32,"), result.stdout  # the smoke size
  assert png.is_file() and png.read_bytes().startswith(b"\x89PNG"), result.stdout
  # tqdm progress bars went to stderr, one per mode.
  for mode in MODES:
    assert mode in result.stderr
  # The smoke size is not checked against FP32.
  assert "OK:" not in result.stdout and "FAIL" not in result.stdout


def test_smoke_table_rows(smoke):
  result, _ = smoke
  rows = table_rows(result.stdout)
  assert set(rows) == set(MODES), result.stdout
  assert [len(cells) for cells in rows.values()] == [8] * 4, result.stdout
  assert rows["fp32"][DTYPE] == "float32"
  assert rows["bf16+mpx"][DTYPE] == "bfloat16"
  assert rows["fp16+mpx+scale"][DTYPE] == "float16"
  assert rows["bf16 no masters"][DTYPE] == "bfloat16"
  for cells in rows.values():
    assert float(cells[VAL]) > 0 and float(cells[TRAIN]) > 0
    assert float(cells[TOKENS].replace(",", "")) > 0
  assert rows["fp32"][GAP] == "+0.00%"


def test_smoke_optimizer_state_bytes_per_param(smoke):
  rows = table_rows(smoke[0].stdout)
  # Adam's two float32 moments; mpx adds a float32 master; plain optax on bf16
  # params keeps both moments in bf16. (Counters and the scale are negligible.)
  assert float(rows["fp32"][STATE]) == pytest.approx(8.0, abs=0.05)
  assert float(rows["bf16+mpx"][STATE]) == pytest.approx(12.0, abs=0.05)
  assert float(rows["fp16+mpx+scale"][STATE]) == pytest.approx(12.0, abs=0.05)
  assert float(rows["bf16 no masters"][STATE]) == pytest.approx(4.0, abs=0.05)


def test_smoke_only_fp16_mode_has_a_loss_scale(smoke):
  rows = table_rows(smoke[0].stdout)
  fp16 = rows["fp16+mpx+scale"]
  assert fp16[SKIPPED].isdigit()
  assert float(fp16[SCALE]) >= 1.0
  for mode in ("fp32", "bf16+mpx", "bf16 no masters"):
    assert rows[mode][SKIPPED] == rows[mode][SCALE] == "-", rows[mode]


@pytest.mark.slow
def test_check_fails_when_claims_do_not_hold(tmp_path):
  # No gap is at most -100%, so both mpx claims fail, and the self-check exits 1.
  result = run_demo(
    "--steps",
    "2",
    "--batch",
    "2",
    "--layers",
    "1",
    "--width",
    "8",
    "--heads",
    "1",
    "--context",
    "8",
    "--eval-windows",
    "4",
    "--tolerance",
    "-1",
    "--out",
    str(tmp_path / "demo.png"),
  )
  assert result.returncode == 1, result.stdout + result.stderr
  assert "FAIL: bf16+mpx" in result.stdout and "FAIL: fp16+mpx+scale" in result.stdout
