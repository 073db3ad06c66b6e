"""Renders benchmark results as Markdown (docs/benchmarks.md) and a PNG figure."""

from __future__ import annotations

import math
import pathlib
from typing import Any

from benchmarks.optimizer_step import (
  BASELINE,
  HAND,
  HAND_BF16,
  HAND_COND,
  HAND_COND_BF16,
  MPX_BF16,
  MPX_REMAINDER,
  MPX_STOCHASTIC,
)

# The targets (issues 10 and 17). Speed and scratch hold at sizes of at least
# this many params and on the many-leaf tree; compile time on every
# compile-time tree.
TARGET_MIN_PARAMS = 8 * 2**20
# mpx step time over the check-then-apply step of its dtype (float32 masters,
# the step inside lax.cond(mpx.all_finite(grads))), paired.
TARGET_VS_COND = 1.0
TARGET_SCRATCH_BPP = 0.1  # memory_analysis().temp_size_in_bytes per param
# trace + lower + compile over the check-then-apply step's, in the same round.
TARGET_COMPILE_VS_COND = 1.3
# The storage modes' target: no slower than the full-master step, paired, at
# the transformer-shaped sizes of at least TARGET_MIN_PARAMS (16M and 64M).
TARGET_VS_FULL = 1.0
# The remainder mode's with glibc malloc told to keep large blocks (the
# allocator runs, run.NO_MMAP_MALLOC), at the same sizes.
TARGET_REMAINDER_NO_MMAP = 1.2
MPX_FP16 = "mpx fp16"
# Each mpx step and the check-then-apply step it is held against.
MPX_REFERENCES = ((MPX_BF16, HAND_COND_BF16), (MPX_FP16, HAND_COND))
MPX_MODES = (MPX_REMAINDER, MPX_STOCHASTIC)
_BF16 = (MPX_BF16, *MPX_MODES)  # mpx bf16 in each storage mode
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
_PARAM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Lets Sphinx build docs/ with -W while no toctree lists the page yet.
FRONT_MATTER = "---\norphan: true\n---\n\n"


def size_label(n: int) -> str:
  for unit, div in (("M", 2**20), ("K", 2**10)):
    if n >= div:
      value = n / div
      return f"{value:.0f}{unit}" if abs(value - round(value)) < 0.05 else f"{value:.1f}{unit}"
  return str(n)


def _f(x: Any, fmt: str = ".2f", none: str = "-") -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return none
  return format(x, fmt)


def _syncs(row: dict[str, Any]) -> str:
  value = row.get("host_syncs")
  if value == 0:
    return "0"
  return "n/a" if value is None else f"**refused**: {value}"


def _compiles(row: dict[str, Any]) -> str:
  compiles, traces = row.get("compiles"), row.get("traces")
  if compiles is None:
    return "-"
  text = str(compiles) if compiles == traces else f"{compiles} ({traces} traces)"
  return text if compiles == 1 else f"**{text}**"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
  align = align or "l" + "r" * (len(header) - 1)
  marks = [":--" if a == "l" else "--:" for a in align]
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def _verdict(value: float | None, limit: float, over: str) -> str:
  """ "met", or "missed" and by how much (``over`` formats the excess)."""
  if value is None or math.isnan(value):
    return "not measured"
  if value <= limit:
    return "met"
  return f"**missed** by {over.format(value / limit - 1, value - limit)}"


def _is_target_size(size: dict[str, Any]) -> bool:
  return size.get("targets", size["n"] >= TARGET_MIN_PARAMS)


def _paired_target(
  label: str, row: dict | None, name: str, against: str, key: str, target: float
) -> list[list[str]]:
  """The targets table's row for one paired ratio, or none if not measured."""
  if row is None:
    return []
  value = row.get(key)
  return [
    [
      label,
      f"{name} <= {target:.2f}x {against}, paired",
      _f(value, ".3f") + "x",
      _verdict(value, target, "{0:.1%}"),
    ]
  ]


def targets(results: dict[str, Any]) -> list[list[str]]:
  """One row per target and size: what was asked, what was measured, verdict."""
  rows = []
  for size in results["optimizer"]["sizes"]:
    if not _is_target_size(size):
      continue
    r, label = size["rows"], size["label"]
    for name, reference in MPX_REFERENCES:
      against = f"{reference} (check-then-apply)"
      rows += _paired_target(label, r.get(name), name, against, "x_cond_paired", TARGET_VS_COND)
    if not size.get("many_leaves"):
      against = f"{MPX_BF16} (full masters)"
      for name in MPX_MODES:
        rows += _paired_target(label, r.get(name), name, against, "x_full_paired", TARGET_VS_FULL)
    for name, _ in MPX_REFERENCES:
      row = r.get(name)
      if row is None or row.get("temp_bpp") is None:
        continue
      rows.append(
        [
          label,
          f"{name} scratch <= {TARGET_SCRATCH_BPP} B/param",
          f"{row['temp_bpp']:.2f} B/param",
          _verdict(row["temp_bpp"], TARGET_SCRATCH_BPP, "{1:.2f} B/param"),
        ]
      )
    fp16 = r.get(MPX_FP16)
    peers = {k: v for k, v in r.items() if v.get("kind") == "peer"}
    if fp16 is not None and peers:
      slower = [
        f"{k} ({fp16['ms'] / v['ms']:.2f}x)" for k, v in peers.items() if fp16["ms"] >= v["ms"]
      ]
      best = min(peers, key=lambda k: peers[k]["ms"])
      rows.append(
        [
          label,
          "mpx fp16 faster than every peer's fp16 path",
          f"{fp16['ms'] / peers[best]['ms']:.2f}x the fastest peer ({best})",
          "met" if not slower else "**missed**: slower than " + ", ".join(slower),
        ]
      )
  for allocator in results.get("allocators", []):
    if allocator["env"]:  # the target is for the setting, not glibc's defaults
      rows += _allocator_targets(allocator)
  compile_time = results.get("compile_time") or {}
  for tree in compile_time.get("trees", []):
    for name, reference in _compile_targets(compile_time):
      row, base = tree["rows"].get(name), tree["rows"].get(reference)
      if row is None or base is None or row.get("x_cond") is None:
        continue
      rows.append(
        [
          f"compile, {_tree_label(tree)}",
          f"{name} compile <= {TARGET_COMPILE_VS_COND:.1f}x {reference} (check-then-apply)",
          f"{row['x_cond']:.2f}x ({row['total_s']:.1f} s vs {base['total_s']:.1f} s)",
          _verdict(row["x_cond"], TARGET_COMPILE_VS_COND, "{0:.1%}"),
        ]
      )
  return rows


