"""Renders docs/benchmarks.md's cost decomposition, compile-time and training sections."""

from __future__ import annotations

from typing import Any

from benchmarks.markdown import compiles_cell, fmt, prose, syncs_cell, table
from benchmarks.optimizer_step import (
  BASELINE,
  HAND,
  HAND_BF16,
  HAND_COND,
  HAND_COND_BF16,
  MPX_BF16,
)
from benchmarks.report_optimizer import largest
from benchmarks.targets import MPX_FP16, tree_label

COND_FLAG, CHECK, SELECT = "hand + cond (flag given)", "hand + check", "hand + select"
# The finite-check probes the decomposition quotes (benchmarks/optimizer_step.py's CHECKS).
CHECK_PROBES = {
  "mpx": "mpx.all_finite (this checkout)",
  "sum": "isfinite(sum(x*0)) per leaf",
  "leaf": "all(isfinite(x)) per leaf (jmp, optax)",
}
CHECK_COPY = "fp16 grads x+1 (reference)"


def explanation(results: dict[str, Any]) -> str:
  """Decomposes the cost of safety with this run's numbers at the largest size."""
  big = largest(results["optimizer"]["sizes"])
  r, n = big["rows"], big["n"]
  needed = (BASELINE, HAND, COND_FLAG, CHECK, HAND_COND, SELECT, MPX_FP16)
  if any(name not in r for name in needed):
    return prose("cost_missing", names=", ".join(needed))
  hand_ms = r[HAND].ms
  profile = big.get("profile", {})

  def part(delta: float) -> str:
    """Formats a difference of ratios to the hand step in its ms and percent."""
    change = delta * hand_ms
    return f"{change:+.{0 if abs(change) >= 10 else 1}f} ms ({100 * delta:+.0f}% of the hand step)"

  def copies(name: str) -> str:
    return str(profile.get(name, {}).get("copy", "?"))

  def scratch(name: str) -> str:
    temp = profile.get(name, {}).get("temp_bytes")
    return "?" if temp is None else f"{temp / n:.1f}"

  def x(name: str) -> float:
    return r[name].x_hand

  def temp(name: str) -> int:
    return profile.get(name, {}).get("temp_bytes", 0)

  outside = temp(MPX_FP16) >= 4 * n > temp(HAND_COND)
  text = prose(
    "cost",
    label=big["label"],
    hand_ms=hand_ms,
    hand_x=r[HAND].x_base,
    base_ms=r[BASELINE].ms,
    cond_flag=part(x(COND_FLAG) - 1),
    check=part(x(CHECK) - 1),
    cond=part(x(HAND_COND) - x(CHECK)),
    select=part(x(SELECT) - x(CHECK)),
    select_copies=copies(SELECT),
    mpx=part(x(MPX_FP16) - x(HAND_COND)),
    mpx_copies=copies(MPX_FP16),
    mpx_scratch=scratch(MPX_FP16),
    cond_copies=copies(HAND_COND),
    cond_scratch=scratch(HAND_COND),
    why=prose("cost_updates_outside" if outside else "cost_same_structure"),
  )
  bf16 = r.get(MPX_BF16)
  if bf16 is not None and HAND_BF16 in r:
    text += "\n" + prose(
      "cost_bf16",
      hand_ms=r[HAND_BF16].ms,
      x_hand=fmt(bf16.x_hand, ".3f"),
      cond=HAND_COND_BF16,
      x_cond=fmt(bf16.x_cond_paired, ".3f"),
      copies=copies(MPX_BF16),
      scratch=scratch(MPX_BF16),
      hand_copies=copies(HAND_BF16),
      hand_scratch=scratch(HAND_BF16),
    )
  if r[SELECT].fresh_bpp is not None and r[MPX_FP16].fresh_bpp is not None:
    fresh = {"select": r[SELECT].fresh_bpp, "mpx": r[MPX_FP16].fresh_bpp}
    text += "\n" + prose("cost_fresh", **fresh, hand=r[HAND].fresh_bpp or 0)
  probes = big.get("probes", {})
  checks = {key: probes.get(name) for key, name in CHECK_PROBES.items()}
  copy = probes.get(CHECK_COPY)
  if all(checks.values()) and copy:

    def check(c: dict[str, Any]) -> str:
      p = c["profile"]
      scratch, custom = p["temp_bytes"] / n, p["custom_fusions"]
      return prose("cost_check", ms=c["ms"], x_copy=c["x_copy"], scratch=scratch, custom=custom)

    done = {key: check(c) for key, c in checks.items() if c}
    text += "\n\n" + prose(
      "cost_checks", copy_ms=copy["ms"], mpx=done["mpx"], sum=done["sum"], leaf=done["leaf"]
    )
  return text + "\n\n" + prose("cost_floor")


