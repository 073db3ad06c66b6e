"""Renders section 1 of docs/benchmarks.md: the optimizer step's tables."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.markdown import compiles_cell, fmt, prose, syncs_cell, table
from benchmarks.optimizer_step import BASELINE, MPX_BF16, MPX_REMAINDER, MPX_STOCHASTIC
from benchmarks.rows import StepRow

MPX_MODES = (MPX_REMAINDER, MPX_STOCHASTIC)
# AdamW (float32 moments) on 16-bit params, elsewhere: bytes per parameter of
# the param and of the optimizer state, by construction (what each keeps per
# parameter), not measured here.
PEER_MEMORY = (
  (
    "PyTorch AMP / apex O2: float32 master copy",
    2,
    12,
    "float32 master + m + v; `torch.autocast` keeps the float32 params themselves "
    "as the masters (4 + 8 B)",
  ),
  (
    "TransformerEngine FusedAdam, store_param_remainders=True",
    2,
    10,
    "int16 low bits of the float32 master + float32 m + v",
  ),
  (
    "torchao AdamW, bf16_stochastic_round=True",
    2,
    8,
    "float32 m + v, no master; torchao allocates m and v in the param dtype by "
    "default (4 B on bf16 params)",
  ),
  (
    "Kahan summation (optimi), bf16 compensation, float32 moments",
    2,
    10,
    "bf16 compensation buffer + float32 m + v; optimi allocates m, v and the "
    "compensation in the param dtype by default (6 B on bf16 params)",
  ),
  ("plain FP32 Adam", 4, 8, "float32 m + v; the float32 params are their own masters"),
)
PARAM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What leaves the skip lax.cond in each storage mode, beyond the full mode's.
_LEAVES_COND = {
  MPX_REMAINDER: "remainder mode's new float32 master, split into param and remainder after it",
  MPX_STOCHASTIC: "stochastic mode's new bf16 param, rounded inside it",
}
Sizes = list[dict[str, Any]]


def largest(sizes: Sizes) -> dict[str, Any]:
  """Returns the largest transformer-shaped size (the detailed tables are of it)."""
  shaped = [s for s in sizes if not s.get("many_leaves")] or sizes
  return max(shaped, key=lambda s: s["n"])


def state_bpp(sizes: Sizes, big: dict[str, Any], name: str) -> float | None:
  """Returns a variant's state bytes per param at the largest size where it ran."""
  for size in [big, *sorted(sizes, key=lambda s: -s["n"])]:
    row = size["rows"].get(name)
    if row is not None:
      return row.state_bpp
  return None


def _per_size(sizes: Sizes, name: str, cells: Any, width: int) -> list[str]:
  """Returns ``cells(row)`` for each size, ``n/a`` where the variant did not run."""
  out: list[str] = []
  for size in sizes:
    row = size["rows"].get(name)
    out += ["n/a"] * width if row is None else cells(row)
  return out


def _ms(ms: float) -> str:
  return fmt(ms, ".1f" if ms >= 10 else ".2f")


