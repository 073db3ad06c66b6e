"""How far each moments format's demo run lands from FP32's, over seeds: the shift and the spread.

Trains the demo (``examples/demo.py``'s defaults) once per seed with FP32 and
with ``mpx.mixed_precision(adamw, masters="24bit", moments=...)`` for each
format below (the ``bf16 24bit + 4bit moments`` row, its moments varied), and
prints per format the validation-loss gap to FP32 over the seeds: its mean
(a systematic shift: the stored moments train as another optimizer would) and
its standard deviation (the spread that the stored moments' rounding noise
adds to a run; each seed also seeds the rounding). The 24-bit masters alone
(float32 moments) show the floor: what bfloat16 forward and backward passes
and 24-bit masters leave. docs/concepts_masters.md, "Which moments to
pick", shows a run.

Run: ``python benchmarks/demo_spread.py [--seeds 0,1,2,3,4]`` (about 2 minutes
a seed on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
from typing import Any

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402

import mpx  # noqa: E402

FORMATS: dict[str, Any] = {
  "full": "full",
  "bfloat16": "bfloat16",
  "8bit": "8bit",
  "mu 4bit / nu 8bit": {"mu": "4bit", "nu": "8bit"},
  "mu 8bit / nu 4bit": {"mu": "8bit", "nu": "4bit"},
  "4bit": "4bit",
}


def row(label: str, moments: Any) -> demo.Row:
  """The demo's ``bf16 24bit + 4bit moments`` row with ``moments``."""
  template = demo.ROW_BY_NAME["bf16 24bit + 4bit moments"]

  def tx(adamw: Any, s: demo.Settings) -> Any:
    return mpx.mixed_precision(adamw, masters="24bit", moments=moments, seed=s.seed, skip=s.skip)

  return dataclasses.replace(template, name=f"24bit + {label}", tx=tx)


def gaps(seed: int, labels: list[str], *flags: str) -> tuple[dict[str, float], dict[str, float]]:
  """Returns per format of ``labels`` the relative gap to FP32's validation
  loss, and the state's bytes per param, of one demo run with ``seed`` and
  the demo's ``flags``."""
  out = pathlib.Path(tempfile.mkdtemp()) / "plot.png"
  settings, args = demo.parse_args(["--seed", str(seed), "--no-check", "--out", str(out), *flags])
  args.rows = [demo.ROWS[0], *(row(label, FORMATS[label]) for label in labels)]
  reference, *results = demo.run(settings, args).results
  return (
    {label: demo.relative_gap(r, reference) for label, r in zip(labels, results, strict=True)},
    {label: r.state_bytes_per_param for label, r in zip(labels, results, strict=True)},
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", default="0,1,2,3,4")
  parser.add_argument("--steps", type=int, help="training steps (the demo's default)")
  parser.add_argument("--smoke", action="store_true", help="the demo's tiny preset")
  parser.add_argument("--formats", default=",".join(FORMATS), help="|".join(FORMATS))
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  labels = [label.strip() for label in args.formats.split(",")]
  if unknown := set(labels) - set(FORMATS):
    parser.error(f"--formats: unknown {sorted(unknown)}; the formats are {', '.join(FORMATS)}")
  flags = [*(["--steps", str(args.steps)] if args.steps else []), *(["--smoke"] * args.smoke)]
  runs = [gaps(seed, labels, *flags) for seed in seeds]
  preset = "smoke preset" if args.smoke else "defaults"
  steps = args.steps or (demo.SMOKE if args.smoke else demo.DEFAULT)["steps"]
  print(f"\njax {jax.__version__}, the demo's {preset}, {steps} steps, seeds {args.seeds}")
  print("gap: relative to FP32's validation loss in the same run (positive: worse)\n")
  print("| moments (24-bit masters) | state B/param | mean gap | sd | range | per seed |")
  print("|:--|--:|--:|--:|--:|:--|")
  for label in labels:
    values = np.array([run[0][label] for run in runs]) * 100
    nbytes = runs[0][1][label]
    sd = values.std(ddof=1) if len(values) > 1 else float("nan")
    each = ", ".join(f"{v:+.2f}" for v in values)
    print(
      f"| {label} | {nbytes:.2f} | {values.mean():+.2f}% | {sd:.2f}% | "
      f"{values.min():+.2f}% to {values.max():+.2f}% | {each} |"
    )


if __name__ == "__main__":
  main()
