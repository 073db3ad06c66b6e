"""States mpx's speed, scratch and compile-time targets and checks a run against them."""

from __future__ import annotations

from typing import Any

from benchmarks.markdown import fmt, verdict
from benchmarks.optimizer_step import (
  HAND_COND,
  HAND_COND_BF16,
  MPX_BF16,
  MPX_REMAINDER,
  MPX_STOCHASTIC,
)
from benchmarks.rows import StepRow

MPX_FP16 = "mpx fp16"
# Speed and scratch hold at sizes of at least this many params and on the
# many-leaf tree; compile time on every compile-time tree.
TARGET_MIN_PARAMS = 8 * 2**20
# mpx step time over the check-then-apply step of its dtype (float32 masters,
# the step inside lax.cond(mpx.all_finite(grads))), paired.
TARGET_VS_COND = 1.0
TARGET_SCRATCH_BPP = 0.1  # memory_analysis().temp_size_in_bytes per param
# trace + lower + compile over the check-then-apply step's, in the same round.
TARGET_COMPILE_VS_COND = 1.3
# The storage modes: no slower than the full-master step, paired.
TARGET_VS_FULL = 1.0
# The remainder mode with glibc malloc told to keep large blocks (run.NO_MMAP_MALLOC).
TARGET_REMAINDER_NO_MMAP = 1.2
# Each mpx step and the check-then-apply step it is held against.
MPX_REFERENCES = ((MPX_BF16, HAND_COND_BF16), (MPX_FP16, HAND_COND))
MPX_MODES = (MPX_REMAINDER, MPX_STOCHASTIC)


def is_target_size(size: dict[str, Any]) -> bool:
  """Tells whether the speed and scratch targets hold on this tree."""
  return size.get("targets", size["n"] >= TARGET_MIN_PARAMS)


def _paired(
  label: str, row: StepRow | None, name: str, against: str, value: Any, target: float
) -> list[list[str]]:
  """Returns the targets table's row for one paired ratio, or none if not measured."""
  if row is None:
    return []
  return [
    [
      label,
      f"{name} <= {target:.2f}x {against}, paired",
      fmt(value, ".3f") + "x",
      verdict(value, target, "{0:.1%}"),
    ]
  ]


def _size_targets(size: dict[str, Any]) -> list[list[str]]:
  rows: list[list[str]] = []
  r, label = size["rows"], size["label"]
  for name, reference in MPX_REFERENCES:
    row = r.get(name)
    against = f"{reference} (check-then-apply)"
    rows += _paired(label, row, name, against, row and row.x_cond_paired, TARGET_VS_COND)
  if not size.get("many_leaves"):
    for name in MPX_MODES:
      row = r.get(name)
      against = f"{MPX_BF16} (full masters)"
      rows += _paired(label, row, name, against, row and row.x_full_paired, TARGET_VS_FULL)
  for name, _ in MPX_REFERENCES:
    row = r.get(name)
    if row is None or row.temp_bpp is None:
      continue
    rows.append(
      [
        label,
        f"{name} scratch <= {TARGET_SCRATCH_BPP} B/param",
        f"{row.temp_bpp:.2f} B/param",
        verdict(row.temp_bpp, TARGET_SCRATCH_BPP, "{1:.2f} B/param"),
      ]
    )
  fp16 = r.get(MPX_FP16)
  peers = {k: v for k, v in r.items() if v.kind == "peer"}
  if fp16 is not None and peers:
    slower = [f"{k} ({fp16.ms / v.ms:.2f}x)" for k, v in peers.items() if fp16.ms >= v.ms]
    best = min(peers, key=lambda k: peers[k].ms)
    rows.append(
      [
        label,
        "mpx fp16 faster than every peer's fp16 path",
        f"{fp16.ms / peers[best].ms:.2f}x the fastest peer ({best})",
        "met" if not slower else "**missed**: slower than " + ", ".join(slower),
      ]
    )
  return rows


def _allocator_targets(allocator: dict[str, Any]) -> list[list[str]]:
  rows = []
  for size in allocator.get("sizes", []):
    if not is_target_size(size):
      continue
    row = size["rows"].get(MPX_REMAINDER)
    rows += _paired(
      f"{size['label']}, malloc: {allocator['name']}",
      row,
      MPX_REMAINDER,
      f"{MPX_BF16} (full masters)",
      row and row.x_full_paired,
      TARGET_REMAINDER_NO_MMAP,
    )
  return rows


def tree_label(tree: dict[str, Any]) -> str:
  """Returns "1000 leaves", or "1M tree (26 leaves)" for the transformer-shaped one."""
  if tree["label"].endswith("leaves"):
    return tree["label"]
  return f"{tree['label']} tree ({tree['leaves']} leaves)"


def _compile_targets(compile_time: dict[str, Any]) -> list[list[str]]:
  targeted = compile_time.get("targeted", {})
  if isinstance(targeted, list):  # results written before the check-then-apply baseline
    return []
  rows = []
  for tree in compile_time.get("trees", []):
    for name, reference in targeted.items():
      row, base = tree["rows"].get(name), tree["rows"].get(reference)
      if row is None or base is None or row.get("x_cond") is None:
        continue
      rows.append(
        [
          f"compile, {tree_label(tree)}",
          f"{name} compile <= {TARGET_COMPILE_VS_COND:.1f}x {reference} (check-then-apply)",
          f"{row['x_cond']:.2f}x ({row['total_s']:.1f} s vs {base['total_s']:.1f} s)",
          verdict(row["x_cond"], TARGET_COMPILE_VS_COND, "{0:.1%}"),
        ]
      )
  return rows


def targets(results: dict[str, Any]) -> list[list[str]]:
  """Returns one row per target and size: what was asked, what was measured, the verdict."""
  rows = []
  for size in results["optimizer"]["sizes"]:
    if is_target_size(size):
      rows += _size_targets(size)
  for allocator in results.get("allocators", []):
    if allocator["env"]:  # the target is for the setting, not glibc's defaults
      rows += _allocator_targets(allocator)
  return rows + _compile_targets(results.get("compile_time") or {})