def time_tables(sizes: Sizes, variants: list[dict[str, Any]]) -> list[str]:
  """Renders the step times against FP32 Adam and against the hand-written steps."""
  header = ["variant", "params"]
  for size in sizes:
    header += [f"{size['label']} ms", f"{size['label']} x fp32"]
  rows = [
    [v["name"], v["param_dtype"], *_per_size(sizes, v["name"], _time_cells, 2)] for v in variants
  ]
  rounds = ", ".join(
    f"{s['label']}: {s['rounds']} rounds of {s['steps_per_round']} steps" for s in sizes
  )
  out = [prose("time_table", rounds=rounds), table(header, rows, "ll" + "r" * (len(header) - 2))]
  missing: dict[str, str] = {}
  for size in sizes:
    missing.update(size.get("unavailable", {}))
  if missing:
    out.append("\n".join(f"- n/a: **{k}**: {why}" for k, why in missing.items()))
  skipped = sorted({name for size in sizes for name in size.get("skipped_peers", [])})
  if skipped:
    many = ", ".join(s["label"] for s in sizes if s.get("many_leaves"))
    out.append(prose("peers_left_out", trees=many, peers=", ".join(skipped)))
  header = ["variant", "against"]
  for size in sizes:
    header += [f"{size['label']} x hand", f"{size['label']} x cond", f"{size['label']} paired"]
  rows = []
  for v in variants:
    measured = [s["rows"][v["name"]] for s in sizes if v["name"] in s["rows"]]
    reference = next((r.reference for r in measured if r.reference), None)
    cond = next((r.check_then_apply for r in measured if r.check_then_apply), None)
    if reference not in (None, v["name"]):
      against = reference + (f"; {cond}" if cond else "")
      rows.append([v["name"], against, *_per_size(sizes, v["name"], _hand_cells, 3)])
  if rows:
    out += [prose("against_hand"), table(header, rows, "ll" + "r" * (len(header) - 2))]
  return out


def _time_cells(r: StepRow) -> list[str]:
  return [_ms(r.ms), fmt(r.x_base)]


def _hand_cells(r: StepRow) -> list[str]:
  return [fmt(r.x_hand, ".3f"), fmt(r.x_cond, ".3f"), fmt(r.x_cond_paired, ".3f")]


def xla_table(sizes: Sizes, variants: list[dict[str, Any]]) -> list[str]:
  """Renders XLA's bytes accessed and scratch per parameter, at every size."""
  big = largest(sizes)
  header = ["variant", "min B/param", "state B/param"]
  for size in sizes:
    header += [f"{size['label']} XLA B/param", f"{size['label']} temp B/param"]
  rows = []
  for v in variants:
    cells = _per_size(
      sizes, v["name"], lambda r: [fmt(r.accessed_bpp, ".1f"), fmt(r.temp_bpp, ".2f")], 2
    )
    rows.append([v["name"], str(v["min_bytes"]), fmt(state_bpp(sizes, big, v["name"])), *cells])
  return [
    prose("xla_bytes", label=big["label"]),
    table(header, rows, "lrr" + "r" * (len(header) - 3)),
  ]


def bandwidth_table(big: dict[str, Any], variants: list[dict[str, Any]]) -> list[str]:
  """Renders bytes, bandwidth and the roofline at the largest size."""
  rows = []
  for v in variants:
    r = big["rows"].get(v["name"])
    if r is None:
      continue
    rows.append(
      [
        v["name"],
        str(v["min_bytes"]),
        fmt(r.state_bpp),
        fmt(r.gbps, ".1f"),
        fmt(r.roof_pct, ".0f") + "%",
        fmt(r.floor_x),
        syncs_cell(r.host_syncs),
        compiles_cell(r.compiles, r.traces),
      ]
    )
  header = ["variant", "min B/param", "state B/param", "GB/s", "of roofline", "x floor"]
  return [
    prose("bandwidth", label=big["label"], n=big["n"], **big["roofline"]),
    table([*header, "host syncs", "compiles"], rows),
  ]


def checks_table(big: dict[str, Any]) -> list[str]:
  """Renders the finite checks alone, against a copy of the gradients."""
  checks = {k: v for k, v in big.get("probes", {}).items() if v["group"] == "check"}
  if not checks:
    return []
  rows = [
    [
      name,
      str(c["bytes_per_param"]),
      _ms(c["ms"]),
      fmt(c["gbps"], ".1f"),
      fmt(c["x_copy"]),
      fmt(c["profile"]["temp_bytes"] / big["n"], ".1f"),
      str(c["profile"]["custom_fusions"]),
    ]
    for name, c in checks.items()
  ]
  header = ["check", "min B/param", "ms", "GB/s", "x reference", "temp B/param", "kCustom"]
  return [prose("checks", label=big["label"]), table(header, rows)]