def _compile_targets(compile_time: dict[str, Any]) -> list[tuple[str, str]]:
  """(variant, its check-then-apply step) for each targeted compile-time row."""
  targeted = compile_time.get("targeted", {})
  if isinstance(targeted, list):  # results written before the check-then-apply baseline
    return []
  return list(targeted.items())


def allocator_label(allocator: dict[str, Any]) -> str:
  """A setting's name and what it sets, for tables."""
  settings = " ".join(f"`{k}={v}`" for k, v in allocator["env"].items())
  text = allocator["name"] + (f" ({settings})" if settings else "")
  if allocator.get("ld_preload"):
    text += f", LD_PRELOAD `{allocator['ld_preload']}`"
  return text


def _allocator_targets(allocator: dict[str, Any]) -> list[list[str]]:
  rows = []
  for size in allocator.get("sizes", []):
    if not _is_target_size(size):
      continue
    rows += _paired_target(
      f"{size['label']}, malloc: {allocator['name']}",
      size["rows"].get(MPX_REMAINDER),
      MPX_REMAINDER,
      f"{MPX_BF16} (full masters)",
      "x_full_paired",
      TARGET_REMAINDER_NO_MMAP,
    )
  return rows


def _tree_label(tree: dict[str, Any]) -> str:
  """ "1000 leaves", or "1M tree (26 leaves)" for the transformer-shaped one."""
  if tree["label"].endswith("leaves"):
    return tree["label"]
  return f"{tree['label']} tree ({tree['leaves']} leaves)"


def _largest(sizes: list[dict[str, Any]]) -> dict[str, Any]:
  """The largest transformer-shaped size (the detailed tables are of it)."""
  shaped = [s for s in sizes if not s.get("many_leaves")] or sizes
  return max(shaped, key=lambda s: s["n"])


