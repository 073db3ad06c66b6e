"""Draws docs/benchmarks.png: each optimizer step's time over plain FP32 Adam's."""

from __future__ import annotations

import math
import pathlib
from typing import Any

from benchmarks.optimizer_step import (
  BASELINE,
  HAND,
  HAND_BF16,
  HAND_COND_BF16,
  MPX_BF16,
  MPX_REMAINDER,
  MPX_STOCHASTIC,
)
from benchmarks.rows import StepRow


def _x_base(row: StepRow | None) -> float:
  return float("nan") if row is None else row.x_base


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
  """Draws grouped bars: each variant's step time over plain FP32 Adam's, per size.

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
    values = [_x_base(size["rows"].get(n)) for n in names]
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
