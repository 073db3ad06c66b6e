"""Runs the focused example scripts in examples/ as a user would, at their default size.

Each script trains a small model with mpx, prints its progress and ends with
self-checks of its own (the loss fell, masters are bitwise what they should
be, ...), exiting with status 1 if one fails. These tests run each one in a
subprocess, without ``MPX_SMOKE``, at the size a user gets, and check the
exit status, the final verdict and a few lines that show the feature the
script is about. Some checks only bite at that size: there, a master can
land exactly halfway between two bfloat16 numbers, where mpx's rounding (ties
away from zero) and ``astype``'s (ties to even) part; whether one does
depends on the machine's floating-point details. One run also takes the smoke
size, with flags.

The scripts' bitwise checks compute the params mpx documents independently,
in numpy; ``test_the_examples_round_as_mpx_documents`` checks those
references on exact ties and against mpx itself.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import types

import cli_output
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx

# Minutes in all: behind the marker; CI runs them with `pytest -m slow`.
pytestmark = pytest.mark.slow


def run_script(name: str, *args: str, smoke: bool = False) -> subprocess.CompletedProcess[str]:
  return cli_output.run_example(name, *args, smoke=smoke, timeout=600)


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
  assert "params are exactly the rounded masters" in checks
  out = result.stdout
  assert "float16 linen MLP (width 128)" in out  # the default size
  assert re.search(r"^\s+\d+\s+nan\s+\d+\s+1\s+corrupt batch", out, re.M), out
  assert re.search(r"^TrainState\.step 800; mpx skipped [1-9]", out, re.M), out


def test_flax_nnx_bf16():
  result = run_script("flax_nnx_bf16.py")
  checks = assert_all_checks_passed(result)
  assert len(checks) == 6, result.stdout
  assert "params are exactly the rounded masters" in checks
  assert "bfloat16 nnx MLP (width 128)" in result.stdout
  assert "AdamW's moments are stored as moments='8bit', read back in float32" in checks
  # 12 B/param with full masters and moments; here the hidden kernel's moments
  # take about 1 B each, the small leaves' 4 (16x128 and 128x4 are < 4,096).
  state = re.search(r'moments="8bit": ([\d.]+) bytes of optimizer state', result.stdout)
  assert state and float(state.group(1)) < 6, result.stdout
  assert re.search(r"float32 masters\)$", result.stdout, re.M), result.stdout
  assert "rounded away with plain bfloat16 weights" in result.stdout


def test_equinox_bf16():
  result = run_script("equinox_bf16.py")
  checks = assert_all_checks_passed(result)
  assert len(checks) == 5, result.stdout
  assert "the weights are their float32 masters, rounded (ties away from zero)" in checks
  assert "bfloat16 equinox MLP (width 128), 800 steps" in result.stdout
  assert "but the state holds a master for a" in result.stdout  # the widened model


def test_finetune_from_fp32_checkpoint():
  result = run_script("finetune_from_fp32_checkpoint.py")
  checks = assert_all_checks_passed(result)
  assert len(checks) == 6, result.stdout
  assert "initial masters equal the checkpoint bitwise" in checks
  assert "params are exactly the rounded masters" in checks
  assert "exported checkpoint equals the masters bitwise" in checks
  assert "1. pretrain in FP32 (600 steps, width 128)" in result.stdout
  assert "4. fine-tune in bfloat16 (600 steps)" in result.stdout


def test_finetune_from_fp32_checkpoint_float16_into_dir_at_smoke_size(tmp_path):
  # --dtype float16 takes the loss-scale branch as well; --dir keeps the
  # checkpoints; MPX_SMOKE=1 picks the tiny preset the docs offer.
  ckpt = tmp_path / "ckpt"
  result = run_script(
    "finetune_from_fp32_checkpoint.py", "--dtype", "float16", "--dir", str(ckpt), smoke=True
  )
  checks = assert_all_checks_passed(result)
  assert "initial masters equal the checkpoint bitwise" in checks
  assert "exported checkpoint equals the masters bitwise" in checks
  assert "few float16 steps skipped (<= 10%)" in checks
  assert "1. pretrain in FP32 (150 steps, width 32)" in result.stdout
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


# --- The scripts' rounding references, on exact ties ------------------------------


def load_example(name: str) -> types.ModuleType:
  """``examples/<name>.py`` as a module (its ``main`` guarded, so nothing runs)."""
  spec = importlib.util.spec_from_file_location(
    f"example_{name}", cli_output.EXAMPLES / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # for its dataclasses' annotations
  spec.loader.exec_module(module)
  return module


# Float32 masters and the bfloat16 params mpx documents for them, as bits:
# nearest, ties away from zero (docs/concepts_masters.md). The first and
# third are ties that round-to-nearest-even would round down; the last two
# saturate at the bfloat16 maximum instead of overflowing.
BF16_CASES = [
  (0x3F808000, 0x3F81),  # 1 + 2**-8, a tie: away from zero (even would give 0x3f80)
  (0x3F818000, 0x3F82),  # 1 + 3 * 2**-8, a tie: away from zero (as even)
  (0xBF808000, 0xBF81),  # -(1 + 2**-8), a tie: away from zero
  (0x3F807FFF, 0x3F80),  # just below the tie: down
  (0x3F808001, 0x3F81),  # just above: up
  (0x80000000, 0x8000),  # -0.0 keeps its sign
  (0x7F7FFFFF, 0x7F7F),  # float32 max: saturates
  (0x7F800000, 0x7F7F),  # inf: saturates
]


def bf16_references() -> dict[str, object]:
  """Each bfloat16 script's reference, as ``masters tree -> params tree``."""
  finetune = load_example("finetune_from_fp32_checkpoint")
  equinox = load_example("equinox_bf16")  # rounds one array
  return {
    "finetune_from_fp32_checkpoint": lambda t: finetune.rounded_as_mpx_documents(t, jnp.bfloat16),
    "flax_nnx_bf16": load_example("flax_nnx_bf16").rounded_ties_away,
    "equinox_bf16": lambda t: {"w": equinox.rounded_ties_away(t["w"])},
  }


