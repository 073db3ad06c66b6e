"""Runs ``benchmarks/run.py --smoke`` and checks the structure of what it measures.

Never timings: the machine is shared and the sizes are tiny. What must hold on
any machine: every mpx step is host-sync free and compiles once per run (finite
and skipped steps alike), and mpx's optimizer state is the inner Adam state
plus a 4-byte master per low-precision parameter, nothing more than a few
scalars; with remainder masters a 2-byte remainder instead, with stochastic
rounding nothing but a key per leaf and counters (AdamW on bf16: 12, 10 and 8
bytes of state per parameter). And the report's structure: a hand-written step
per dtype without safety and a check-then-apply one, each mpx step's paired
ratio to the check-then-apply step of its dtype (and the storage modes' to the
full-master step, also in two processes started with different malloc
settings), XLA's bytes accessed and scratch per parameter, state bytes per
parameter beside the peers' by construction, the many-leaf tree, and compile
time against leaf count, against the check-then-apply steps.

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

# Minutes in all: behind the marker; CI runs them with `pytest -m slow`.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"
ALWAYS = (
  "optax adam fp32",
  "hand-written fp16 (no safety)",
  "hand-written bf16 (no safety)",
  "hand + cond (flag given)",
  "hand + check",
  "hand + cond",
  "hand bf16 + cond",
  "hand + select",
  "mpx bf16",
  "mpx bf16 remainder",
  "mpx bf16 stochastic",
  "mpx fp16",
)
# Always installed; left out of the many-leaf tree like every peer.
OPTAX_PEER = "optax.apply_if_finite fp16"
PEERS = ("jmp fp16", "flax DynamicScale fp16", "mixed-precision-for-JAX fp16")
MPX = ("mpx bf16", "mpx fp16")  # the speed and scratch targets
# mpx bf16 in the other storage modes of its masters, and its state bytes per
# parameter in each (AdamW on bf16 params; a few scalars and keys aside).
MODES = ("mpx bf16 remainder", "mpx bf16 stochastic")
FULL = "mpx bf16"
STATE_BPP = {FULL: 12, "mpx bf16 remainder": 10, "mpx bf16 stochastic": 8}
MIN_BYTES = {FULL: 30, "mpx bf16 remainder": 28, "mpx bf16 stochastic": 24}
# Each mpx step's hand-written step without safety (x hand, through the
# baseline) and its check-then-apply step (paired, and the compile-time
# baseline); the storage modes are paired with the full-master step.
REFERENCE = {
  "mpx bf16": "hand-written bf16 (no safety)",
  "mpx fp16": "hand-written fp16 (no safety)",
}
CHECK_THEN_APPLY = {"mpx bf16": "hand bf16 + cond", "mpx fp16": "hand + cond"}
TIMED_NEXT_TO = {**CHECK_THEN_APPLY, **{name: FULL for name in MODES}}
# AdamW on 16-bit params elsewhere, (param, state) bytes per parameter, as the
# report states them by construction.
PEER_BYTES = {
  "PyTorch AMP / apex O2": (2, 12),
  "TransformerEngine FusedAdam": (2, 10),
  "torchao AdamW": (2, 8),
  "Kahan summation (optimi)": (2, 10),
  "plain FP32 Adam": (4, 8),
}
COMPILE_VARIANTS = (
  "optax adam fp32",
  "hand-written bf16 (no safety)",
  "hand bf16 + cond",
  "hand + cond",
  "mpx bf16",
  "mpx fp16",
)
# The allocator runs: glibc's defaults, then the setting that keeps large
# blocks in the heap (what benchmarks/run.py sets, spelled out here).
NO_MMAP = {
  "MALLOC_MMAP_THRESHOLD_": "4294967296",
  "MALLOC_TRIM_THRESHOLD_": "68719476736",
  "MALLOC_TOP_PAD_": "1073741824",
  "MALLOC_ARENA_MAX": "1",
}
ALLOCATOR_ROWS = ("optax adam fp32", FULL, *MODES)
SMOKE_LEAF_COUNTS = (10, 30)  # benchmarks/run.py's --smoke leaf counts
TRAIN_MODES = ("fp32 optax", "mpx bf16", "mpx fp16")
# LossScaleState's scalars: loss_scale f32, three int32 counters, one bool.
LOSS_SCALE_SCALARS = 4 + 3 * 4 + 1


def run_smoke(script, *args):
  """``script --smoke args`` in a subprocess with XLA's backend optimisations
  off (compiling is most of a smoke run); its stdout, after checking it
  exited 0."""
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
  return json.loads((out / "results.json").read_text()), stdout, out


def sizes(results):
  """(the transformer-shaped size, the many-leaf tree): what --smoke runs."""
  shaped, many = results["optimizer"]["sizes"]
  assert not shaped["many_leaves"] and many["many_leaves"]
  return shaped, many


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
  assert "## 2. Compile time against leaf count" in markdown
  assert "## 3. Whole training step" in markdown
  assert results["machine"]["jax"] in markdown


def test_every_variant_is_measured_or_explained(smoke):
  results, _, _ = smoke
  shaped, many = sizes(results)
  for name in ALWAYS:
    assert name in shaped["rows"], name
    assert name in many["rows"], name
  assert OPTAX_PEER in shaped["rows"]
  for name in (*PEERS, OPTAX_PEER):
    assert name in shaped["rows"] or shaped["unavailable"][name], name
    # Left out of the many-leaf tree, and said so.
    assert name not in many["rows"] and name in many["skipped_peers"], name
  for size in (shaped, many):
    for row in size["rows"].values():
      assert row["ms"] > 0 and row["x_base"] > 0
  assert set(results["train"]["rows"]) == set(TRAIN_MODES)


def test_many_leaf_tree(smoke):
  results, stdout, _ = smoke
  _, many = sizes(results)
  assert many["leaves"] == results["settings"]["many_leaves"] > 1
  assert many["label"].startswith(f"{many['leaves']} leaves (")
  assert many["targets"]  # its speed targets are evaluated
  assert f"{many['label']} paired" in stdout


def test_mpx_steps_are_paired_with_the_check_then_apply_step_of_their_dtype(smoke):
  results, stdout, _ = smoke
  for size in sizes(results):
    assert size["references"] == TIMED_NEXT_TO
    for name, reference in REFERENCE.items():
      row = size["rows"][name]
      cond = CHECK_THEN_APPLY[name]
      assert row["reference"] == reference and row["x_hand"] > 0
      assert row["check_then_apply"] == cond and row["x_cond"] > 0
      assert row["paired_with"] == cond
      assert len(row["paired_rounds"]) == size["rounds"]
      assert all(x > 0 for x in row["paired_rounds"])
      assert row["x_cond_paired"] > 0 and row["x_hand_paired"] is None
    # The other 16-bit rows carry the ratios-of-ratios to their dtype's hand steps only.
    for cond, reference in (
      ("hand + cond", REFERENCE["mpx fp16"]),
      ("hand bf16 + cond", REFERENCE["mpx bf16"]),
    ):
      row = size["rows"][cond]
      assert row["reference"] == reference and row["x_hand"] > 0
      assert row["check_then_apply"] is None and row["x_cond"] is None
      assert row["x_cond_paired"] is None and row["x_hand_paired"] is None
    assert size["rows"]["hand + select"]["check_then_apply"] == "hand + cond"
    assert size["rows"]["optax adam fp32"]["reference"] is None
  for name, cond in CHECK_THEN_APPLY.items():
    assert f"| {name} <= 1.00x {cond} (check-then-apply), paired |" in stdout


def test_storage_modes_are_paired_with_the_full_master_step(smoke):
  results, stdout, _ = smoke
  for size in sizes(results):
    for name in MODES:
      row = size["rows"][name]
      assert row["paired_with"] == FULL
      assert row["reference"] == REFERENCE[FULL]  # x hand, through the baseline
      assert row["x_hand_paired"] is None and row["x_hand"] > 0
      assert row["x_cond_paired"] is None and row["x_cond"] > 0
      assert len(row["paired_rounds"]) == size["rounds"]
      assert all(x > 0 for x in row["paired_rounds"])
      assert row["x_full_paired"] > 0 and row["x_full"] > 0
    assert size["rows"][FULL]["x_full_paired"] is None
  assert "### The storage modes of the masters, against full masters" in stdout
  for name in MODES:
    assert f"| {name} | {FULL} |" in stdout
  # Their targets hold at 16M and 64M, not on the many-leaf tree; the smoke
  # sizes are below the targets' threshold, so the rows are rendered here from
  # its results with the transformer-shaped size counted as a target size.
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  from benchmarks import report

  shaped, many = sizes(results)
  shaped["targets"] = True
  try:
    rows = report.targets(results)
  finally:
    shaped["targets"] = False
  for name in MODES:
    target = f"{name} <= 1.00x {FULL} (full masters), paired"
    labels = [r[0] for r in rows if r[1] == target]
    assert labels == [shaped["label"]], name
    (row,) = [r for r in rows if r[1] == target]
    assert row[2] == f"{shaped['rows'][name]['x_full_paired']:.3f}x"
    assert row[3] == "met" or row[3].startswith("**missed** by ")
  assert many["label"] not in {r[0] for r in rows if "(full masters)" in r[1]}


def test_xla_bytes_accessed_and_scratch_per_param(smoke):
  results, stdout, _ = smoke
  for size in sizes(results):
    for name, row in size["rows"].items():
      # XLA:CPU has a cost analysis: every step reads and writes its state.
      assert row["accessed_bpp"] > 0, name
      assert row["temp_bpp"] >= 0, name
  assert "XLA B/param" in stdout and "temp B/param" in stdout
  for name in MPX:
    assert f"| {name} scratch <= 0.1 B/param |" in stdout


def test_compile_time_against_leaf_count(smoke):
  results, stdout, _ = smoke
  compile_time = results["compile_time"]
  trees = compile_time["trees"]
  # The transformer-shaped tree first, then one tree per leaf count.
  assert [t["leaves"] for t in trees[1:]] == list(SMOKE_LEAF_COUNTS)
  assert trees[0]["label"] == sizes(results)[0]["label"]
  assert compile_time["targeted"] == CHECK_THEN_APPLY
  for tree in trees:
    assert set(tree["rows"]) == set(COMPILE_VARIANTS)
    for name, row in tree["rows"].items():
      for key in ("trace_s", "lower_s", "compile_s", "total_s", "x_adam"):
        assert row[key] > 0, (tree["label"], name, key)
      assert len(row["totals_s"]) == compile_time["rounds"]
      # The ratio to the check-then-apply step, for the mpx steps only.
      assert (row["x_cond"] is not None) == (name in CHECK_THEN_APPLY), name
    assert tree["rows"]["optax adam fp32"]["x_adam"] == 1
    for name, cond in CHECK_THEN_APPLY.items():
      row, base = tree["rows"][name], tree["rows"][cond]
      assert row["x_cond"] > 0
      if compile_time["rounds"] == 1:  # one round: the ratio is of the two totals
        assert row["x_cond"] == pytest.approx(row["total_s"] / base["total_s"])
      assert f"| compile, {tree['label']}" in stdout
      assert f"{name} compile <= 1.3x {cond} (check-then-apply)" in stdout
  assert "| tree | variant | trace s | lower s | compile s | total s |" in stdout
  assert "x cond |" in stdout


def test_storage_modes_under_two_malloc_settings(smoke):
  results, stdout, _ = smoke
  default, no_mmap = results["allocators"]
  assert default["env"] == {} and default["malloc"] == "glibc defaults"
  assert {k: no_mmap["env"][k] for k in NO_MMAP} == NO_MMAP
  # The child process saw the setting (recorded from its own environment).
  for key, value in no_mmap["env"].items():
    assert f"{key}={value}" in no_mmap["malloc"], key
  shaped, _ = sizes(results)
  for allocator in (default, no_mmap):
    assert "error" not in allocator, allocator.get("error")
    (size,) = allocator["sizes"]
    assert size["label"] == shaped["label"] and size["n"] == shaped["n"]
    assert set(size["rows"]) == set(ALLOCATOR_ROWS)
    for name in MODES:
      row = size["rows"][name]
      assert row["paired_with"] == FULL and row["x_full_paired"] > 0
      assert row["fresh_bpp"] >= 0
  assert "### The storage modes under two malloc settings" in stdout
  for key, value in NO_MMAP.items():
    assert f"`{key}={value}`" in stdout
  assert "| malloc | glibc defaults |" in stdout


def test_no_host_syncs(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    for name in ALWAYS:
      assert size["rows"][name]["host_syncs"] == 0, name
  assert sizes(results)[0]["rows"][OPTAX_PEER]["host_syncs"] == 0
  for mode, row in results["train"]["rows"].items():
    assert row["host_syncs"] == 0, mode


def test_one_compile_per_run(smoke):
  # Each run ends with one non-finite step for the variants that skip: it must
  # reuse the executable of the finite steps.
  results, _, _ = smoke
  for size in sizes(results):
    for name in (*MPX, *MODES):
      row = size["rows"][name]
      assert (row["compiles"], row["traces"]) == (1, 1), (size["label"], name)
  for mode, row in results["train"]["rows"].items():
    assert (row["compiles"], row["traces"]) == (1, 1), mode


def test_the_forced_skip_was_skipped(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    assert size["rows"]["mpx fp16"]["skipped_steps"] == 1, size["label"]
  train = results["train"]["rows"]["mpx fp16"]
  assert train["skipped_total"] == train["skipped"] + 1


def test_mpx_state_is_adam_plus_a_master(smoke):
  results, _, _ = smoke
  for size in sizes(results):
    n = size["n"]
    for name in MPX:
      state = size["mpx_state"][name]
      assert state["low_precision_params"] == n
      assert state["masters"] == 4 * n, name
      assert state["inner"] == size["adam_state_bytes"], name
    # Beside the masters and the inner state: scalars only (step counters, and
    # the loss scale's under loss_scale).
    for name in MPX:
      state = size["mpx_state"][name]
      assert all(shape == [] for shape in state["other_shapes"]), name
      assert state["other"] <= 4 * len(state["other_shapes"]) <= 4 * 8, name
    assert size["mpx_state"]["mpx fp16"]["other"] >= LOSS_SCALE_SCALARS
    # The same seen per parameter, as the tables show it.
    fp32 = size["rows"]["optax adam fp32"]["state_bpp"]
    for name in MPX:
      assert size["rows"][name]["state_bpp"] == pytest.approx(fp32 + 4, abs=64 / n)


def test_state_bytes_per_param_by_storage_mode(smoke):
  # AdamW on bf16 params: full masters 12 bytes per parameter, remainders 10,
  # stochastic rounding 8; what is left over is scalars and one key per leaf.
  results, stdout, _ = smoke
  for size in sizes(results):
    n, leaves = size["n"], size["leaves"]
    for name, expected in STATE_BPP.items():
      state_bpp = size["rows"][name]["state_bpp"]
      assert state_bpp == pytest.approx(expected, abs=(4 * leaves + 64) / n), name
      assert state_bpp >= expected, name
      state = size["mpx_state"][name]
      assert state["inner"] == size["adam_state_bytes"], name
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
  variants = {v["name"]: v for v in results["optimizer"]["variants"]}
  for name, min_bytes in MIN_BYTES.items():
    assert variants[name]["min_bytes"] == min_bytes, name
  # The memory table: measured rows and the peers' by construction.
  assert "### Memory: bytes per parameter" in stdout
  assert "| mpx bf16 remainder | 2 | 10.00 | 12.00 | measured in this run" in stdout
  for peer, (param, state) in PEER_BYTES.items():
    (line,) = [x for x in stdout.splitlines() if x.startswith(f"| {peer}")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:4] == [str(param), str(state), str(param + state)], peer
    assert cells[4].startswith("by construction, not measured"), peer
  assert "| variant | min B/param | state B/param |" in stdout


def test_training_state_bytes(smoke):
  results, _, _ = smoke
  rows = results["train"]["rows"]
  n = results["train"]["model"]["params"]
  for mode in ("mpx bf16", "mpx fp16"):
    assert rows[mode]["state_bpp"] == pytest.approx(rows["fp32 optax"]["state_bpp"] + 4, abs=64 / n)
    assert rows[mode]["peak_bytes"] > 0


# --- benchmarks/moments.py: compressed optimizer moments --------------------------------

MOMENTS_SCRIPT = ROOT / "benchmarks" / "moments.py"
MOMENT_MASTERS = ("full", "remainder", "stochastic")
MOMENT_FORMATS = ("full", "bfloat16", "8bit")
# The leaf the memory table is measured on under --smoke, and what AdamW's
# whole state on it must cost per bf16 parameter: the master (float32,
# int16 remainder, or none) plus mu and nu (float32, bfloat16, or a uint8 code
# each plus a float32 scale per block of 256 along the last axis).
MOMENTS_SMOKE_SHAPE = (64, 1024)
MASTER_BPP = {"full": 4, "remainder": 2, "stochastic": 0}
MOMENTS_BPP = {"full": 8, "bfloat16": 4, "8bit": 2 + 2 * 4 * (1024 // 256) / 1024}
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