def optimizer_sections(results: dict[str, Any]) -> list[str]:
  opt = results["optimizer"]
  sizes = opt["sizes"]
  variants = opt["variants"]
  out = []

  # Time table: ms and the ratio to plain FP32 Adam per size.
  header = ["variant", "params"]
  for size in sizes:
    header += [f"{size['label']} ms", f"{size['label']} x fp32"]
  rows = []
  for v in variants:
    row = [v["name"], v["param_dtype"]]
    for size in sizes:
      r = size["rows"].get(v["name"])
      if r is None:
        row += ["n/a", "n/a"]
        continue
      row += [_f(r["ms"], ".1f" if r["ms"] >= 10 else ".2f"), _f(r["x_base"])]
    rows.append(row)
  out.append(
    "*ms*: median milliseconds per step. *x fp32*: median over rounds of the "
    "variant's time over that of plain FP32 Adam timed just before and after it (the "
    "two medians need not agree exactly on a busy machine). "
    + ", ".join(
      f"{s['label']}: {s['rounds']} rounds of {s['steps_per_round']} steps" for s in sizes
    )
    + "."
  )
  out.append(table(header, rows, "ll" + "r" * (len(header) - 2)))
  missing = {}
  for size in sizes:
    missing.update(size.get("unavailable", {}))
  if missing:
    out.append("\n".join(f"- n/a: **{k}**: {why}" for k, why in missing.items()))
  skipped = sorted({name for size in sizes for name in size.get("skipped_peers", [])})
  if skipped:
    many = [s["label"] for s in sizes if s.get("many_leaves")]
    out.append(
      f"On the {', '.join(many)} tree the peers ({', '.join(skipped)}) are left out: "
      "compiling them on hundreds of leaves would add minutes to the run, and their "
      "steps a third to every round."
    )

  # Against the hand-written steps of the same dtype.
  header = ["variant", "against"]
  for size in sizes:
    header += [f"{size['label']} x hand", f"{size['label']} x cond", f"{size['label']} paired"]
  rows = []
  for v in variants:
    cells, reference, cond = [], None, None
    for size in sizes:
      r = size["rows"].get(v["name"])
      reference = reference or (r or {}).get("reference")
      cond = cond or (r or {}).get("check_then_apply")
      if r is None:
        cells += ["n/a", "n/a", "n/a"]
        continue
      cells += [
        _f(r.get("x_hand"), ".3f"),
        _f(r.get("x_cond"), ".3f"),
        _f(r.get("x_cond_paired"), ".3f"),
      ]
    if reference not in (None, v["name"]):
      against = reference + (f"; {cond}" if cond else "")
      rows.append([v["name"], against, *cells])
  if rows:
    out.append(
      "Against the hand-written steps of the variant's own dtype: *x hand*, the one "
      "without safety (no check, no scaling), and *x cond*, the check-then-apply step "
      "(float32 masters, the step inside `lax.cond(mpx.all_finite(grads))`: *hand + "
      "cond*, *hand bf16 + cond*), the baseline of the mpx steps' speed and compile-time "
      "targets. Each is the median over rounds of the variant's ratio to FP32 Adam over "
      "the hand step's ratio to FP32 Adam in the same round. *paired*: for mpx bf16 and "
      "fp16, timed in every round between two windows of the check-then-apply step of "
      "their dtype, the median over rounds of the variant's time over the mean of those "
      "two windows."
    )
    out.append(table(header, rows, "ll" + "r" * (len(header) - 2)))
  out += storage_modes_section(sizes, results["machine"]["device"].startswith("cpu"))
  out += allocator_section(results)

  # XLA's own view of every variant, at every size.
  big = _largest(sizes)
  header = ["variant", "min B/param", "state B/param"]
  for size in sizes:
    header += [f"{size['label']} XLA B/param", f"{size['label']} temp B/param"]
  rows = []
  for v in variants:
    row = [v["name"], str(v["min_bytes"]), _f(_state_bpp(sizes, big, v["name"]))]
    for size in sizes:
      r = size["rows"].get(v["name"])
      if r is None:
        row += ["n/a", "n/a"]
        continue
      row += [_f(r.get("accessed_bpp"), ".1f"), _f(r.get("temp_bpp"), ".2f")]
    rows.append(row)
  out.append(
    "### What XLA compiled, per parameter\n\n"
    '*XLA B/param*: `compiled.cost_analysis()["bytes accessed"]` over the parameter '
    "count: the bytes XLA's cost model counts its kernels reading and writing, as the "
    "compiled HLO stands, next to *min B/param*, the least the variant must move "
    "(28 for plain FP32 Adam and a step without a check, 30 for a checked one: float32 "
    "masters and moments read and written once, 16-bit params written, the 16-bit "
    "gradients read once more for the finite verdict; 28 with remainder masters, whose "
    "bf16 param and int16 remainder are read and written in place of the float32 "
    "master, and 24 with stochastic rounding, which keeps no master and reads and "
    "writes the bf16 param). A device-independent view of fusion quality: every "
    "intermediate a fusion writes and the next reads back counts twice. *state "
    "B/param*: the optimizer state's bytes over the parameter count (masters or their "
    "remainders, moments, counters, loss scale, random-bit keys; not the params), at "
    f"{big['label']}. *temp "
    "B/param*: `memory_analysis().temp_size_in_bytes` over the parameter count, the "
    "scratch the step allocates beyond its donated buffers."
  )
  out.append(table(header, rows, "lrr" + "r" * (len(header) - 3)))
  out += memory_section(results)

  # Bandwidth table at the largest size.
  roof = big["roofline"]
  rows = []
  for v in variants:
    r = big["rows"].get(v["name"])
    if r is None:
      continue
    rows.append(
      [
        v["name"],
        str(v["min_bytes"]),
        _f(r["state_bpp"]),
        _f(r["gbps"], ".1f"),
        _f(r["roof_pct"], ".0f") + "%",
        _f(r["floor_x"]),
        _syncs(r),
        _compiles(r),
      ]
    )
  out.append(
    f"Bytes and bandwidth at {big['label']} ({big['n']:,} params). Roofline: "
    f"in-place copy `x+1` {roof['copy']:.1f} GB/s, axpy `y+a*x` {roof['axpy']:.1f} GB/s, "
    f"measured in the same rounds; the better of the two, {roof['best']:.1f} GB/s, is the "
    "roofline. *min B/param*: bytes the variant must read and write per parameter at "
    "minimum; *state B/param*: optimizer-side state (masters, moments, counters, loss "
    "scale; not the params); *GB/s*: min B/param x params / median time; *x floor*: "
    "the variant's time over the time the roofline probe would need for min B/param "
    "(median over rounds, each against the probe's adjacent-baseline ratio); *of "
    "roofline*: its inverse."
  )
  out.append(
    table(
      [
        "variant",
        "min B/param",
        "state B/param",
        "GB/s",
        "of roofline",
        "x floor",
        "host syncs",
        "compiles",
      ],
      rows,
    )
  )

  # The finite check alone.
  checks = {k: v for k, v in big.get("probes", {}).items() if v["group"] == "check"}
  if checks:
    rows = [
      [
        name,
        str(c["bytes_per_param"]),
        _f(c["ms"], ".1f" if c["ms"] >= 10 else ".2f"),
        _f(c["gbps"], ".1f"),
        _f(c["x_copy"]),
        _f(c["profile"]["temp_bytes"] / big["n"], ".1f"),
        str(c["profile"]["custom_fusions"]),
      ]
      for name, c in checks.items()
    ]
    out.append(
      f"### The finite check alone, at {big['label']}\n\n"
      "Each check reduces the fp16 gradients to one flag (a donated scalar); the "
      "reference adds 1 to every fp16 gradient in place (reads and writes 2 bytes per "
      "parameter). *temp B/param*: scratch XLA allocates per parameter; *kCustom*: "
      "fusions XLA:CPU hands to a library kernel (YNNPACK)."
    )
    out.append(
      table(
        ["check", "min B/param", "ms", "GB/s", "x reference", "temp B/param", "kCustom"],
        rows,
      )
    )

  # HLO profile.
  profile = big.get("profile", {})
  if profile:
    rows = []
    for v in variants:
      p = profile.get(v["name"])
      if p is None:
        continue
      rows.append(
        [
          v["name"],
          str(p["fusion"]),
          str(p["custom_fusions"]),
          str(p["copy"]),
          str(p["conditional"]),
          str(p["in_branches"]),
          _f(p["temp_bytes"] / 2**20, ".0f"),
          _f(p["temp_bytes"] / big["n"], ".1f"),
          _f(big["rows"].get(v["name"], {}).get("fresh_bpp"), ".1f"),
        ]
      )
    out.append(
      f"### Profile: the compiled step at {big['label']}\n\n"
      "Counted in `compiled.as_text()` outside fused computations: *fusions* are the "
      "kernels XLA runs, *kCustom* those of them handed to a library (YNNPACK "
      "reductions); *copies* are standalone `copy` instructions, each of a whole "
      "buffer (a state leaf, or a scalar counter); *conditionals* are `lax.cond`s; "
      "*in branches* counts the "
      "instructions inside conditional branches; *temp* is "
      "`memory_analysis().temp_size_in_bytes`, scratch beyond the donated buffers; "
      "*fresh B/param* is memory touched for the first time per step (minor page "
      "faults while the step ran, times the page size): XLA:CPU maps its scratch "
      "afresh on every call, and the kernel zeroes each new page, so scratch costs "
      "far more than the bytes it holds."
    )
    out.append(
      table(
        [
          "variant",
          "fusions",
          "kCustom",
          "copies",
          "conditionals",
          "in branches",
          "temp MiB",
          "temp B/param",
          "fresh B/param",
        ],
        rows,
      )
    )

  # Compile time.
  comp = opt.get("compile", {})
  if comp:
    rows = [
      [v["name"], _f(comp[v["name"]]["s"]), _f(comp[v["name"]]["x_base"])]
      for v in variants
      if v["name"] in comp
    ]
    out.append(
      f"### Compile time of every variant\n\nTrace + lower + compile of the step on the "
      f"{sizes[0]['label']} tree ({opt['leaves']} leaves), median of "
      f"{opt['compile_repeats']} fresh compilations each (the first is the first call, "
      "one step included), interleaved; *x optax adam*: median over median. Against "
      "the number of leaves: section 2."
    )
    out.append(table(["variant", "seconds", "x optax adam"], rows))
  return out