def test_the_examples_round_as_mpx_documents():
  masters = np.array([m for m, _ in BF16_CASES], np.uint32).view(np.float32)
  expected = np.array([p for _, p in BF16_CASES], np.uint16)
  # mpx itself, on the finite masters (inf is not a weight one starts from).
  finite = np.isfinite(masters)
  tx = mpx.mixed_precision(optax.sgd(0.1))
  params, _ = mpx.init_from_full_precision(tx, {"w": jnp.asarray(masters[finite])}, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(params["w"]).view(np.uint16), expected[finite])
  for name, reference in bf16_references().items():
    got = np.asarray(reference({"w": masters})["w"])
    assert got.dtype == jnp.bfloat16, name
    np.testing.assert_array_equal(got.view(np.uint16), expected, err_msg=name)

  # float16: nearest, ties to even, saturating at 65504 where astype gives inf.
  masters16 = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65519.0, 65520.0, -7e4], np.float32)
  expected16 = np.array([1.0, 1 + 2**-9, 65504.0, 65504.0, -65504.0], np.float16)
  linen = load_example("flax_linen_fp16").rounded_to_nearest_even
  finetune = load_example("finetune_from_fp32_checkpoint").rounded_as_mpx_documents
  for got in (linen({"w": masters16})["w"], finetune({"w": masters16}, jnp.float16)["w"]):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), expected16.view(np.uint16))
  params, _ = mpx.init_from_full_precision(tx, {"w": jnp.asarray(masters16)}, jnp.float16)
  np.testing.assert_array_equal(np.asarray(params["w"]).view(np.uint16), expected16.view(np.uint16))
