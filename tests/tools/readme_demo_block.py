"""Writes README.md's results block from a checked run of examples/demo.py.

``python tests/tools/readme_demo_block.py README.md [DEMO FLAGS...]`` runs the
demo as ``python examples/demo.py [DEMO FLAGS...]`` does (every row, checks
on) and replaces what lies between the file's two demo-results markers.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import pathlib
import sys
from types import ModuleType
from typing import Any

README_START = "<!-- demo-results:start (written by tests/tools/readme_demo_block.py README.md) -->"
README_END = "<!-- demo-results:end -->"
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@functools.cache
def load_demo() -> ModuleType:
  """Imports examples/demo.py (which imports examples/lm.py as ``lm``) once."""
  sys.path.insert(0, str(EXAMPLES))
  try:
    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = module  # for its dataclasses' annotations
    try:
      spec.loader.exec_module(module)
    finally:
      del sys.modules["demo"]
  finally:
    sys.path.remove(str(EXAMPLES))
  return module


def bounds_summary(tolerance: float | None = None, min_gap: float | None = None) -> str:
  """Says in words the claims the demo's ``check`` enforces at full size, with
  the bounds of its ``ROWS`` or the run's overrides of them."""
  demo = load_demo()
  within: dict[float, list[str]] = {}
  worse: dict[float, list[str]] = {}
  for r in demo.ROWS:
    if r.tolerance is not None:
      within.setdefault(r.tolerance if tolerance is None else tolerance, []).append(r.name)
    if r.worse_by is not None:
      worse.setdefault(r.worse_by if min_gap is None else min_gap, []).append(r.name)
  gaps = [f"{_names(names)} within {bound:.1%}" for bound, names in within.items()]
  if gaps:
    gaps[0] = gaps[0].replace(" within ", " end within ", 1) + " of FP32's validation loss"
    gaps[-1] += ", above or below"
  claims = [
    ", ".join(gaps),
    *(f"{_names(names)} more than {bound:.1%} above it" for bound, names in worse.items()),
  ]
  return "; ".join(claim for claim in claims if claim)


def _names(names: list[str]) -> str:
  quoted = [f"`{name}`" for name in names]
  return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def write_readme_block(
  path: pathlib.Path,
  report: list[str],
  results: list[Any],
  seconds: float,
  flags: list[str],
  tolerance: float | None = None,
  min_gap: float | None = None,
) -> None:
  """Replaces what lies between the README's two markers by this run.

  The block says where and how long the run took (as ``python
  examples/demo.py`` with the demo's ``flags``), gives its table and checks
  verbatim, and says in words what the checks guarantee on any machine and
  what varies with the machine. ``tolerance`` and ``min_gap`` are the run's
  overrides of the rows' bounds, as passed to the demo's ``check``.
  """
  demo = load_demo()
  text = path.read_text()
  if text.count(README_START) != 1 or text.count(README_END) != 1:
    raise SystemExit(f"{path} needs one {README_START!r} and one {README_END!r} line")
  head, rest = text.split(README_START)
  _, tail = rest.split(README_END)
  command = " ".join(["python examples/demo.py", *flags])
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  reference = results[0]
  bounded = [demo.relative_gap(r, reference) for r in results if demo.ROW_BY_NAME[r.mode].tolerance]
  worse = [r for r in results if demo.ROW_BY_NAME[r.mode].worse_by is not None]
  this_run = [
    f"the mpx rows end {min(bounded):+.2%} to {max(bounded):+.2%}" if bounded else "",
    *(f"`{r.mode}` {demo.relative_gap(r, reference):+.2%}" for r in worse),
  ]
  block = [
    f"On {demo.machine()}: `{command}`; the demo took {seconds:.0f} s, "
    f"load average {load} at the end.",
    "",
    "```",
    *report,
    "```",
    "",
    f"On any machine the demo exits 0 only if these hold: {bounds_summary(tolerance, min_gap)}.",
    f"The numbers within those bounds depend on the machine (in this run "
    f"{', '.join(x for x in this_run if x)}): XLA:CPU picks its kernels, vectorisation and "
    "fused multiply-adds by the CPU's features and by its own version, so the last bits "
    "of each step differ between machines, and the differences grow over the run. A "
    "rerun on the same machine and versions prints the same losses; tokens/s and the "
    "time vary with the CPU and its load.",
  ]
  path.write_text(head + README_START + "\n" + "\n".join(block) + "\n" + README_END + tail)


def parse_args(argv: list[str] | None) -> tuple[pathlib.Path, list[str], Any, Any]:
  """Returns the README's path, the demo's flags and the demo's parsed
  settings and arguments; exit with a usage error unless the run checks
  every row at full size (the block states the bounds the checks enforce)."""
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog="The arguments after the file are the demo's (python examples/demo.py --help).",
  )
  parser.add_argument("readme", type=pathlib.Path, help="the file to update (README.md)")
  parser.add_argument("flags", nargs=argparse.REMAINDER, help="the demo's flags")
  args = parser.parse_args(argv)
  flags = args.flags
  demo = load_demo()
  settings, demo_args = demo.parse_args(flags)
  if len(demo_args.rows) < len(demo.ROWS):
    parser.error("the block needs every row: not with --rows")
  if demo_args.smoke or demo_args.no_check:
    parser.error("the block needs a checked run: not with --smoke, MPX_SMOKE or --no-check")
  return args.readme, flags, settings, demo_args


def main(argv: list[str] | None = None) -> int:
  """Runs the demo and writes its block; exits as the demo does."""
  readme, flags, settings, demo_args = parse_args(argv)
  run = load_demo().run(settings, demo_args)
  write_readme_block(
    readme,
    run.report,
    run.results,
    run.seconds,
    flags,
    tolerance=demo_args.tolerance,
    min_gap=demo_args.min_gap,
  )
  print(f"updated the results block of {readme}")
  return 0 if run.ok else 1


if __name__ == "__main__":
  sys.exit(main())