def _state_bpp(sizes: list[dict[str, Any]], big: dict[str, Any], name: str) -> float | None:
  """A variant's optimizer-state bytes per parameter at the largest size where
  it ran (counters and keys weigh less the more params there are)."""
  for size in [big, *sorted(sizes, key=lambda s: -s["n"])]:
    row = size["rows"].get(name)
    if row is not None:
      return row.get("state_bpp")
  return None


_LEAVES_COND = {
  MPX_REMAINDER: "remainder mode's new float32 master, split into param and remainder after it",
  MPX_STOCHASTIC: "stochastic mode's new bf16 param, rounded inside it",
}


def _compared(ratio: float | None) -> str:
  if ratio is None or math.isnan(ratio):
    return "was not timed against"
  return "is faster than" if ratio < 1 else "is slower than" if ratio > 1 else "is as fast as"


def _more(row: dict[str, Any], than: dict[str, Any], key: str) -> bool:
  """Whether ``row`` has at least a byte per parameter more of ``key``."""
  a, b = row.get(key), than.get(key)
  return a is not None and b is not None and a >= b + 1


def storage_modes_section(sizes: list[dict[str, Any]], on_cpu: bool) -> list[str]:
  """mpx bf16's remainder and stochastic modes against its full-master step,
  and, at the largest size, what its HLO says about the difference."""
  modes = [name for name in MPX_MODES if any(name in s["rows"] for s in sizes)]
  if not modes:
    return []
  header = ["variant", "against"]
  for size in sizes:
    header += [f"{size['label']} x full", f"{size['label']} paired"]
  rows = []
  for name in modes:
    cells = []
    for size in sizes:
      r = size["rows"].get(name)
      if r is None:
        cells += ["n/a", "n/a"]
        continue
      cells += [_f(r.get("x_full"), ".3f"), _f(r.get("x_full_paired"), ".3f")]
    rows.append([name, MPX_BF16, *cells])
  out = [
    "### The storage modes of the masters, against full masters\n\n"
    'mpx bf16 with `masters="remainder"` (an int16 remainder completes each bf16 param '
    'to its float32 master: bitwise the same trajectory) and `masters="stochastic"` (no '
    "master: the param is updated in float32 and rounded at random), against mpx bf16 "
    "with full float32 masters. *x full*: the median over rounds of the variant's ratio "
    "to FP32 Adam over mpx bf16's in the same round; *paired*: timed in every round "
    "between two windows of mpx bf16, the median over rounds of the variant's time over "
    "the mean of those two windows (the target: at most 1.00x at 16M and 64M).",
    table(header, rows, "ll" + "r" * (len(header) - 2)),
  ]
  big = _largest(sizes)
  r = big["rows"]
  full = r.get(MPX_BF16)
  if full is None:
    return out
  said = []
  for name in modes:
    row = r.get(name)
    if row is None:
      continue
    paired = row.get("x_full_paired")
    said.append(
      f"{name} {_compared(paired)} the full-master step ({_f(paired, '.2f')}x, paired), with "
      f"{_f(row.get('temp_bpp'), '.1f')} bytes of scratch per parameter and "
      f"{_f(row.get('fresh_bpp'), '.1f')} fresh bytes touched per parameter per step"
    )
  if not said:
    return out
  text = (
    f"At {big['label']}, measured in this run: "
    + "; ".join(said)
    + f"; the full-master step has {_f(full.get('temp_bpp'), '.1f')} bytes of scratch and "
    f"{_f(full.get('fresh_bpp'), '.1f')} fresh bytes per parameter."
  )
  more = [name for name in modes if name in r and _more(r[name], full, "temp_bpp")]
  if more:
    text += (
      " The extra scratch is the value that leaves the skip `lax.cond` ("
      + "; ".join(_LEAVES_COND[name] for name in more)
      + ")"
    )
    if on_cpu:
      text += (
        ": XLA:CPU has no multi-output fusion, so that value gets a buffer of its "
        "own instead of being written into a donated one, where the full mode "
        "updates its master in place"
      )
    fresh = [name for name in more if _more(r[name], full, "fresh_bpp")]
    if fresh:
      text += (
        f"; {' and '.join(fresh)} map{'s' if len(fresh) == 1 else ''} it afresh on "
        "every step (the fresh bytes above: pages the kernel zeroes)"
      )
    text += "."
  ratios = [r[name].get("x_full_paired") for name in modes if name in r]
  if ratios and all(x is not None and x > 1 for x in ratios):
    text += " In this run, fewer bytes of state did not make the step faster."
  out.append(text)
  return out


