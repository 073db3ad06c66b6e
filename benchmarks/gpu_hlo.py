"""Reads XLA:GPU's optimized HLO text: kernels, bytes moved, copies, conditionals, collectives.

Unlike hlo.py (XLA:CPU, by cost_analysis), it counts 4-bit types packed two a byte."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

# Kernels: what the host launches. Bytes are their operands and results.
KERNEL_OPS = ("fusion", "custom-call", "copy", "copy-start", "all-gather", "all-reduce")
_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}  # fmt: skip (4-bit types: XLA:GPU packs two a byte, layout {...:E(4)})
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*)$")


def collectives(compiled: Any) -> dict[str, int]:
  """Counts the collectives of the optimized HLO, by opcode."""
  ops = re.findall(
    r" (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(",
    compiled.as_text(),
  )
  return {op: ops.count(op) for op in sorted(set(ops))}


def _arrays(text: str) -> list[tuple[float, int]]:
  """Returns ``(bytes an element, elements)`` of each array an HLO type names."""
  return [
    (_BYTES[dtype], int(np.prod([int(n) for n in dims.split(",") if n] or [1])))
    for dtype, dims in _ARRAY.findall(text)
  ]


def type_bytes(text: str) -> float:
  """Counts the bytes of the arrays an HLO type names."""
  return sum(size * count for size, count in _arrays(text))


def type_elements(text: str) -> int:
  """Counts the elements of the largest array an HLO type names."""
  return max((count for _, count in _arrays(text)), default=0)


def _element_bytes(text: str) -> float:
  arrays = _arrays(text)
  return arrays[0][0] if arrays else 0


# Ops that pass one operand's elements on one for one (the walk from a
# reduction's input back to the slice it reads).
_ONE_FOR_ONE = {"abs", "bitcast", "convert", "copy", "negate", "reshape"}


def _sliced_elements(computations: dict, result: str, rest: str) -> int | None:
  """Returns how many elements of each operand a fusion reads where it computes
  only a slice of them, else None: ``mpx``'s sampled checks (a strided sample
  of the update and the master), as a loop fusion that slices and
  computes each output element from one element of each operand, or as an
  input fusion whose every reduction reads a slice and whose only outputs are
  the reductions' (XLA:GPU computes the operands at the sliced indices alone);
  a gather from a code table reads one entry per element."""
  called = re.search(r"kind=(kLoop|kInput), calls=%?([\w.-]+)", rest)
  if not called:
    return None
  instructions = computations.get(called.group(2), [])
  by_name = {name: (op, result, body) for name, result, op, body in instructions}
  ops = {op for _, _, op, _ in instructions}
  many = {"reduce", "reduce-window", "scatter", "dot", "convolution", "sort"}
  if "slice" not in ops:
    return None
  if called.group(1) == "kLoop":
    return None if ops & many else max(type_elements(result), 1)
  if ops & many != {"reduce"}:
    return None
  sliced = []
  for _, _, op, body in instructions:
    if op != "reduce":
      continue
    operands = re.findall(r"%([\w.-]+)", body.split("),")[0])
    for name in operands[: len(operands) // 2]:  # the inputs; then the inits
      while by_name.get(name, ("", "", ""))[0] in _ONE_FOR_ONE:
        name = re.findall(r"%([\w.-]+)", by_name[name][2])[0]
      op, operand_type, _ = by_name.get(name, ("", "", ""))
      # A slice, or a parameter: an operand the reduction reads whole, at its size.
      if op not in ("slice", "parameter"):
        return None
      sliced.append(type_elements(operand_type))
  elements = max(sliced)
  return elements if type_elements(result) <= elements else None


@dataclasses.dataclass(frozen=True)
class Profile:
  conditionals: int
  kernels: int
  copies: int
  copied_bytes: int
  bytes: int
  scratch: int


def profile(compiled: Any) -> Profile:
  """Counts over the entry computation, the branches of its conditionals and
  the bodies of its loops (a scan's, once per iteration: its known trip count)."""
  text = compiled.as_text()
  computations = _computations(text)
  entry = next(name for name in computations if name.startswith("ENTRY "))
  run = [(entry, 1)]
  bodies: set[str] = set()
  conditionals = 0
  for name in computations:
    for _, _, op, rest in computations[name]:
      if op == "conditional":
        conditionals += 1
        run += [(branch, 1) for branch in re.findall(
          r"(?:branch_computations=\{|true_computation=|false_computation=)%?([\w.-]+)", rest
        )]  # fmt: skip
  # Loop bodies, nested ones too, each times the trips of the loops around it.
  for name, times in run:
    for _, _, op, rest in computations.get(name) or computations.get(
      _by_short(computations, name), []
    ):
      if op == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        body = re.search(r"body=%?([\w.-]+)", rest)
        if body:
          run.append((body.group(1), times * (int(trips.group(1)) if trips else 1)))
          bodies.add(body.group(1))
  kernels = copies = copied = total = 0
  for name, times in run:
    instructions = computations.get(name) or computations.get(_by_short(computations, name), [])
    types = {n: t for n, t, _, _ in instructions}
    for _, result, op, rest in instructions:
      if op not in KERNEL_OPS:
        continue
      kernels += times
      operands = re.findall(r"%([\w.-]+)", rest.split("),")[0])
      read = [type_bytes(types.get(o, "")) for o in operands]
      elements = _sliced_elements(computations, result, rest)
      if elements is not None:
        # It computes only the sliced elements, so it reads at most as many of
        # each operand.
        read = [
          min(b, elements * _element_bytes(types.get(o, "")))
          for b, o in zip(read, operands, strict=True)
        ]
      in_place = None
      if name in bodies:  # a loop body's fusion may read and write slices in place
        in_place = _in_place(computations, rest, [types.get(o, "") for o in operands])
      if in_place is not None:
        written, in_place_read = in_place
        # Each operand's slices, or at most the sliced elements computed.
        read = [min(a, b) for a, b in zip(read, in_place_read, strict=True)]
        result = ""
      else:
        written = 0
      moved = (written + type_bytes(result) + sum(read)) * times
      total += moved
      if op in ("copy", "copy-start"):
        copies += times
        copied += moved
  scratch = compiled.memory_analysis().temp_size_in_bytes
  return Profile(conditionals, kernels, copies, copied, total, scratch)


_SLICING = ("dynamic-slice", "dynamic-update-slice")


def _in_place(
  computations: dict, rest: str, operand_types: list[str]
) -> tuple[float, list[float]] | None:
  """Returns ``(bytes written, bytes read per operand)`` of a fusion that reads
  some operand only by dynamic slices or writes one by dynamic-update-slices
  in place (a scan body's, on the stacked arrays it carries), counting the
  slices; None for any other kernel."""
  called = re.search(r"calls=%?([\w.-]+)", rest)
  body = computations.get(called.group(1)) if called else None
  if not body:
    return None
  types = {n: t for n, t, _, _ in body}
  params = {int(r.split(")")[0]): n for n, _, op, r in body if op == "parameter"}
  users: dict[str, list[tuple[str, int, str]]] = {}
  for _, result, op, r in body:
    for k, o in enumerate(re.findall(r"%([\w.-]+)", r.split("),")[0])):
      users.setdefault(o, []).append((op, k, result))
  read, sliced = [], False
  for i, operand_type in enumerate(operand_types):
    uses = users.get(params.get(i, ""), [])
    if uses and all(op in _SLICING and k == 0 for op, k, _ in uses):
      # Its slices read; an update's slice written (below), in place.
      read.append(sum(type_bytes(t) for op, _, t in uses if op == "dynamic-slice"))
      sliced = True
    else:
      read.append(type_bytes(operand_type))
  if not sliced:
    return None
  # The results: each dynamic-update-slice writes its update alone.
  name, root_type, root_op, root_rest = body[-1]
  outputs = re.findall(r"%([\w.-]+)", root_rest.split("),")[0]) if root_op == "tuple" else [name]
  ops = {n: (op, r) for n, _, op, r in body}
  written = 0.0
  for out in outputs:
    op, r = ops.get(out, ("", ""))
    if op == "dynamic-update-slice":
      written += type_bytes(types.get(re.findall(r"%([\w.-]+)", r)[1], ""))
    else:
      written += type_bytes(types.get(out, root_type))
  return written, read


def _computations(text: str) -> dict[str, list[tuple[str, str, str, str]]]:
  out: dict[str, list[tuple[str, str, str, str]]] = {}
  current: list[tuple[str, str, str, str]] | None = None
  for line in text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.-]+) .*\{$", line)
    if header and not line.startswith(" "):
      current = out.setdefault((header.group(1) or "") + header.group(2), [])
      continue
    match = _INSTRUCTION.match(line)
    if match and current is not None:
      current.append(match.groups())
  return out


def _by_short(computations: dict, name: str) -> str:
  return next((c for c in computations if c.endswith(name)), name)
