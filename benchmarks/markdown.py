"""Formats Markdown for the benchmark reports: tables, cells and the template's prose.

The prose lives in templates such as ``report_template.md``, one block per
``<!-- name -->`` marker, filled with ``str.format_map``.
"""

from __future__ import annotations

import functools
import math
import pathlib
import re
from typing import Any

TEMPLATE = pathlib.Path(__file__).with_name("report_template.md")
_MARKER = re.compile(r"^<!-- (\w+)( verbatim)? -->$", re.MULTILINE)


@functools.cache
def blocks(path: pathlib.Path = TEMPLATE) -> dict[str, str]:
  """Reads a template's blocks; a block's paragraphs are unwrapped onto one
  line each unless its marker says ``verbatim``."""
  parts = _MARKER.split(path.read_text())
  out = {}
  for name, verbatim, text in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
    text = text.strip("\n")
    out[name] = text if verbatim else "\n\n".join(map(_unwrap, text.split("\n\n")))
  return out


def _unwrap(paragraph: str) -> str:
  """Joins a paragraph's lines with spaces; a line that starts with "- " begins a new one."""
  lines: list[str] = []
  for line in paragraph.split("\n"):
    if lines and not line.startswith("- "):
      lines[-1] += " " + line
    else:
      lines.append(line)
  return "\n".join(lines)


def prose(block: str, /, template: pathlib.Path = TEMPLATE, **fields: Any) -> str:
  """Returns ``block`` of ``template`` with its ``{fields}`` filled in."""
  return blocks(template)[block].format_map(fields)


def size_label(n: int) -> str:
  """Returns ``n`` params as the tables name it: ``64M``, ``1.5K``, ``512``."""
  for unit, div in (("M", 2**20), ("K", 2**10)):
    if n >= div:
      value = n / div
      return f"{value:.0f}{unit}" if abs(value - round(value)) < 0.05 else f"{value:.1f}{unit}"
  return str(n)


def fmt(x: Any, spec: str = ".2f", none: str = "-") -> str:
  """Formats a number for a cell; ``none`` for a missing or NaN one."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return none
  return format(x, spec)


def syncs_cell(value: int | str | None) -> str:
  """Formats a host-sync count: 0, n/a, or the refused transfers in bold."""
  if value == 0:
    return "0"
  return "n/a" if value is None else f"**refused**: {value}"


def compiles_cell(compiles: int | None, traces: int | None) -> str:
  """Formats a compile count, with the trace count where they differ; bold unless 1."""
  if compiles is None:
    return "-"
  text = str(compiles) if compiles == traces else f"{compiles} ({traces} traces)"
  return text if compiles == 1 else f"**{text}**"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
  """Renders a Markdown table; ``align`` has an ``l`` or ``r`` per column."""
  align = align or "l" + "r" * (len(header) - 1)
  marks = [":--" if a == "l" else "--:" for a in align]
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def verdict(value: float | None, limit: float, over: str) -> str:
  """Returns "met", or "missed" and by how much (``over`` formats the excess)."""
  if value is None or math.isnan(value):
    return "not measured"
  if value <= limit:
    return "met"
  return f"**missed** by {over.format(value / limit - 1, value - limit)}"