def allocator_section(results: dict[str, Any]) -> list[str]:
  """The storage modes against full masters, from the processes started with
  each malloc setting."""
  allocators = results.get("allocators") or []
  if not allocators:
    return []
  labels = []
  for allocator in allocators:
    for size in allocator.get("sizes", []):
      if size["label"] not in labels:
        labels.append(size["label"])
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
        paired = "1 (reference)" if name == MPX_BF16 else _f(r.get("x_full_paired"), ".3f")
        cells += [paired, _f(r.get("fresh_bpp"), ".1f")]
      rows.append([allocator["name"], name, *cells])
  out = [
    "### The storage modes under two malloc settings\n\n"
    "The same comparison, each setting in a process of its own (glibc reads them when a "
    "process starts), timing FP32 Adam, mpx bf16 and its two other storage modes only: "
    "*paired* as above, the mode's time over mpx bf16's (full masters) in the windows "
    "just before and after it; *fresh B/param*: memory touched for the first time per "
    "step (minor page faults times the page size). With glibc's defaults a block above "
    "the mmap threshold is mapped for each allocation and unmapped when freed, so a "
    "scratch buffer XLA:CPU allocates on every call is faulted in afresh on every step. "
    "The second setting keeps such blocks in the heap, and puts every thread on the "
    "main heap: XLA runs steps on threads of its own, whose arenas are heaps of at most "
    "64 MiB that map any larger block whatever the threshold. GPU and TPU runtimes "
    "pool device memory themselves. The settings: "
    + "; ".join(allocator_label(a) for a in allocators)
    + f". The other sections' process ran with: {results['machine'].get('malloc', '?')}.",
  ]
  if rows:
    out.append(table(header, rows, "ll" + "r" * (len(header) - 2)))
  if failed:
    out.append("\n".join(failed))
  return out


def memory_section(results: dict[str, Any]) -> list[str]:
  """Optimizer-state bytes per parameter: mpx's modes measured, peers' by construction."""
  sizes = results["optimizer"]["sizes"]
  big = _largest(sizes)
  measured = [v for v in results["optimizer"]["variants"] if v["name"] in (BASELINE, *_BF16)]
  rows = []
  for v in measured:
    state = _state_bpp(sizes, big, v["name"])
    if state is None:
      continue
    param = _PARAM_BYTES.get(v["param_dtype"], 0)
    rows.append(
      [
        v["name"],
        str(param),
        _f(state),
        _f(param + state),
        f"measured in this run, at {big['label']}",
      ]
    )
  for name, param, state, how in PEER_MEMORY:
    rows.append(
      [name, str(param), str(state), str(param + state), f"by construction, not measured: {how}"]
    )
  return [
    "### Memory: bytes per parameter, Adam(W) on 16-bit params\n\n"
    "*state*: optimizer state (masters or what stands for them, Adam's moments; "
    "AdamW's state is the same); *param*: the trained parameter itself. The mpx rows "
    "and plain FP32 Adam are measured (the bytes of the state's leaves over the "
    "parameter count: a few counters and keys make the difference to a whole number); "
    "the others are what each method keeps per parameter with float32 moments, by "
    "construction, not measured here. Gradients and activations are not counted.",
    table(["optimizer", "param B", "state B", "param + state B", "source"], rows, "lrrrl"),
  ]


_SPLIT_HEADER = [
  "tree",
  "variant",
  "trace s",
  "lower s",
  "compile s",
  "total s",
  "ms/leaf",
  "x adam",
  "x cond",
]


def compile_time_section(compile_time: dict[str, Any]) -> list[str]:
  """Compile time against leaf count: a summary table and the split."""
  trees = compile_time.get("trees", [])
  if not trees:
    return []
  names = [v["name"] for v in compile_time["variants"]]
  side = compile_time["leaf_side"]
  shaped = [t["label"] for t in trees if not t["label"].endswith("leaves")]
  also = f" and on the {shaped[0]} transformer-shaped tree" if shaped else ""
  out = [
    f"Trace + lower + compile of one optimizer step (update and `optax.apply_updates` "
    f"in one jitted function, state donated, as in section 1) on trees of small "
    f"{side}x{side} leaves{also}. Each "
    "measurement jits a freshly wrapped function, so no jax cache answers; in each of "
    f"{compile_time['rounds']} rounds the variants compile in a freshly shuffled order. "
    "*s*: median seconds; *x adam*: median over rounds of the total over plain optax "
    "Adam's in the same round; *x cond*: the same over the check-then-apply step of the "
    "variant's dtype (float32 masters, the step inside `lax.cond(mpx.all_finite(grads))`; "
    "the one section 1 times), the baseline of the compile-time target. Each variant is "
    "built afresh for every measurement, so nothing cached on the transformation (its "
    "`init` traced by `jax.eval_shape`, say) answers: every figure is a first compile.",
    table(
      ["variant", "what it compiles"],
      [[v["name"], v["what"]] for v in compile_time["variants"]],
      "ll",
    ),
  ]
  header = ["variant"]
  for tree in trees:
    label = _tree_label(tree)
    header += [f"{label} s", f"{label} x adam", f"{label} x cond"]
  rows = []
  for name in names:
    row = [name]
    for tree in trees:
      r = tree["rows"].get(name)
      row += ["n/a"] * 3 if r is None else [_f(r["total_s"]), _f(r["x_adam"]), _f(r.get("x_cond"))]
    rows.append(row)
  out.append(table(header, rows))
  rows = []
  for tree in trees:
    for name in names:
      r = tree["rows"].get(name)
      if r is None:
        continue
      rows.append(
        [
          _tree_label(tree),
          name,
          _f(r["trace_s"]),
          _f(r["lower_s"]),
          _f(r["compile_s"]),
          _f(r["total_s"]),
          _f(r["ms_per_leaf"], ".1f"),
          _f(r["x_adam"]),
          _f(r.get("x_cond")),
        ]
      )
  out.append(
    "The split (medians of each part, so they need not add up to the total); *ms/leaf*: "
    "the total over the leaf count, flat when compile time is linear in leaves."
  )
  out.append(
    table(
      _SPLIT_HEADER,
      rows,
      "ll" + "r" * 7,
    )
  )
  return out