_SPLIT_HEADER = ["tree", "variant", "trace s", "lower s", "compile s", "total s", "ms/leaf"]


def compile_time_section(compile_time: dict[str, Any]) -> list[str]:
  """Renders compile time against leaf count: a summary table and the split."""
  trees = compile_time.get("trees", [])
  if not trees:
    return []
  names = [v["name"] for v in compile_time["variants"]]
  side = compile_time["leaf_side"]
  shaped = [t["label"] for t in trees if not t["label"].endswith("leaves")]
  also = " " + prose("compile_time_also", tree=shaped[0]) if shaped else ""
  what = [[v["name"], v["what"]] for v in compile_time["variants"]]
  out = [
    prose("compile_time", side=side, also=also, rounds=compile_time["rounds"]),
    table(["variant", "what it compiles"], what, "ll"),
  ]
  header = ["variant"]
  for tree in trees:
    label = tree_label(tree)
    header += [f"{label} s", f"{label} x adam", f"{label} x cond"]
  rows = []
  for name in names:
    row = [name]
    for tree in trees:
      r = tree["rows"].get(name)
      row += (
        ["n/a"] * 3 if r is None else [fmt(r["total_s"]), fmt(r["x_adam"]), fmt(r.get("x_cond"))]
      )
    rows.append(row)
  out.append(table(header, rows))
  rows = []
  for tree in trees:
    for name in names:
      r = tree["rows"].get(name)
      if r is None:
        continue
      times = [fmt(r[k]) for k in ("trace_s", "lower_s", "compile_s", "total_s")]
      ratios = [fmt(r["ms_per_leaf"], ".1f"), fmt(r["x_adam"]), fmt(r.get("x_cond"))]
      rows.append([tree_label(tree), name, *times, *ratios])
  out.append(prose("compile_split"))
  out.append(table([*_SPLIT_HEADER, "x adam", "x cond"], rows, "ll" + "r" * 7))
  return out


_TRAIN_HEADER = ["mode", "params", "ms/step", "x fp32", "opt state B/param", "peak MiB"]
_TRAIN_HEADER += ["compile s", "compile x fp32", "host syncs", "compiles", "skipped"]


def train_section(results: dict[str, Any]) -> list[str]:
  """Renders the whole training step of the demo transformer, per mode."""
  train = results.get("train")
  if not train:
    return []
  rows = []
  for mode, r in train["rows"].items():
    rows.append(
      [
        mode,
        r.param_dtype,
        fmt(r.ms, ".1f"),
        fmt(r.x_base),
        fmt(r.state_bpp),
        fmt(r.peak_bytes / 2**20, ".1f"),
        fmt(r.compile_s),
        fmt(r.compile_x),
        syncs_cell(r.host_syncs),
        compiles_cell(r.compiles, r.traces),
        "-" if r.skipped is None else str(r.skipped),
      ]
    )
  intro = prose(
    "train",
    rounds=train["rounds"],
    steps=train["steps_per_round"],
    peak_source=train["peak_source"],
    **train["model"],
  )
  return [intro, table(_TRAIN_HEADER, rows, "ll" + "r" * 9)]
