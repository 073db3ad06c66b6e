"""Renders the compressed-moments benchmark (``benchmarks/moments.py``) as Markdown."""

from __future__ import annotations

from typing import Any

from benchmarks.markdown import compiles_cell, fmt, syncs_cell, table, verdict

# A compressed-moment step's time over the full-moment step of the same masters
# mode, paired in every round: at most this on a CPU.
SPEED_GOALS = {"bfloat16": 1.1, "8bit": 1.3, "4bit": 2.5}
# 8bit's bytes moved per step per parameter, at least this far below the
# full-moment step's (XLA's count).
BYTES_SAVED_GOAL = 8.0

# AdamW elsewhere, by construction (what each stores per parameter, from its
# source or its authors' figures), not measured here: (optimizer, param B,
# state B, what keeps the master, how the moments are kept, what is counted).
PEER_MOMENTS = (
  (
    "PyTorch AMP / apex O2: float32 master, float32 m and v",
    2,
    12,
    "exact (float32)",
    "exact (float32)",
    "float32 master + m + v",
  ),
  (
    "bitsandbytes AdamW8bit, float32 params (AMP)",
    4,
    2.03,
    "exact (the float32 param)",
    "8-bit dynamic map, float32 absmax per 256",
    "uint8 m and v + a float32 absmax per 256 elements each (2 + 8/256); tensors "
    "under 4,096 elements keep float32 m and v",
  ),
  (
    "bitsandbytes AdamW8bit, bf16 params",
    2,
    2.03,
    "none: updates land in the bf16 param",
    "8-bit dynamic map, float32 absmax per 256",
    "as above, no master",
  ),
  (
    "torchao AdamW8bit, bf16_stochastic_round=True",
    2,
    2.03,
    "none: param rounded stochastically",
    "8-bit dynamic map, float32 scale per 256",
    "uint8 m and v + a float32 scale per 256 elements each",
  ),
  (
    "torchao AdamW4bit, bf16_stochastic_round=True",
    2,
    1.06,
    "none: param rounded stochastically",
    "4-bit, float32 scale per 128",
    "two 4-bit codes per byte for m and v + a float32 scale per 128 elements each",
  ),
  (
    "TransformerEngine FusedAdam, fp32 master, bf16 m and v (TE #1640)",
    2,
    8,
    "exact (float32)",
    "bf16, rounded to nearest",
    "float32 master + bf16 m + v",
  ),
  (
    "TransformerEngine FusedAdam, store_param_remainders, bf16 m and v",
    2,
    6,
    "exact (int16 remainder)",
    "bf16, rounded to nearest",
    "int16 remainder + bf16 m + v (the options combine in its source; not run here)",
  ),
  (
    "TransformerEngine FusedAdam, store_param_remainders, FP8 m and v",
    2,
    4,
    "exact (int16 remainder)",
    "FP8 E4M3, one float32 scale per tensor",
    "int16 remainder + 1-byte m + v; below about 2**-18 of the tensor's largest an "
    "element rounds to 0",
  ),
  (
    "FlashOptim AdamW (default)",
    2,
    3,
    "lossy: 24-bit split master",
    "8-bit",
    "5 B/param for params + state, as its authors count it: bf16 param + 1-byte "
    "correction + 8-bit m + v",
  ),
  (
    "optax.adamw(mu_dtype=bfloat16), float32 params",
    4,
    6,
    "exact (the float32 param)",
    "mu bf16 (cast to nearest), nu float32",
    "bf16 mu + float32 nu; optax has no nu_dtype (#1552)",
  ),
)


def name_of(masters: str, moments: str) -> str:
  """Names the step of one masters mode and one moments format."""
  return f"masters {masters}, moments {moments}"


def _goal(moments: str, ratio: float | None) -> str:
  if moments not in SPEED_GOALS:
    return "-"
  limit = SPEED_GOALS[moments]
  return f"<= {limit:.1f}x: " + verdict(ratio, limit, "{0:.0%}")


def _bytes_goal(moments: str, saved: float | None) -> str:
  if moments != "8bit":
    return "-"
  if saved is None:
    return "not measured"
  result = "met" if saved >= BYTES_SAVED_GOAL else f"**missed** by {BYTES_SAVED_GOAL - saved:.1f}"
  return f">= {BYTES_SAVED_GOAL:.0f} fewer: {result}"