def train_section(results: dict[str, Any]) -> list[str]:
  train = results.get("train")
  if not train:
    return []
  m = train["model"]
  rows = []
  for mode, r in train["rows"].items():
    rows.append(
      [
        mode,
        r["param_dtype"],
        _f(r["ms"], ".1f"),
        _f(r["x_base"]),
        _f(r["state_bpp"]),
        _f(r["peak_bytes"] / 2**20, ".1f"),
        _f(r["compile_s"]),
        _f(r["compile_x"]),
        _syncs(r),
        _compiles(r),
        "-" if r["skipped"] is None else str(r["skipped"]),
      ]
    )
  intro = (
    f"{train['rounds']} rounds of {train['steps_per_round']} steps. "
    f"The demo transformer (`benchmarks/model.py`): {m['params']:,} params, width "
    f"{m['width']}, {m['depth']} blocks, {m['heads']} heads, vocabulary {m['vocab']}, "
    f"batch {m['batch']} x {m['seq']} tokens; AdamW; forward, backward, update and "
    "apply in one jitted step with params and state donated. *opt state B/param*: "
    "optimizer-state bytes per parameter; *peak*: "
    f"{train['peak_source']} (arguments + non-aliased outputs + temporaries); "
    "*skipped*: non-finite steps skipped during the timed steps (the one forced skip "
    "that checks the compile count is not included)."
  )
  return [
    intro,
    table(
      [
        "mode",
        "params",
        "ms/step",
        "x fp32",
        "opt state B/param",
        "peak MiB",
        "compile s",
        "compile x fp32",
        "host syncs",
        "compiles",
        "skipped",
      ],
      rows,
      "ll" + "r" * 9,
    ),
  ]


def _temp(profile: dict[str, Any], name: str) -> int:
  return profile.get(name, {}).get("temp_bytes", 0)


def explanation(results: dict[str, Any]) -> str:
  """Where the cost of safety comes from, decomposed with this run's numbers."""
  big = _largest(results["optimizer"]["sizes"])
  r = big["rows"]
  needed = (
    BASELINE,
    HAND,
    "hand + cond (flag given)",
    "hand + check",
    "hand + cond",
    "hand + select",
    MPX_FP16,
  )
  if any(name not in r for name in needed):
    return "Not computed: this run left out some of " + ", ".join(needed) + "."

  def ms(name: str) -> float:
    return r[name]["ms"]

  def x(name: str) -> float:
    return r[name]["x_hand"]

  def part(delta: float) -> str:
    """A difference of paired ratios to the hand step, in its ms and percent."""
    change = delta * ms(HAND)
    return f"{change:+.{0 if abs(change) >= 10 else 1}f} ms ({100 * delta:+.0f}% of the hand step)"

  profile = big.get("profile", {})
  checks = big.get("probes", {})

  def copies(name: str) -> str:
    return str(profile.get(name, {}).get("copy", "?"))

  def scratch(name: str) -> str:
    temp = profile.get(name, {}).get("temp_bytes")
    return "?" if temp is None else f"{temp / big['n']:.1f}"

  check_mpx = checks.get("mpx.all_finite (this checkout)")
  check_sum = checks.get("isfinite(sum(x*0)) per leaf")
  check_leaf = checks.get("all(isfinite(x)) per leaf (jmp, optax)")
  copy = checks.get("fp16 grads x+1 (reference)")
  lines = [
    f"Decomposed at {big['label']}, from the *x hand* ratios, against the hand-written "
    f"fp16 step without safety ({ms(HAND):.1f} ms, {r[HAND]['x_base']:.2f}x plain FP32 "
    f"Adam's {ms(BASELINE):.1f} ms):",
    "",
    f"- `lax.cond` itself, on a flag passed in (*hand + cond (flag given)*): "
    f"{part(x('hand + cond (flag given)') - 1)};",
    f"- computing mpx's finite check and ignoring it (*hand + check*): "
    f"{part(x('hand + check') - 1)};",
    f"- acting on it with `lax.cond` (*hand + cond* minus *hand + check*): "
    f"{part(x('hand + cond') - x('hand + check'))};",
    f"- acting on it with a `jnp.where` select over the donated state instead "
    f"(*hand + select* minus *hand + check*): "
    f"{part(x('hand + select') - x('hand + check'))}, with "
    f"{copies('hand + select')} copies in its HLO;",
    f"- mpx fp16 over *hand + cond*: {part(x(MPX_FP16) - x('hand + cond'))}, with "
    f"{copies(MPX_FP16)} copies and {scratch(MPX_FP16)} bytes of scratch per parameter "
    f"in its HLO, against {copies('hand + cond')} and {scratch('hand + cond')}"
    + (
      ": its conditional returns float32 updates, which `optax.apply_updates` reads "
      "back outside it, where the hand step applies them inside the same branch."
      if _temp(profile, MPX_FP16) >= 4 * big["n"] > _temp(profile, "hand + cond")
      else ": the same structure (a cond over the state, updates derived after it "
      "from the new masters and fused into `optax.apply_updates`), plus the "
      "unscaling, the saturating rounding and the loss-scale update."
    ),
  ]
  bf16 = r.get(MPX_BF16)
  if bf16 is not None and HAND_BF16 in r:
    lines.append(
      f"- mpx bf16 over the hand-written bf16 step ({ms(HAND_BF16):.1f} ms): "
      f"{_f(bf16.get('x_hand'), '.3f')}x, and over its check-then-apply step "
      f"(*{HAND_COND_BF16}*), timed next to it: {_f(bf16.get('x_cond_paired'), '.3f')}x, "
      f"with {copies(MPX_BF16)} copies and {scratch(MPX_BF16)} bytes of scratch per "
      f"parameter in its HLO, against {copies(HAND_BF16)} and {scratch(HAND_BF16)}."
    )
  fresh = {name: row.get("fresh_bpp") for name, row in r.items()}
  if fresh.get("hand + select") is not None and fresh.get(MPX_FP16) is not None:
    lines.append(
      f"- scratch is dear on XLA:CPU: it maps a step's scratch afresh on every call "
      f"and the kernel zeroes each new page. *hand + select* touches "
      f"{fresh['hand + select']:.1f} fresh bytes per parameter per step (its copies of "
      f"the state), mpx fp16 {fresh[MPX_FP16]:.1f}, the hand step "
      f"{fresh.get(HAND) or 0:.1f}."
    )
  if check_mpx and check_sum and check_leaf and copy:

    def check(c: dict[str, Any]) -> str:
      p = c["profile"]
      return (
        f"{c['ms']:.1f} ms, {c['x_copy']:.1f}x the reference, with "
        f"{p['temp_bytes'] / big['n']:.0f} bytes of scratch per parameter and "
        f"{p['custom_fusions']} kCustom reductions"
      )

    lines += [
      "",
      "The checks alone, on the fp16 gradients, against reading and writing them once "
      f"({copy['ms']:.1f} ms): mpx's own `mpx.all_finite` takes {check(check_mpx)}; "
      f"`isfinite(sum(x*0))` per leaf takes {check(check_sum)}; `all(isfinite(x))` per "
      f"leaf, as jmp and optax check, takes {check(check_leaf)}. Scratch bytes mean "
      "XLA:CPU stores an intermediate (the float32 product `x*0`, or a predicate per "
      "element) instead of fusing it into the reduction.",
    ]
  lines += [
    "",
    "The floor: a checked step must read the 16-bit gradients once before it writes "
    "anything, 30 bytes per parameter against plain FP32 Adam's 28, so about 1.07x on "
    "a bandwidth-bound machine.",
  ]
  return "\n".join(lines)


