"""Renders benchmark results as Markdown (docs/benchmarks.md) and a PNG figure.

The prose is ``benchmarks/report_template.md``; ``python benchmarks/report.py
results.json`` renders the results ``run.py --json`` wrote, without measuring.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import rows as rows_io  # noqa: E402
from benchmarks.markdown import prose, table  # noqa: E402
from benchmarks.report_optimizer import optimizer_sections  # noqa: E402
from benchmarks.report_png import render_png  # noqa: E402
from benchmarks.report_sections import (  # noqa: E402
  compile_time_section,
  explanation,
  train_section,
)
from benchmarks.targets import targets  # noqa: E402

# Lets Sphinx build docs/ with -W while no toctree lists the page yet.
FRONT_MATTER = "---\norphan: true\n---\n\n"


def machine_table(results: dict[str, Any]) -> str:
  """Renders the machine, the versions and the run time."""
  machine = results["machine"]
  versions = " / ".join(machine[k] for k in ("python", "jax", "optax", "flax"))
  named = (("mpx", "mpx"), ("CPU", "cpu"), ("cores", "cores"), ("memory", "memory"))
  rows = [[label, machine[key]] for label, key in (*named, ("device", "device"))]
  rows += [
    ["python / jax / optax / flax", versions],
    ["date", machine["date"]],
    ["load average at start", machine["load"]],
    ["malloc", machine.get("malloc", "?")],
    ["run time", f"{results['runtime_s']:.0f} s"],
  ]
  return table(["machine", ""], rows, "ll")


def render_markdown(results: dict[str, Any], png_name: str | None) -> str:
  """Renders the whole report, the figure linked as ``png_name`` if one was drawn."""
  parts = [prose("header", command=results["command"]), machine_table(results), "## Targets"]
  rows = targets(results)
  if rows:
    met = sum(r[-1] == "met" for r in rows)
    parts.append(prose("targets_intro", met=met, total=len(rows)))
    parts.append(table(["size", "target", "measured", "verdict"], rows, "llll"))
  else:
    parts.append(prose("targets_none"))
  if png_name:
    parts.append(prose("figure", png=png_name))
  opt = results["optimizer"]
  parts.append("## 1. Optimizer step (Adam)")
  parts.append(
    prose("optimizer_intro", trees="; ".join(f"{s['label']}: {s['desc']}" for s in opt["sizes"]))
  )
  parts.append(
    table(["variant", "what it runs"], [[v["name"], v["what"]] for v in opt["variants"]], "ll")
  )
  parts += optimizer_sections(results)
  parts += ["### Where the cost comes from", explanation(results)]
  compile_time = compile_time_section(results.get("compile_time") or {})
  if compile_time:
    parts += ["## 2. Compile time against leaf count", *compile_time]
  train = train_section(results)
  if train:
    parts += ["## 3. Whole training step", *train]
  parts += ["## Method", prose("method")]
  return "\n\n".join(parts) + "\n"


def write(results: dict[str, Any], out_dir: str | None) -> str:
  """Writes benchmarks.md (and .png) into ``out_dir`` if given; returns the Markdown."""
  png = None
  if out_dir:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = "benchmarks.png" if render_png(results, out / "benchmarks.png") else None
  markdown = render_markdown(results, png)
  if out_dir:
    (pathlib.Path(out_dir) / "benchmarks.md").write_text(FRONT_MATTER + markdown)
  return markdown


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description="Render results that run.py --json wrote.")
  parser.add_argument("results", help="the JSON file")
  parser.add_argument("--out-dir", help="write benchmarks.md/.png here (default: print only)")
  args = parser.parse_args(argv)
  print(write(rows_io.load(args.results), args.out_dir))
  return 0


if __name__ == "__main__":
  sys.exit(main())
