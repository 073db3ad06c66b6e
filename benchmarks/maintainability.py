"""Measures what a maintainer reads: the step's path, docstrings, file sizes.

Run ``python benchmarks/maintainability.py [ROOT]`` (ROOT: a checkout, by
default this one; the step's path is traced in the mpx that is imported).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import mpx

PACKAGE = Path(mpx.__file__).resolve().parent
_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


# The steps counted: the fp16 step with full moments, and
# the two compressed bf16 steps people choose mpx for.
STEPS = {
  "fp16 step": (jnp.float16, lambda: mpx.loss_scale(mpx.mixed_precision(optax.adamw(1e-3)))),
  "remainder + 8bit step": (
    jnp.bfloat16,
    lambda: mpx.mixed_precision(optax.adamw(1e-3), masters="remainder", moments="8bit"),
  ),
  "24bit + per-field step": (
    jnp.bfloat16,
    lambda: mpx.mixed_precision(
      optax.adamw(1e-3), masters="24bit", moments={"mu": "8bit", "nu": "4bit"}
    ),
  ),
}


def trace_step(name: str = "fp16 step") -> list[tuple[str, str, bool]]:
  """Returns the ``(file, function, checking)`` of every mpx call made while
  tracing the step ``name`` of :data:`STEPS`; ``checking``: made inside a
  trace-time check (a frame of validation.py on the stack, the call's own
  included). Traced as if first in its process: jax's caches (e.g. of a
  ``lax.cond`` branch's trace, kept by the function and its shapes) are
  cleared first, so a function an earlier step traced is counted again."""
  dtype, make_tx = STEPS[name]
  params = {"w": jnp.ones((64, 64), dtype), "b": jnp.zeros(64, dtype)}
  tx = make_tx()
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  jax.clear_caches()
  calls: list[tuple[str, str, bool]] = []
  checks = str(PACKAGE / "_src" / "validation.py")

  def profile(frame: FrameType, event: str, arg: Any) -> None:
    del arg
    if event != "call":
      return
    path = Path(frame.f_code.co_filename)
    name = frame.f_code.co_qualname
    if path.is_relative_to(PACKAGE) and not name.endswith(_COMPREHENSIONS):
      outer: FrameType | None = frame
      while outer is not None and outer.f_code.co_filename != checks:
        outer = outer.f_back
      calls.append((str(path.relative_to(PACKAGE)), name, outer is not None))

  step = jax.jit(tx.update)
  sys.setprofile(profile)
  try:
    step.lower(grads, state, params)
  finally:
    sys.setprofile(None)
  return calls


class StepPath(NamedTuple):
  """One traced step's path, as ``main`` prints it."""

  files: list[str]
  functions: list[tuple[str, str]]  # (file, function), sorted
  checks_only: set[tuple[str, str]]  # the functions only the checks call
  switches: int  # calls from one file into another


def step_path(calls: list[tuple[str, str, bool]]) -> StepPath:
  """Summarises ``trace_step``'s calls."""
  functions = sorted({(f, name) for f, name, _ in calls})
  # A function every call of which is made inside a check serves the checks alone.
  outside = {(f, name) for f, name, checking in calls if not checking}
  return StepPath(
    sorted({f for f, _, _ in calls}),
    functions,
    set(functions) - outside,
    sum(1 for a, b in itertools.pairwise(calls) if a[0] != b[0]),
  )


def docstring_lines(node: ast.AST) -> int:
  """Returns the lines of ``node``'s docstring (0 without one)."""
  text = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
  return 0 if text is None else len(text.splitlines())


def docstrings(root: Path) -> tuple[int, list[tuple[int, str]]]:
  """Returns the module docstrings' total lines and each public docstring's."""
  module_total, public = 0, []
  for path in sorted((root / "mpx").rglob("*.py")):
    tree = ast.parse(path.read_text())
    module_total += docstring_lines(tree)
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
        public.append((docstring_lines(node), f"{path.relative_to(root)}:{node.name}"))
  return module_total, sorted(public, reverse=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
  parser.add_argument("--list", action="store_true", help="print every function of the step")
  args = parser.parse_args()
  root = Path(args.root)
  for step in STEPS:
    path = step_path(trace_step(step))
    checks = len(path.checks_only)
    print(
      f"{step}: {len(path.files)} files, {len(path.functions)} functions "
      f"({len(path.functions) - checks} outside the trace-time checks, {checks} only inside "
      f"them), {path.switches} calls across files"
    )
    if args.list:
      for f, name in path.functions:
        print(f"  {f}:{name}" + ("  (checks only)" if (f, name) in path.checks_only else ""))
  module_total, public = docstrings(root)
  print(f"module docstrings: {module_total} lines")
  print("longest public docstrings: " + ", ".join(f"{name} {n}" for n, name in public[:4]))
  sizes = sorted(
    (len(p.read_text().splitlines()), p.name) for p in (root / "benchmarks").glob("*.py")
  )
  library = sum(len(p.read_text().splitlines()) for p in (root / "mpx").rglob("*.py"))
  benchmarks = sum(n for n, _ in sizes)
  print(
    f"benchmarks: {benchmarks} lines (library {library}); largest {sizes[-1][1]} {sizes[-1][0]}"
  )


if __name__ == "__main__":
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  main()