METHOD = """\
- Each benchmark keeps all its variants alive, warms each up (compilation and two
  steps), then runs them in a freshly shuffled order in every round, each between
  two windows of the baseline (plain FP32 Adam; the FP32 training step); a window
  times a few consecutive steps (dispatch is asynchronous, so this is steady-state
  throughput), enough for the baseline's to last about 0.1 s. Reported: the median
  over rounds of the time per step, and the median over rounds of the ratio to the
  mean of the two adjacent baseline windows, so that the machine's slow phases
  cancel out of the ratios.
- mpx bf16 and fp16 are paired with the check-then-apply step of their own dtype
  (the hand-written step with float32 masters inside
  `lax.cond(mpx.all_finite(grads))`): in every round they run as baseline, hand
  step, mpx step, hand step, baseline, and their *paired* ratio for the round is
  `t_mpx / ((t_hand_before + t_hand_after) / 2)` (seconds per step of each
  window); reported is the median over rounds. The hand step's extra windows
  count nowhere else. mpx bf16 with remainder masters and with stochastic
  rounding are paired the same way with mpx bf16 (full float32 masters) instead.
- The storage modes are also timed in two more processes, one with glibc
  malloc's defaults and one told to keep large blocks (`MALLOC_MMAP_THRESHOLD_`,
  `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`, and `MALLOC_ARENA_MAX=1`, read
  when a process starts): XLA:CPU allocates some steps' scratch afresh on every
  call, and with the defaults a block that large is mapped and unmapped each
  time, so the step pays page faults on it.
- Params, masters and optimizer state are donated (`donate_argnums=0`); gradients
  are fixed, finite arrays (fp16 ones made with a loss scale of 2**15).
- Host syncs: after warm-up, steps run under `jax.transfer_guard("disallow")`;
  any host-device transfer raises and is reported. Compiles: XLA backend
  compilations counted by a `jax.monitoring` listener while the variant's steps
  run, over the whole run, which ends with one non-finite step (an inf in one
  gradient leaf) for every variant that skips, so finite and skipped steps must
  share one executable. A Python counter in the traced function counts traces;
  a cell shows both when they differ.
- The peers do the same fp16 job with their own tools: float32 masters (their
  float32 params), fp16 params for the forward pass (their cast for compute, in
  the same jitted step, so XLA may fuse it), Adam's state in float32.
  mixed-precision-for-JAX is installed by `benchmarks/peers.py` into
  `benchmarks/.vendor/` and imported under another name, as it also imports as
  `mpx`.
- Bytes per parameter are the minimum each variant must move, not what XLA
  moves; the gap between them is the *x floor* column, measured, and the *XLA
  B/param* column, XLA's own count of what its kernels read and write.
- Speed at many leaves: a tree of a few hundred small matrices, where per-leaf
  costs (a kernel, a reduction, a branch operand per leaf) weigh more than on the
  transformer-shaped trees' few large ones; the peers are left out there.
- Timings on a shared 2-core machine move by 10-20% between runs; ratios
  within one run are steadier than absolute times."""


