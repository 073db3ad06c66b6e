"""Counts what XLA compiled: kernels, copies, branches, scratch and bytes moved."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax

# The first line of a computation in HLO text: its name, then its signature.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\(")


def hlo_profile(compiled: Any) -> dict[str, int]:
  """Counts the instructions XLA runs, by opcode, outside fused computations.

  Returns a dict with the counts of ``fusion`` kernels (``custom_fusions``:
  those XLA:CPU hands to a library such as YNNPACK, ``kind=kCustom``),
  standalone ``copy`` instructions, ``conditional``s, the instructions inside
  conditional branches, the temporary buffer bytes, and the bytes XLA's cost
  model says the step accesses (-1 where it does not say).
  """
  counts = {"fusion": 0, "copy": 0, "conditional": 0, "in_branches": 0, "custom_fusions": 0}
  text = compiled.as_text()
  branch_names = set()
  for match in re.finditer(r"conditional\(.*?branch_computations=\{([^}]*)\}", text):
    branch_names.update(n.strip().lstrip("%") for n in match.group(1).split(","))
  for match in re.finditer(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", text):
    branch_names.update(match.groups())
  computation = None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    if computation is None or "fused" in computation or "fusion" in computation:
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op = m.group(1)
    if op in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
      continue
    if computation in branch_names:
      counts["in_branches"] += 1
    if op in counts:
      counts[op] += 1
    if op == "fusion" and "kind=kCustom" in line:
      counts["custom_fusions"] += 1
  memory = compiled.memory_analysis()
  counts["temp_bytes"] = int(getattr(memory, "temp_size_in_bytes", 0) or 0)
  accessed = bytes_accessed(compiled)
  counts["bytes_accessed"] = -1 if accessed is None else int(accessed)
  counts["one_element_read_bytes"] = one_element_read_bytes(text)
  return counts


_ELEMENT_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ")
_FUSION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\S+) fusion\((.*?)\), .*calls=%([\w.\-]+)")


def _type_bytes(hlo_type: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(hlo_type):
    if dtype in _ELEMENT_BYTES:
      total += _ELEMENT_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def one_element_read_bytes(hlo_text: str) -> int:
  """Counts the bytes XLA's cost model overcharges kernels that read one element.

  A kernel whose one-element result is a ``slice`` of its operands (how mpx
  orders in-place writes) reads that element, but ``cost_analysis()`` charges
  each operand whole; returns the charge beyond the element each reads.
  """
  types: dict[str, str] = {}
  computations: dict[str, str] = {}
  name = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = header.group(1)
      computations[name] = ""
      continue
    if name is not None:
      computations[name] += line + "\n"
    m = _DEFINITION.match(line)
    if m:
      types[m.group(1)] = m.group(2)
  total = 0
  for line in hlo_text.splitlines():
    m = _FUSION.match(line)
    if not m or _type_bytes(m.group(1)) == 0:
      continue
    result_elements = sum(
      math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(m.group(1))
    )
    if result_elements != 1 or " slice(" not in computations.get(m.group(3), ""):
      continue
    operands = [o.strip().lstrip("%") for o in m.group(2).split(",") if o.strip()]
    # Charged: every operand whole; read: the one element it returns.
    total += sum(_type_bytes(types.get(o, "")) for o in operands) - _type_bytes(m.group(1))
  return total


def bytes_accessed(compiled: Any) -> float | None:
  """Reads ``cost_analysis()["bytes accessed"]``: the bytes XLA's kernels read and write.

  Returns:
    The figure, or None where the backend gives no cost analysis.
  """
  try:
    cost = compiled.cost_analysis()
  except (NotImplementedError, RuntimeError):
    return None
  # Older jax returns one dict per program of the executable (one here: a
  # single device), newer jax the dict itself.
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not isinstance(cost, Mapping):
    return None
  value = cost.get("bytes accessed")
  return None if value is None else float(value)


def peak_bytes(compiled: Any) -> tuple[int, str]:
  """Returns the peak memory of one step and where the figure comes from.

  Where the device has no allocator statistics (XLA:CPU), the compiled step's
  analysis: arguments + outputs not aliased to a donated argument + temporaries.
  """
  stats = jax.local_devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device allocator"
  m = compiled.memory_analysis()
  total = (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )
  return int(total), "compiled.memory_analysis()"
