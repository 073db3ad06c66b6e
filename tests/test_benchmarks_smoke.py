"""Runs ``benchmarks/run.py --smoke`` and checks the structure of what it measures.

Never timings: the machine is shared and the sizes are tiny. What must hold on
any machine: every mpx step is host-sync free and compiles once per run (finite
and skipped steps alike), and mpx's optimizer state is the inner Adam state
plus a 4-byte master per low-precision parameter, nothing more than a few
scalars.

The benchmark runs in a subprocess with XLA's backend optimisation turned
down, which only makes compilation quicker (this test compiles some twenty
steps); the HLO that the structure comes from is the same.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"
ALWAYS = (
  "optax adam fp32",
  "hand-written (no safety)",
  "hand + cond (flag given)",
  "hand + check",
  "hand + cond",
  "hand + select",
  "mpx bf16",
  "mpx fp16",
  "optax.apply_if_finite fp16",
)
PEERS = ("jmp fp16", "flax DynamicScale fp16", "mixed-precision-for-JAX fp16")
MPX = ("mpx bf16", "mpx fp16")
TRAIN_MODES = ("fp32 optax", "mpx bf16", "mpx fp16")
# LossScaleState's scalars: loss_scale f32, three int32 counters, one bool.
LOSS_SCALE_SCALARS = 4 + 3 * 4 + 1


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("benchmarks")
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
  proc = subprocess.run(
    [
      sys.executable,
      str(RUN),
      "--smoke",
      "--no-install-peers",
      "--out-dir",
      str(out),
      "--json",
      str(out / "results.json"),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads((out / "results.json").read_text()), proc.stdout, out


def test_writes_and_prints_the_report(smoke):
  results, stdout, out = smoke
  markdown = (out / "benchmarks.md").read_text()
  assert markdown.startswith("---\norphan: true\n---\n")  # Sphinx front matter
  assert markdown.split("---\n", 2)[2].strip() == stdout.strip()
  if importlib.util.find_spec("matplotlib") is not None:  # not in the test extra
    assert (out / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](benchmarks.png)" in markdown
  for text in ("# Benchmarks", "| CPU |", "| cores |", "jax", "## 1. Optimizer step"):
    assert text in markdown
  assert "## 2. Whole training step" in markdown
  assert results["machine"]["jax"] in markdown


def test_every_variant_is_measured_or_explained(smoke):
  results, _, _ = smoke
  (size,) = results["optimizer"]["sizes"]
  for name in ALWAYS:
    assert name in size["rows"], name
  for name in PEERS:
    assert name in size["rows"] or size["unavailable"][name], name
  for row in size["rows"].values():
    assert row["ms"] > 0 and row["x_base"] > 0
  assert set(results["train"]["rows"]) == set(TRAIN_MODES)


def test_no_host_syncs(smoke):
  results, _, _ = smoke
  (size,) = results["optimizer"]["sizes"]
  for name in (*ALWAYS, *MPX):
    assert size["rows"][name]["host_syncs"] == 0, name
  for mode, row in results["train"]["rows"].items():
    assert row["host_syncs"] == 0, mode


def test_one_compile_per_run(smoke):
  # Each run ends with one non-finite step for the variants that skip: it must
  # reuse the executable of the finite steps.
  results, _, _ = smoke
  (size,) = results["optimizer"]["sizes"]
  for name in MPX:
    row = size["rows"][name]
    assert (row["compiles"], row["traces"]) == (1, 1), name
  for mode, row in results["train"]["rows"].items():
    assert (row["compiles"], row["traces"]) == (1, 1), mode


def test_the_forced_skip_was_skipped(smoke):
  results, _, _ = smoke
  (size,) = results["optimizer"]["sizes"]
  assert size["rows"]["mpx fp16"]["skipped_steps"] == 1
  train = results["train"]["rows"]["mpx fp16"]
  assert train["skipped_total"] == train["skipped"] + 1


def test_mpx_state_is_adam_plus_a_master(smoke):
  results, _, _ = smoke
  (size,) = results["optimizer"]["sizes"]
  n = size["n"]
  for name in MPX:
    state = size["mpx_state"][name]
    assert state["low_precision_params"] == n
    assert state["masters"] == 4 * n, name
    assert state["inner"] == size["adam_state_bytes"], name
  assert size["mpx_state"]["mpx bf16"]["other"] == 0
  assert size["mpx_state"]["mpx fp16"]["other"] == LOSS_SCALE_SCALARS
  # The same seen per parameter, as the tables show it.
  fp32 = size["rows"]["optax adam fp32"]["state_bpp"]
  for name in MPX:
    assert size["rows"][name]["state_bpp"] == pytest.approx(fp32 + 4, abs=64 / n)


def test_training_state_bytes(smoke):
  results, _, _ = smoke
  rows = results["train"]["rows"]
  n = results["train"]["model"]["params"]
  for mode in ("mpx bf16", "mpx fp16"):
    assert rows[mode]["state_bpp"] == pytest.approx(rows["fp32 optax"]["state_bpp"] + 4, abs=64 / n)
    assert rows[mode]["peak_bytes"] > 0