def render_markdown(results: dict[str, Any], png_name: str | None) -> str:
  machine = results["machine"]
  parts = [
    "# Benchmarks",
    "Generated by `benchmarks/run.py`; do not edit by hand. Regenerate with:\n\n"
    f"```bash\n{results['command']}\n```",
    table(
      ["machine", ""],
      [
        ["mpx", machine["mpx"]],
        ["CPU", machine["cpu"]],
        ["cores", machine["cores"]],
        ["memory", machine["memory"]],
        ["device", machine["device"]],
        [
          "python / jax / optax / flax",
          " / ".join(machine[k] for k in ("python", "jax", "optax", "flax")),
        ],
        ["date", machine["date"]],
        ["load average at start", machine["load"]],
        ["malloc", machine.get("malloc", "?")],
        ["run time", f"{results['runtime_s']:.0f} s"],
      ],
      "ll",
    ),
  ]
  rows = targets(results)
  parts.append("## Targets")
  if rows:
    met = sum(r[-1] == "met" for r in rows)
    parts.append(
      "The targets of issues 10 and 17, on this machine's CPU, as they came out of this "
      "one run (not tuned for). Speed: the median over rounds of each mpx step's time "
      "over the mean of the two windows of the check-then-apply step of its dtype "
      "(float32 masters, the step inside `lax.cond(mpx.all_finite(grads))`) timed just "
      "before and after it in the same round (*paired*, section 1), at 16M and 64M "
      "params and on the many-leaf tree; mpx bf16 with remainder masters and with "
      "stochastic rounding: their time over that of mpx bf16 with full masters, paired "
      "the same way, at 16M and 64M, in this process and (remainder) in a process "
      "started with glibc malloc told to keep large blocks; scratch: "
      "`memory_analysis().temp_size_in_bytes` per parameter; compile: trace + lower + "
      "compile over the check-then-apply step's of the same dtype in the same round, "
      f"per leaf count (section 2). **{met} of {len(rows)} met.**"
    )
    parts.append(table(["size", "target", "measured", "verdict"], rows, "llll"))
  else:
    parts.append("Not evaluated: no size of at least 8M parameters in this run.")
  if png_name:
    parts.append(f"![optimizer step time relative to plain FP32 Adam]({png_name})")
  parts.append("## 1. Optimizer step (Adam)")
  opt = results["optimizer"]
  parts.append(
    "One jitted `step(state, grads) -> state`, state donated. The trees are "
    "transformer-shaped, but for one of many small leaves, where per-leaf costs show: "
    + "; ".join(f"{s['label']}: {s['desc']}" for s in opt["sizes"])
    + "."
  )
  parts.append(
    table(
      ["variant", "what it runs"],
      [[v["name"], v["what"]] for v in opt["variants"]],
      "ll",
    )
  )
  parts += optimizer_sections(results)
  parts.append("### Where the cost comes from")
  parts.append(explanation(results))
  compile_time = compile_time_section(results.get("compile_time") or {})
  if compile_time:
    parts.append("## 2. Compile time against leaf count")
    parts += compile_time
  train = train_section(results)
  if train:
    parts.append("## 3. Whole training step")
    parts += train
  parts.append("## Method")
  parts.append(METHOD)
  return "\n\n".join(parts) + "\n"


TICKS = {
  HAND: "hand-written\nfp16",
  HAND_BF16: "hand-written\nbf16",
  "hand + cond (flag given)": "hand + cond\n(flag given)",
  "hand + check": "hand\n+ check",
  "hand + cond": "hand\n+ cond",
  HAND_COND_BF16: "hand bf16\n+ cond",
  "hand + select": "hand\n+ select",
  MPX_BF16: "mpx\nbf16",
  "mpx fp16": "mpx\nfp16",
  MPX_REMAINDER: "mpx bf16\nremainder",
  MPX_STOCHASTIC: "mpx bf16\nstochastic",
  "jmp fp16": "jmp\nfp16",
  "flax DynamicScale fp16": "flax Dynamic-\nScale fp16",
  "mixed-precision-for-JAX fp16": "mixed-precision-\nfor-JAX fp16",
  "optax.apply_if_finite fp16": "optax.apply_\nif_finite fp16",
}


def render_png(results: dict[str, Any], path: pathlib.Path) -> bool:
  """Grouped bars: each variant's step time over plain FP32 Adam's, per size.

  Returns:
    False, drawing nothing, if matplotlib is not installed (it comes with the
    ``bench`` and ``examples`` extras, not with ``test``).
  """
  try:
    import matplotlib
  except ImportError:
    return False

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  opt = results["optimizer"]
  names = [v["name"] for v in opt["variants"] if v["name"] != BASELINE]
  sizes = opt["sizes"]
  fig, ax = plt.subplots(figsize=(11, 5.2), dpi=110)
  width = 0.8 / max(1, len(sizes))
  colors = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
  for i, size in enumerate(sizes):
    values = [size["rows"].get(n, {}).get("x_base", float("nan")) for n in names]
    xs = [j + (i - (len(sizes) - 1) / 2) * width for j in range(len(names))]
    label = size["label"] if size.get("many_leaves") else f"{size['label']} params"
    bars = ax.bar(xs, values, width, label=label, color=colors[i % 4])
    for bar, value in zip(bars, values, strict=True):
      if not math.isnan(value):
        ax.annotate(
          f"{value:.1f}",
          (bar.get_x() + bar.get_width() / 2, value),
          ha="center",
          va="bottom",
          fontsize=7,
        )
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.axhline(30 / 28, color="gray", linestyle="--", linewidth=0.8, label="bandwidth floor 30/28")
  ax.set_xticks(range(len(names)))
  ax.set_xticklabels([TICKS.get(n, n) for n in names], fontsize=8)
  ax.set_ylabel(f"step time / {BASELINE} (lower is better)")
  machine = results["machine"]
  ax.set_title(
    f"Adam optimizer step time over plain FP32 Adam's - {machine['cpu']}, "
    f"{machine['cores']} cores, jax {machine['jax']}, {machine['date']}",
    fontsize=9,
  )
  ax.legend(fontsize=8)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True
