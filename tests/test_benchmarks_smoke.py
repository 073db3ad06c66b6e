"""Runs ``benchmarks/run.py --smoke`` and checks what it measured, row by row.

Never timings (the machine is shared, the sizes tiny): every step is host-sync
free and compiles once, each ratio was measured against the step it names, and
the state bytes per parameter are what each storage mode keeps.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import report, rows, run, targets, train_step  # noqa: E402
from benchmarks.allocators import ALLOCATOR_VARIANTS, NO_MMAP_MALLOC  # noqa: E402
from benchmarks.optimizer_step import (  # noqa: E402
  BASELINE,
  CHECK_THEN_APPLY,
  HAND_OF,
  MPX_BF16,
  MPX_REMAINDER,
  MPX_STOCHASTIC,
  VARIANTS,
)
from benchmarks.report_optimizer import PEER_MEMORY  # noqa: E402
from benchmarks.rows import StepRow  # noqa: E402
from benchmarks.targets import MPX_FP16, MPX_MODES, MPX_REFERENCES  # noqa: E402

# Minutes in all: behind the marker; CI runs them with `pytest -m slow`.
pytestmark = pytest.mark.slow

RUN = ROOT / "benchmarks" / "run.py"
ALWAYS = tuple(v.name for v in VARIANTS if v.kind != "peer")
PEERS = tuple(v.name for v in VARIANTS if v.kind == "peer")
OPTAX_PEER = next(name for name in PEERS if name.startswith("optax"))  # always installed
MPX = tuple(name for name, _ in MPX_REFERENCES)
PAIRED_WITH = {**dict(MPX_REFERENCES), **{name: MPX_BF16 for name in MPX_MODES}}
# AdamW on bf16 params: state bytes per parameter in each storage mode of the
# masters (a few scalars and keys aside), and the least bytes each step moves.
STATE_BPP = {MPX_BF16: 12, MPX_REMAINDER: 10, MPX_STOCHASTIC: 8}
MIN_BYTES = {MPX_BF16: 30, MPX_REMAINDER: 28, MPX_STOCHASTIC: 24}
# AdamW on 16-bit params elsewhere, (param, state) bytes per parameter.
PEER_BYTES = {
  "PyTorch AMP / apex O2": (2, 12),
  "TransformerEngine FusedAdam": (2, 10),
  "torchao AdamW": (2, 8),
  "Kahan summation (optimi)": (2, 10),
  "plain FP32 Adam": (4, 8),
}
# LossScaleState's scalars: loss_scale f32, three int32 counters, one bool.
LOSS_SCALE_SCALARS = 4 + 3 * 4 + 1


def run_smoke(script, *args):
  """Runs ``script --smoke args`` with XLA's backend optimisations off (compiling
  is most of a smoke run); returns its stdout, after checking it exited 0."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
  proc = subprocess.run(
    [sys.executable, str(script), "--smoke", *map(str, args)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("benchmarks")
  stdout = run_smoke(RUN, "--no-install-peers", "--out-dir", out, "--json", out / "results.json")
  return rows.load(out / "results.json"), stdout, out


def sizes(results):
  """Returns (the transformer-shaped size, the many-leaf tree): what --smoke runs."""
  shaped, many = results["optimizer"]["sizes"]
  assert not shaped["many_leaves"] and many["many_leaves"]
  return shaped, many


def target_rows(results, shaped_counts=True):
  """Returns the targets table's rows, the smoke size counted as a target size."""
  shaped, _ = sizes(results)
  shaped["targets"] = shaped_counts
  try:
    return targets.targets(results)
  finally:
    shaped["targets"] = False


def test_the_report_renders_again_from_the_json(smoke):
  results, stdout, out = smoke
  markdown = (out / "benchmarks.md").read_text()
  assert markdown == report.FRONT_MATTER + stdout.rstrip("\n") + "\n"
  png = (out / "benchmarks.png").exists() and "benchmarks.png"
  if png:  # matplotlib comes with the bench extra, not with test
    assert (out / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert report.render_markdown(results, png or None) + "\n" == stdout
  assert results["compile_time"]["trees"] and results["train"]["rows"]


def test_every_variant_is_measured_or_explained(smoke):
  results, _, _ = smoke
  shaped, many = sizes(results)
  for name in ALWAYS:
    assert isinstance(shaped["rows"][name], StepRow), name
    assert name in many["rows"], name
  assert OPTAX_PEER in shaped["rows"]
  for name in PEERS:
    assert name in shaped["rows"] or shaped["unavailable"][name], name
    # Left out of the many-leaf tree, and said so.
    assert name not in many["rows"] and name in many["skipped_peers"], name
  for size in (shaped, many):
    for row in size["rows"].values():
      assert row.ms > 0 and row.x_base > 0
      assert row.gbps > 0 and 0 < row.roof_pct == pytest.approx(100 / row.floor_x)
    assert size["rows"][BASELINE].x_base == pytest.approx(1)
  assert set(results["train"]["rows"]) == set(train_step.MODES)


def test_many_leaf_tree(smoke):
  results, _, _ = smoke
  _, many = sizes(results)
  assert many["leaves"] == results["settings"]["many_leaves"] > 1
  assert many["label"].startswith(f"{many['leaves']} leaves (")
  assert many["targets"]  # its speed and scratch targets are evaluated
  assert many["label"] in {r[0] for r in target_rows(results, False)}


def test_mpx_steps_are_paired_with_the_check_then_apply_step_of_their_dtype(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    assert size["references"] == PAIRED_WITH
    for name, cond in MPX_REFERENCES:
      row = size["rows"][name]
      assert row.reference == HAND_OF[row_dtype(results, name)] and row.x_hand > 0
      assert row.check_then_apply == cond and row.x_cond > 0
      assert row.paired_with == cond
      assert len(row.paired_rounds) == size["rounds"]
      assert all(x > 0 for x in row.paired_rounds)
      assert row.x_cond_paired > 0 and row.x_hand_paired is None
    # The check-then-apply steps carry the ratio to their dtype's hand step only.
    for dtype, cond in CHECK_THEN_APPLY.items():
      row = size["rows"][cond]
      assert row.reference == HAND_OF[dtype] and row.x_hand > 0
      assert row.check_then_apply is None and row.x_cond is None
      assert row.x_cond_paired is None and row.x_hand_paired is None
    assert size["rows"]["hand + select"].check_then_apply == CHECK_THEN_APPLY["float16"]
    assert size["rows"][BASELINE].reference is None
  shaped, many = sizes(results)
  for size in (shaped, many):
    measured = {r[1]: r[2] for r in target_rows(results) if r[0] == size["label"]}
    for name, cond in MPX_REFERENCES:
      target = f"{name} <= {targets.TARGET_VS_COND:.2f}x {cond} (check-then-apply), paired"
      assert measured[target] == f"{size['rows'][name].x_cond_paired:.3f}x"


def row_dtype(results, name):
  return {v["name"]: v["param_dtype"] for v in results["optimizer"]["variants"]}[name]


def test_storage_modes_are_paired_with_the_full_master_step(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    for name in MPX_MODES:
      row = size["rows"][name]
      assert row.paired_with == MPX_BF16 and row.full == MPX_BF16
      assert row.reference == HAND_OF["bfloat16"] and row.x_hand > 0  # through the baseline
      assert row.x_hand_paired is None and row.x_cond_paired is None and row.x_cond > 0
      assert len(row.paired_rounds) == size["rounds"]
      assert row.x_full_paired > 0 and row.x_full > 0
    assert size["rows"][MPX_BF16].x_full_paired is None
  # Their targets hold at 16M and 64M, not on the many-leaf tree.
  shaped, many = sizes(results)
  rows_ = target_rows(results)
  for name in MPX_MODES:
    target = f"{name} <= {targets.TARGET_VS_FULL:.2f}x {MPX_BF16} (full masters), paired"
    (row,) = [r for r in rows_ if r[1] == target]
    assert row[0] == shaped["label"]
    assert row[2] == f"{shaped['rows'][name].x_full_paired:.3f}x"
    assert row[3] == "met" or row[3].startswith("**missed** by ")
  assert many["label"] not in {r[0] for r in rows_ if "(full masters)" in r[1]}


def test_xla_bytes_accessed_and_scratch_per_param(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    for name, row in size["rows"].items():
      # XLA:CPU has a cost analysis: every step reads and writes its state.
      assert row.accessed_bpp > 0, name
      assert row.temp_bpp >= 0, name
  _, many = sizes(results)
  scratch = [r for r in target_rows(results, False) if " scratch <= " in r[1]]
  assert [r[1].split(" scratch")[0] for r in scratch] == list(MPX)
  for r, name in zip(scratch, MPX, strict=True):
    assert r[2] == f"{many['rows'][name].temp_bpp:.2f} B/param"


def test_compile_time_against_leaf_count(smoke):
  results, _, _ = smoke
  compile_time = results["compile_time"]
  trees = compile_time["trees"]
  # The transformer-shaped tree first, then one tree per leaf count.
  counts = [int(c) for c in run.SMOKE_LEAF_COUNTS.split(",")]
  assert [t["leaves"] for t in trees[1:]] == counts
  assert trees[0]["label"] == sizes(results)[0]["label"]
  assert compile_time["targeted"] == dict(MPX_REFERENCES)
  for tree in trees:
    for name, row in tree["rows"].items():
      for key in ("trace_s", "lower_s", "compile_s", "total_s", "x_adam"):
        assert row[key] > 0, (tree["label"], name, key)
      assert len(row["totals_s"]) == compile_time["rounds"]
      # The ratio to the check-then-apply step, for the mpx steps only.
      assert (row["x_cond"] is not None) == (name in MPX), name
    assert tree["rows"][BASELINE]["x_adam"] == 1
    for name, cond in MPX_REFERENCES:
      row, base = tree["rows"][name], tree["rows"][cond]
      assert row["x_cond"] > 0
      if compile_time["rounds"] == 1:  # one round: the ratio is of the two totals
        assert row["x_cond"] == pytest.approx(row["total_s"] / base["total_s"])
  compile_targets = [r for r in targets.targets(results) if r[0].startswith("compile, ")]
  assert len(compile_targets) == len(trees) * len(MPX)


def test_storage_modes_under_two_malloc_settings(smoke):
  results, _, _ = smoke
  default, no_mmap = results["allocators"]
  assert default["env"] == {} and default["malloc"] == "glibc defaults"
  assert no_mmap["env"] == NO_MMAP_MALLOC
  # The child process saw the setting (recorded from its own environment).
  for key, value in no_mmap["env"].items():
    assert f"{key}={value}" in no_mmap["malloc"], key
  shaped, _ = sizes(results)
  for allocator in (default, no_mmap):
    assert "error" not in allocator, allocator.get("error")
    (size,) = allocator["sizes"]
    assert size["label"] == shaped["label"] and size["n"] == shaped["n"]
    assert set(size["rows"]) == set(ALLOCATOR_VARIANTS)
    for name in MPX_MODES:
      row = size["rows"][name]
      assert row.paired_with == MPX_BF16 and row.x_full_paired > 0
      assert row.fresh_bpp >= 0


def test_no_host_syncs(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    for name in ALWAYS:
      assert size["rows"][name].host_syncs == 0, name
  assert sizes(results)[0]["rows"][OPTAX_PEER].host_syncs == 0
  for mode, row in results["train"]["rows"].items():
    assert row.host_syncs == 0, mode


def test_one_compile_per_run(smoke):
  # Each run ends with one non-finite step for the variants that skip: it must
  # reuse the executable of the finite steps.
  results, _, _ = smoke
  for size in sizes(results):
    for name in (*MPX, *MPX_MODES):
      row = size["rows"][name]
      assert (row.compiles, row.traces) == (1, 1), (size["label"], name)
  for mode, row in results["train"]["rows"].items():
    assert (row.compiles, row.traces) == (1, 1), mode


def test_the_forced_skip_was_skipped(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    assert size["rows"][MPX_FP16].skipped_steps == 1, size["label"]
  train = results["train"]["rows"][MPX_FP16]
  assert train.skipped_total == train.skipped + 1


def test_mpx_state_is_adam_plus_a_master(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    n = size["n"]
    for name in MPX:
      state = size["mpx_state"][name]
      assert state["low_precision_params"] == n
      assert state["masters"] == 4 * n, name
      assert state["inner"] == size["adam_state_bytes"], name
      # Beside the masters and the inner state: scalars only (step counters,
      # and the loss scale's under loss_scale).
      assert all(shape == [] for shape in state["other_shapes"]), name
      assert state["other"] <= 4 * len(state["other_shapes"]) <= 4 * 8, name
    assert size["mpx_state"][MPX_FP16]["other"] >= LOSS_SCALE_SCALARS
    # The same seen per parameter, as the tables show it.
    fp32 = size["rows"][BASELINE].state_bpp
    for name in MPX:
      assert size["rows"][name].state_bpp == pytest.approx(fp32 + 4, abs=64 / n)


def test_state_bytes_per_param_by_storage_mode(smoke):
  # AdamW on bf16 params: full masters 12 bytes per parameter, remainders 10,
  # stochastic rounding 8; what is left over is scalars and one key per leaf.
  results, _, _ = smoke
  for size in sizes(results):
    n, leaves = size["n"], size["leaves"]
    for name, expected in STATE_BPP.items():
      state_bpp = size["rows"][name].state_bpp
      assert expected <= state_bpp == pytest.approx(expected, abs=(4 * leaves + 64) / n), name
      assert size["mpx_state"][name]["inner"] == size["adam_state_bytes"], name
      assert size["rows"][name].min_bytes == MIN_BYTES[name]
    full, remainder, stochastic = (size["mpx_state"][name] for name in STATE_BPP)
    assert (full["mode"], remainder["mode"], stochastic["mode"]) == (
      "full",
      "remainder",
      "stochastic",
    )
    assert remainder["masters"] == 2 * n
    # One uint32 key per leaf, and int32 step counters (the applied ones
    # count the random bits).
    assert stochastic["masters"] == 4 * leaves
    for state in (full, remainder, stochastic):
      assert all(shape == [] for shape in state["other_shapes"])
      assert state["other"] <= 4 * len(state["other_shapes"]) <= 4 * 4
    assert stochastic["other"] >= 4
    assert full["total"] - full["other"] - (remainder["total"] - remainder["other"]) == 2 * n
    assert (
      remainder["total"] - remainder["other"] - (stochastic["total"] - stochastic["other"])
      == 2 * n - 4 * leaves
    )
  # The peers' bytes, stated by construction beside the measured rows.
  stated = {name: (param, state) for name, param, state, _ in PEER_MEMORY}
  for peer, expected in PEER_BYTES.items():
    (name,) = [name for name in stated if name.startswith(peer)]
    assert stated[name] == expected, peer


def test_training_state_bytes(smoke):
  results, _, _ = smoke
  rows_ = results["train"]["rows"]
  n = results["train"]["model"]["params"]
  base = rows_[train_step.BASELINE]
  for mode in (MPX_BF16, MPX_FP16):
    assert rows_[mode].state_bpp == pytest.approx(base.state_bpp + 4, abs=64 / n)
    assert rows_[mode].peak_bytes > 0
    assert rows_[mode].compile_x == pytest.approx(rows_[mode].compile_s / base.compile_s)


def test_a_rows_ratios_are_derived_from_what_it_was_timed_against():
  row = StepRow(
    kind="mpx",
    n=1000,
    ms=2.0,
    min_bytes=30,
    baseline=BASELINE,
    ratios={BASELINE: 1.5, "hand": 1.2, "cond": 1.1, "roof": 3.0},
    reference="hand",
    check_then_apply="cond",
    paired_with="cond",
    paired_rounds=(1.0, 1.3, 1.05),
    roof="roof",
    roof_bytes=8000,
  )
  assert (row.x_base, row.x_hand, row.x_cond, row.x_full) == (1.5, 1.2, 1.1, None)
  assert row.x_cond_paired == 1.05 and row.x_hand_paired is None and row.x_full_paired is None
  assert row.floor_x == pytest.approx(3.0 * 8000 / 30000)
  assert row.roof_pct == pytest.approx(100 / row.floor_x)
  assert row.gbps == pytest.approx(30 * 1000 / 2e-3 / 1e9)


# --- benchmarks/moments.py: compressed optimizer moments --------------------------------

MOMENTS_SCRIPT = ROOT / "benchmarks" / "moments.py"
MOMENT_MASTERS = ("full", "remainder", "stochastic")
MOMENT_FORMATS = ("full", "bfloat16", "8bit", "4bit")
# The leaf the memory table is measured on under --smoke, and what AdamW's
# whole state on it must cost per bf16 parameter: the master (float32,
# int16 remainder, or none) plus mu and nu (float32, bfloat16, or a uint8 code
# each plus a float32 scale per block of 256 along the last axis, or two 4-bit
# codes a byte plus a float32 scale per block of 128).
MOMENTS_SMOKE_SHAPE = (64, 1024)
MASTER_BPP = {"full": 4, "remainder": 2, "stochastic": 0}
MOMENTS_BPP = {
  "full": 8,
  "bfloat16": 4,
  "8bit": 2 + 2 * 4 * (1024 // 256) / 1024,
  "4bit": 1 + 2 * 4 * (1024 // 128) / 1024,
}
MOMENT_PEERS = ("bitsandbytes", "torchao", "TransformerEngine", "FlashOptim", "optax.adamw")


@pytest.fixture(scope="module")
def moments_smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("moments")
  stdout = run_smoke(MOMENTS_SCRIPT, "--json", out / "moments.json", "--out", out / "moments.md")
  results = json.loads((out / "moments.json").read_text())
  return results, stdout, (out / "moments.md").read_text()


def test_moments_memory_per_param(moments_smoke):
  results, _, _ = moments_smoke
  assert tuple(results["memory_shape"]) == MOMENTS_SMOKE_SHAPE
  n = MOMENTS_SMOKE_SHAPE[0] * MOMENTS_SMOKE_SHAPE[1]
  rows = {(r["masters"], r["moments"]): r for r in results["memory"]}
  assert set(rows) == {(a, b) for a in MOMENT_MASTERS for b in MOMENT_FORMATS}
  for (masters, moments), row in rows.items():
    expected = MASTER_BPP[masters] + MOMENTS_BPP[moments]
    # Beyond the master and the moments, only a few scalars (counts, a key).
    assert expected <= row["state_bpp"] <= expected + 8 * 4 / n, (masters, moments)
    assert row["within"], (masters, moments)


def test_moments_speed_and_bytes_rows(moments_smoke):
  results, _, _ = moments_smoke
  (size,) = results["sizes"]
  rows = {(r["masters"], r["moments"]): r for r in size["rows"].values()}
  assert set(rows) == {(a, b) for a in MOMENT_MASTERS for b in MOMENT_FORMATS}
  for (masters, moments), row in rows.items():
    if moments == "full":
      assert row["x_full"] is None and row["saved_bpp"] == 0
    else:
      # One paired ratio per round, and their median (never checked: timings).
      assert len(row["x_full_rounds"]) == size["rounds"] > 0, (masters, moments)
      assert row["x_full"] > 0
    assert row["accessed_bpp"] > 0  # XLA:CPU's cost analysis
    # Less the one-element reads' charge, which only compressed moments have.
    assert row["accessed_bpp"] <= row["xla_accessed_bpp"]
    if moments == "full":
      assert row["accessed_bpp"] == row["xla_accessed_bpp"]
    assert row["host_syncs"] == 0, (masters, moments, row["host_syncs"])
    assert row["compiles"] == 1, (masters, moments)
    # The state the step carries: the same bytes as the memory table's, up to
    # the tree's small leaves, which stay float32.
    assert row["state_bpp"] >= MASTER_BPP[masters] + MOMENTS_BPP[moments] - 0.01


def test_one_element_reads_are_counted_as_xla_charges_them():
  """XLA charges a kernel that returns one element of a computed array its
  operands whole; ``one_element_read_bytes`` finds what it charges beyond
  the element, and nothing where no kernel reads one element."""
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  import jax
  import jax.numpy as jnp

  from benchmarks import common

  x = jnp.ones((256, 256), jnp.float32)
  with_read = jax.jit(lambda x: (x * 2, jnp.ravel(x * 2)[:1])).lower(x).compile()
  alone = jax.jit(lambda x: x * 2).lower(x).compile()
  # The whole operand is charged for the one element read ...
  assert common.bytes_accessed(with_read) - common.bytes_accessed(alone) >= x.nbytes
  # ... and all of it but the element is what the benchmark takes off.
  assert common.one_element_read_bytes(with_read.as_text()) == x.nbytes - 4
  assert common.one_element_read_bytes(alone.as_text()) == 0


def test_moments_report(moments_smoke):
  results, stdout, markdown = moments_smoke
  assert stdout.strip() == markdown.strip()
  assert "MALLOC_ARENA_MAX=1" in results["machine"]["malloc"]
  assert markdown.startswith("# Benchmarks: compressed optimizer moments\n")
  assert "\n## Memory: bytes per parameter, AdamW on bf16 params\n" in markdown
  assert "\n## Step time and bytes moved" in markdown
  for peer in MOMENT_PEERS:
    lines = [x for x in markdown.splitlines() if x.startswith(f"| {peer}")]
    assert lines, peer
    assert all("by construction, not measured" in x for x in lines), peer
  for masters in MOMENT_MASTERS:
    for moments in MOMENT_FORMATS:
      assert f"| mpx masters {masters}, moments {moments} |" in markdown
  assert "<= 1.3x" in markdown and "<= 1.1x" in markdown  # the speed goals beside the ratios


def test_gpu_step_time_checks_and_times_every_variant_on_any_device(capsys):
  """The script run on the H100 (docs/benchmarks_gpu_timed.md): its device checks
  pass here too, and every variant gets a timed row."""
  from benchmarks import gpu_step_time

  checks = gpu_step_time.check_bits(16, 2)
  assert len(checks) == 5
  assert all(": True" in line and "False" not in line for line in checks), checks
  gpu_step_time.main(["--rows", "2", "--steps", "1"])
  table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
  assert len(table) == 1 + len(gpu_step_time.VARIANTS)  # the header, a row each
  assert not [line for line in table if "failed" in line]


def test_gpu_bit_forms_runs_and_agrees_on_any_device(capsys):
  """The script that showed XLA:GPU's wrong forms (docs/benchmarks_gpu_timed.md):
  a row per form, and on XLA:CPU (its own reference) every row agrees."""
  from benchmarks import gpu_bit_forms

  gpu_bit_forms.main()
  rows = [line for line in capsys.readouterr().out.splitlines() if "bytes differ" in line]
  assert len(rows) == len(gpu_bit_forms._forms())
  assert all(line.split()[0] == "0" for line in rows), rows


# --- benchmarks/init_time.py: eager init against jitted -------------------------------------


def test_init_time_prints_a_row_per_moments_format():
  stdout = run_smoke(ROOT / "benchmarks" / "init_time.py")
  rows = [line.split("|")[1].strip() for line in stdout.splitlines() if line.startswith("| ")]
  assert rows[1:] == ["full", "8bit", "4bit"], stdout


def test_clipping_time_prints_each_step_relative_to_clipping_in_the_rule():
  stdout = run_smoke(ROOT / "benchmarks" / "clipping_time.py")
  rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith("| ")]
  names = [cells[0].strip() for cells in rows[1:]]
  assert names == [
    "unclipped",
    "unclipped, skip=leaf",
    "clip_by_global_norm in the rule",
    "mpx.clipped_grad, skip=leaf",
    "clip_by_block_rms in the rule, skip=leaf",
  ], stdout
  assert rows[3][2].strip() == "1.00", stdout
  assert all(float(cells[1]) > 0 for cells in rows[1:]), stdout


def test_scan_layers_time_prints_each_rule_against_its_plain_scanned_step():
  stdout = run_smoke(ROOT / "benchmarks" / "scan_layers_time.py")
  rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith("| ")]
  assert [cells[0].strip() for cells in rows[1:]] == [
    "optax adamw",
    "mpx 24bit + 4bit moments",
    "mpx stochastic + 4bit moments",
  ], stdout
  for _, plain, layered, relative in (cells for cells in rows[1:]):
    assert float(relative) == pytest.approx(float(layered) / float(plain), abs=0.05), stdout
