"""Runs the focused example scripts in examples/ as a user would, at their smoke size.

Each script trains a small model with mpx, prints its progress and ends with
self-checks of its own (the loss fell, masters are bitwise what they should
be, ...), exiting with status 1 if one fails. These tests run each one in a
subprocess with ``MPX_SMOKE=1`` and check the exit status, the final verdict
and a few lines that show the feature the script is about.
"""

from __future__ import annotations

import re
import subprocess

import cli_output
import pytest

# Minutes in all: behind the marker; CI runs them with `pytest -m slow`.
pytestmark = pytest.mark.slow


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
  return cli_output.run_example(name, *args, timeout=300)


def assert_all_checks_passed(result: subprocess.CompletedProcess[str]) -> list[str]:
  """Exit status 0, every check ``ok``; returns the names of the checks."""
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  assert "OK: all checks passed" in result.stdout, output
  assert "FAIL" not in result.stdout, output
  checks = [line[4:].strip() for line in result.stdout.splitlines() if line.startswith("ok  ")]
  assert checks, output
  return checks


def test_flax_linen_fp16():
  result = run_script("flax_linen_fp16.py")
  checks = assert_all_checks_passed(result)
  assert len(checks) == 6, result.stdout
  out = result.stdout
  assert "float16 linen MLP (width 32)" in out  # the smoke size
  assert re.search(r"^\s+\d+\s+nan\s+\d+\s+1\s+corrupt batch", out, re.M), out
  assert re.search(r"^TrainState\.step 200; mpx skipped [1-9]", out, re.M), out


def test_flax_nnx_bf16():
  result = run_script("flax_nnx_bf16.py")
  checks = assert_all_checks_passed(result)
  assert len(checks) == 6, result.stdout
  assert "bfloat16 nnx MLP (width 32)" in result.stdout
  assert re.search(r"float32 masters\)$", result.stdout, re.M), result.stdout
  assert "rounded away with plain bfloat16 weights" in result.stdout


def test_equinox_bf16():
  result = run_script("equinox_bf16.py")
  checks = assert_all_checks_passed(result)
  assert len(checks) == 5, result.stdout
  assert "bfloat16 equinox MLP (width 32)" in result.stdout
  assert "but the state holds a master for a" in result.stdout  # the widened model


def test_finetune_from_fp32_checkpoint_float16_into_dir(tmp_path):
  # --dtype float16 takes the loss-scale branch as well; --dir keeps the checkpoints.
  ckpt = tmp_path / "ckpt"
  result = run_script("finetune_from_fp32_checkpoint.py", "--dtype", "float16", "--dir", str(ckpt))
  checks = assert_all_checks_passed(result)
  assert "initial masters equal the checkpoint bitwise" in checks
  assert "exported checkpoint equals the masters bitwise" in checks
  assert "few float16 steps skipped (<= 10%)" in checks
  assert "4. fine-tune in float16" in result.stdout
  assert (ckpt / "pretrained_fp32").is_dir() and (ckpt / "finetuned_fp32").is_dir()


def test_change_learning_rate():
  result = run_script("change_learning_rate.py")
  checks = assert_all_checks_passed(result)
  assert "train_step traced (and compiled) once for the whole run" in checks
  out = result.stdout
  assert re.search(r"mpx\.adjust -> learning rate 0\.001 \(float32\)", out), out
  assert re.search(r"optax\.tree\.set -> learning rate 0\.0001 \(float32\)", out), out
  assert "train_step traced 1x" in out
  # The pitfall it shows: a Python float through optax.tree.set recompiles.
  assert "train_step traced 1 more time(s)" in out


def test_amp_recipes():
  result = run_script("amp_recipes.py")
  checks = assert_all_checks_passed(result)
  recipes = ("clipping", "penalty", "losses", "groups", "accumulation")
  for recipe in recipes:
    assert f"\n== {recipe}: " in result.stdout, result.stdout
  assert {check.split(":")[0] for check in checks} == set(recipes)
  assert len(checks) == 16, result.stdout
  assert "inf in model1's gradients: both models unchanged: True" in result.stdout