def memory_section(rows: list[dict[str, Any]], shape: tuple[int, int]) -> list[str]:
  """Renders the bytes-per-parameter table, mpx's measured rows then the peers'."""
  f = fmt
  table_rows = []
  for r in rows:
    exact_master = {"full": "exact (float32)", "remainder": "exact (int16 remainder)"}.get(
      r["masters"], "none: param rounded stochastically"
    )
    exact_moments = {
      "full": "exact (float32)",
      "bfloat16": "bf16, rounded stochastically",
      "8bit": "8-bit, float32 scale per block of <= 256, rounded stochastically",
      "4bit": "4-bit, float32 scale per block of <= 128, rounded stochastically",
    }[r["moments"]]
    expected = f"{r['expected']}" + (f" (+{r['allowance']})" if r["allowance"] else "")
    table_rows.append(
      [
        f"mpx {name_of(r['masters'], r['moments'])}",
        "2",
        f(r["state_bpp"], ".3f"),
        f(2 + r["state_bpp"], ".2f"),
        exact_master,
        exact_moments,
        f"measured; expected {expected}: " + ("yes" if r["within"] else "**no**"),
      ]
    )
  for name, param, state, master, moments, how in PEER_MOMENTS:
    table_rows.append(
      [
        name,
        str(param),
        f"{state:g}",
        f"{param + state:g}",
        master,
        moments,
        f"by construction, not measured: {how}",
      ]
    )
  return [
    "## Memory: bytes per parameter, AdamW on bf16 params",
    f"*state*: the whole optimizer state (masters or what stands for them, the moments, "
    f"counters), summed over its leaves, over the parameter count, on one bf16 leaf of "
    f"{shape[0]}x{shape[1]}; *param*: the trained parameter. Gradients are not counted. "
    "The peers' rows are what each stores per parameter, by construction, not measured.",
    table(
      ["optimizer", "param B", "state B", "param + state B", "master", "moments", "source"],
      table_rows,
      "lrrrlll",
    ),
  ]


def speed_section(size: dict[str, Any]) -> list[str]:
  """Renders the step time and bytes-moved table of one tree size."""
  f = fmt
  rows = []
  for r in size["rows"].values():
    rows.append(
      [
        r["masters"],
        r["moments"],
        f(r["ms"], ".1f"),
        "1 (baseline)" if r["x_full"] is None else f(r["x_full"], ".2f") + "x",
        _goal(r["moments"], r["x_full"]),
        f(r["xla_accessed_bpp"], ".1f"),
        f(r["accessed_bpp"], ".1f"),
        "-" if r["moments"] == "full" else f(r["saved_bpp"], ".1f"),
        _bytes_goal(r["moments"], r["saved_bpp"]),
        f(r["temp_bpp"], ".2f"),
        str(r["fusions"]),
        f(r["state_bpp"], ".2f"),
        syncs_cell(r["host_syncs"]),
        compiles_cell(r["compiles"], r["traces"]),
      ]
    )
  return [
    f"## Step time and bytes moved: {size['label']} params",
    f"Tree: {size['desc']}; {size['rounds']} rounds. *x full*: the median over rounds "
    "of the step's time over the mean of the two full-moment windows (same masters mode) "
    "just before and after it. *XLA B/param*: `cost_analysis()['bytes accessed']` over "
    "the parameter count. *less 1-element reads*: the same, less what XLA charges the "
    "kernels that read one element of each large output to order the compressed "
    "moments' in-place writes (it charges each operand whole, though one element is "
    "read: `benchmarks/common.py`'s `one_element_read_bytes`); *saved*: the "
    "full-moment step's figure minus this one's, both so counted. "
    "*scratch*: `temp_size_in_bytes` per parameter; *kernels*: top-level fusions.",
    table(
      [
        "masters",
        "moments",
        "ms",
        "x full",
        "goal (CPU)",
        "XLA B/param",
        "less 1-element reads",
        "saved B/param",
        "goal",
        "scratch B/param",
        "kernels",
        "state B/param",
        "host syncs",
        "compiles",
      ],
      rows,
      "llrrlrrrlrrrrr",
    ),
  ]


def render(results: dict[str, Any]) -> str:
  """Renders the whole report from :func:`benchmarks.moments.run`'s results."""
  machine = results["machine"]
  parts = [
    "# Benchmarks: compressed optimizer moments",
    "Why the numbers are what they are, and when to pick which format: "
    "[the moments](concepts_masters.md#the-moments-moments-bfloat16-8bit-and-4bit).",
    f"Generated by `benchmarks/moments.py`. Regenerate with:\n\n```bash\n{results['command']}\n```",
    table(
      ["machine", ""],
      [
        ["mpx", machine["mpx"]],
        ["CPU", f"{machine['cpu']} ({machine['cores']} cores)"],
        ["device", machine["device"]],
        ["jax / optax", f"{machine['jax']} / {machine['optax']}"],
        ["date", machine["date"]],
        ["load average at start", machine["load"]],
        ["malloc", machine["malloc"]],
        ["run time", f"{results['runtime_s']:.0f} s"],
      ],
      "ll",
    ),
  ]
  parts += memory_section(results["memory"], tuple(results["memory_shape"]))
  for size in results["sizes"]:
    parts += speed_section(size)
  parts.append(
    "Timings on a shared machine move by 10-20% between runs; the ratios, each taken "
    "against windows adjacent in time, are steadier than the milliseconds."
  )
  return "\n\n".join(parts) + "\n"