def profile_table(big: dict[str, Any], variants: list[dict[str, Any]]) -> list[str]:
  """Renders the HLO profile of every variant at the largest size."""
  profile = big.get("profile", {})
  if not profile:
    return []
  rows = []
  for v in variants:
    p = profile.get(v["name"])
    if p is None:
      continue
    row = big["rows"].get(v["name"])
    rows.append(
      [
        v["name"],
        *(str(p[k]) for k in ("fusion", "custom_fusions", "copy", "conditional", "in_branches")),
        fmt(p["temp_bytes"] / 2**20, ".0f"),
        fmt(p["temp_bytes"] / big["n"], ".1f"),
        fmt(None if row is None else row.fresh_bpp, ".1f"),
      ]
    )
  header = ["variant", "fusions", "kCustom", "copies", "conditionals", "in branches"]
  header += ["temp MiB", "temp B/param", "fresh B/param"]
  return [prose("profile", label=big["label"]), table(header, rows)]


def compile_table(opt: dict[str, Any]) -> list[str]:
  """Renders the compile time of every variant on the first size."""
  comp = opt.get("compile", {})
  if not comp:
    return []
  rows = [
    [v["name"], fmt(comp[v["name"]]["s"]), fmt(comp[v["name"]]["x_base"])]
    for v in opt["variants"]
    if v["name"] in comp
  ]
  label = opt["sizes"][0]["label"]
  text = prose("compile", label=label, leaves=opt["leaves"], repeats=opt["compile_repeats"])
  return [text, table(["variant", "seconds", "x optax adam"], rows)]


def _compared(ratio: float | None) -> str:
  if ratio is None or math.isnan(ratio):
    return "was not timed against"
  return "is faster than" if ratio < 1 else "is slower than" if ratio > 1 else "is as fast as"


def _more(row: StepRow, than: StepRow, key: str) -> bool:
  """Tells whether ``row`` has at least a byte per parameter more of ``key``."""
  a, b = getattr(row, key), getattr(than, key)
  return a is not None and b is not None and a >= b + 1


def storage_modes_section(sizes: Sizes, on_cpu: bool) -> list[str]:
  """Renders mpx bf16's storage modes against its full-master step, and what
  the largest size's HLO says about the difference."""
  modes = [name for name in MPX_MODES if any(name in s["rows"] for s in sizes)]
  if not modes:
    return []
  header = ["variant", "against"]
  for size in sizes:
    header += [f"{size['label']} x full", f"{size['label']} paired"]
  rows = [
    [
      name,
      MPX_BF16,
      *_per_size(sizes, name, lambda r: [fmt(r.x_full, ".3f"), fmt(r.x_full_paired, ".3f")], 2),
    ]
    for name in modes
  ]
  out = [prose("storage_modes") + "\n\n" + table(header, rows, "ll" + "r" * (len(header) - 2))]
  big = largest(sizes)
  r = big["rows"]
  full = r.get(MPX_BF16)
  present = [name for name in modes if name in r]
  if full is None or not present:
    return out
  said = [
    prose(
      "mode_measured",
      name=name,
      compared=_compared(r[name].x_full_paired),
      paired=fmt(r[name].x_full_paired, ".2f"),
      temp=fmt(r[name].temp_bpp, ".1f"),
      fresh=fmt(r[name].fresh_bpp, ".1f"),
    )
    for name in present
  ]
  text = prose(
    "modes_measured",
    label=big["label"],
    modes="; ".join(said),
    temp=fmt(full.temp_bpp, ".1f"),
    fresh=fmt(full.fresh_bpp, ".1f"),
  )
  more = [name for name in present if _more(r[name], full, "temp_bpp")]
  if more:
    text += " " + prose("modes_scratch", values="; ".join(_LEAVES_COND[name] for name in more))
    if on_cpu:
      text += prose("modes_scratch_cpu")
    fresh = [name for name in more if _more(r[name], full, "fresh_bpp")]
    if fresh:
      text += prose("modes_fresh", names=" and ".join(fresh), s="s" if len(fresh) == 1 else "")
    text += "."
  ratios = [r[name].x_full_paired for name in present]
  if all(x is not None and x > 1 for x in ratios):
    text += " " + prose("modes_not_faster")
  return [*out, text]


def allocator_label(allocator: dict[str, Any]) -> str:
  """Returns a malloc setting's name and what it sets, for tables."""
  settings = " ".join(f"`{k}={v}`" for k, v in allocator["env"].items())
  text = allocator["name"] + (f" ({settings})" if settings else "")
  if allocator.get("ld_preload"):
    text += f", LD_PRELOAD `{allocator['ld_preload']}`"
  return text


def allocator_section(results: dict[str, Any]) -> list[str]:
  """Renders the storage modes against full masters under each malloc setting."""
  allocators = results.get("allocators") or []
  if not allocators:
    return []
  labels: list[str] = []
  for allocator in allocators:
    labels += [s["label"] for s in allocator.get("sizes", []) if s["label"] not in labels]
  header = ["malloc", "variant"]
  for label in labels:
    header += [f"{label} paired", f"{label} fresh B/param"]
  rows, failed = [], []
  for allocator in allocators:
    if "error" in allocator:
      failed.append(f"- **{allocator_label(allocator)}**: failed, {allocator['error'][-300:]}")
      continue
    by_label = {size["label"]: size for size in allocator["sizes"]}
    for name in (MPX_BF16, *MPX_MODES):
      cells = []
      for label in labels:
        r = by_label.get(label, {}).get("rows", {}).get(name)
        if r is None:
          cells += ["n/a", "n/a"]
          continue
        paired = "1 (reference)" if name == MPX_BF16 else fmt(r.x_full_paired, ".3f")
        cells += [paired, fmt(r.fresh_bpp, ".1f")]
      rows.append([allocator["name"], name, *cells])
  settings = "; ".join(allocator_label(a) for a in allocators)
  out = [prose("allocators", settings=settings, malloc=results["machine"].get("malloc", "?"))]
  if rows:
    out.append(table(header, rows, "ll" + "r" * (len(header) - 2)))
  if failed:
    out.append("\n".join(failed))
  return out


def memory_section(results: dict[str, Any]) -> list[str]:
  """Renders state bytes per parameter: mpx's modes measured, the peers' by construction."""
  sizes = results["optimizer"]["sizes"]
  big = largest(sizes)
  names = (BASELINE, MPX_BF16, *MPX_MODES)
  rows = []
  for v in results["optimizer"]["variants"]:
    state = state_bpp(sizes, big, v["name"]) if v["name"] in names else None
    if state is None:
      continue
    param = PARAM_BYTES.get(v["param_dtype"], 0)
    source = f"measured in this run, at {big['label']}"
    rows.append([v["name"], str(param), fmt(state), fmt(param + state), source])
  for name, param, state, how in PEER_MEMORY:
    source = f"by construction, not measured: {how}"
    rows.append([name, str(param), str(state), str(param + state), source])
  header = ["optimizer", "param B", "state B", "param + state B", "source"]
  return [prose("memory") + "\n\n" + table(header, rows, "lrrrl")]


def optimizer_sections(results: dict[str, Any]) -> list[str]:
  """Renders section 1's tables after its variant list."""
  opt = results["optimizer"]
  sizes, variants = opt["sizes"], opt["variants"]
  big = largest(sizes)
  return [
    *time_tables(sizes, variants),
    *storage_modes_section(sizes, results["machine"]["device"].startswith("cpu")),
    *allocator_section(results),
    *xla_table(sizes, variants),
    *memory_section(results),
    *bandwidth_table(big, variants),
    *checks_table(big),
    *profile_table(big, variants),
    *compile_table(opt),
  ]
