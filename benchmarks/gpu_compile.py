"""What XLA would run on an H100, compiled on this machine without one.

Compiles one optimizer step per mode for an H100 (``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` at jax's version) and counts, from the optimized HLO, its
conditionals, kernels, bytes moved, copies and scratch. ``--scale 0.01``: small.
``--sweep``: one bfloat16 leaf by size, per masters and moments format.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx

TARGET = pathlib.Path(__file__).parent / "gpu" / "h100_sxm.txtpb"
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
# Floors from the mode's storage (a memory-bound step cannot go below them):
# grads read twice (check, update) 4, params read and written 4, plus what the
# mode stores, read and written.
FLOORS = {
  "optax adamw, float32 params": 28,
  "hand-written float32 masters, select skip": 32,
  "mpx full": 32,
  "mpx remainder": 28,
  "mpx stochastic": 24,
  "mpx full + bfloat16 moments": 24,
  "mpx full + 8bit moments": 22,
  "mpx remainder + 8bit moments": 18,
  "mpx stochastic + 8bit moments": 14,
  "mpx loss_scale(full), fp16": 32,
  # float32 params: grads (4 B) read twice, params and Adam's moments read and written.
  "mpx loss_scale(adamw), float32 params": 32,
}
# What a master stores per param (read and written once a step), by masters=.
MASTER_BYTES = {"full": 4.0, "remainder": 2.0, "24bit": 1.0, "stochastic": 0.0}
# What a moment stores per element, by format, on a last axis of 4096: 8bit a
# code and a float32 scale per block of 256, 4bit half a byte and a float32
# scale per block of 128.
MOMENT_BYTES = {"full": 4.0, "bfloat16": 2.0, "8bit": 1 + 4 / 256, "4bit": 0.5 + 4 / 128}
ADAM_FIELDS = ("mu", "nu")


def moment_formats(moments: str | dict[str, str]) -> dict[str, str]:
  """Returns each of AdamW's moments' format under a ``moments=`` setting."""
  if isinstance(moments, str):
    return dict.fromkeys(ADAM_FIELDS, moments)
  return {field: moments.get(field, "full") for field in ADAM_FIELDS}


def floor_bytes(masters: str, moments: str | dict[str, str], two_pass: bool = False) -> float:
  """Returns the bytes per param that one bfloat16 leaf's AdamW step must move.

  The gradients read twice (the verdict, the update: 2 x 2), the params read
  and written (2 x 2), the master read and written (full 8, remainder 4,
  24bit 2, stochastic 0) and each moment read and written at its stored bytes (8bit
  2 x (1 + 4/256), 4bit 2 x (0.5 + 4/128)). ``two_pass``: each compressed
  moment read once more, as a compress that takes its block maxima first (a
  pass over the new moment, made from the old) must; FLOORS counts so (the
  8-bit rows are these, rounded: 22.09 to 22).
  """
  total = 2 * 2 + 2 * 2 + 2 * MASTER_BYTES[masters]
  for fmt in moment_formats(moments).values():
    reads = 2 if two_pass and fmt in ("8bit", "4bit") else 1
    total += (reads + 1) * MOMENT_BYTES[fmt]
  return total


def mode_name(masters: str, moments: str | dict[str, str]) -> str:
  """Names a mode as FLOORS and the tables do: "mpx remainder + 8bit moments"."""
  if moments == "full":
    return f"mpx {masters}"
  shown = moments if isinstance(moments, str) else ", ".join(f"{k} {v}" for k, v in moments.items())
  return f"mpx {masters} + {shown} moments"


# The 4-bit modes' floors, counted as the 8-bit ones (two_pass), to a tenth.
FLOORS |= {
  mode_name(masters, moments): round(floor_bytes(masters, moments, two_pass=True), 1)
  for masters in MASTER_BYTES
  for moments in ("4bit", {"mu": "8bit", "nu": "4bit"})
}


def topology(devices: int = 1) -> Any:
  """Describes ``devices`` H100s for deviceless compilation."""
  from jax.experimental import topologies

  return topologies.get_topology_desc(
    platform="cuda",
    topology_name="",
    target_config=TARGET.read_text(),
    topology=f"1x1x{devices}",
  )


def param_count(shapes: dict[str, tuple[int, ...]]) -> int:
  """Counts the parameters of a dict of shapes."""
  return sum(int(np.prod(s)) for s in shapes.values())


def model_shapes(scale: float = 1.0) -> dict[str, tuple[int, ...]]:
  """Builds a 4-layer transformer's 26 leaf shapes: 67M params at scale 1."""
  d = max(16, int(1024 * scale**0.5) // 16 * 16)
  shapes: dict[str, tuple[int, ...]] = {"embed": (16 * d, d), "final_norm": (d,)}
  for i in range(4):
    shapes |= {
      f"l{i}/qkv": (d, 3 * d),
      f"l{i}/out": (d, d),
      f"l{i}/up": (d, 4 * d),
      f"l{i}/down": (4 * d, d),
      f"l{i}/norm1": (d,),
      f"l{i}/norm2": (d,),
    }
  return shapes


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row: the mode's name, the params' dtype, and its transformation."""

  name: str
  param_dtype: Any
  make: Callable[[], optax.GradientTransformation]


def hand_written_masters(lr: float = 1e-3) -> optax.GradientTransformation:
  """Builds the reference: float32 masters, AdamW on them, a skip by ``jnp.where``."""
  adamw = optax.adamw(lr)

  def init(params):
    masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return masters, adamw.init(masters)

  def update(grads, state, params):
    masters, inner = state
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    updates, new_inner = adamw.update(grads, inner, masters)
    new_masters = optax.apply_updates(masters, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new_masters = jax.tree.map(keep, new_masters, masters)
    new_inner = jax.tree.map(keep, new_inner, inner)
    rounded = lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p  # noqa: E731
    return jax.tree.map(rounded, new_masters, params), (new_masters, new_inner)

  return optax.GradientTransformation(init, update)


def variants() -> list[Variant]:
  """Lists the modes compiled, in the tables' order."""
  bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
  mp = lambda **kw: lambda: mpx.mixed_precision(optax.adamw(1e-3), **kw)  # noqa: E731
  return [
    Variant("optax adamw, float32 params", f32, lambda: optax.adamw(1e-3)),
    Variant("hand-written float32 masters, select skip", bf16, hand_written_masters),
    Variant("mpx full", bf16, mp()),
    Variant("mpx remainder", bf16, mp(masters="remainder")),
    Variant("mpx stochastic", bf16, mp(masters="stochastic")),
    Variant("mpx full + bfloat16 moments", bf16, mp(moments="bfloat16")),
    Variant("mpx full + 8bit moments", bf16, mp(moments="8bit")),
    Variant("mpx remainder + 8bit moments", bf16, mp(masters="remainder", moments="8bit")),
    Variant("mpx stochastic + 8bit moments", bf16, mp(masters="stochastic", moments="8bit")),
    Variant("mpx remainder + 4bit moments", bf16, mp(masters="remainder", moments="4bit")),
    Variant("mpx 24bit + 4bit moments", bf16, mp(masters="24bit", moments="4bit")),
    Variant("mpx stochastic + 4bit moments", bf16, mp(masters="stochastic", moments="4bit")),
    Variant(
      "mpx loss_scale(full), fp16",
      f16,
      lambda: mpx.loss_scale(mpx.mixed_precision(optax.adamw(1e-3))),
    ),
    Variant(
      "mpx loss_scale(adamw), float32 params",
      f32,
      lambda: mpx.loss_scale(optax.adamw(1e-3)),
    ),
  ]


def compile_step(tx: optax.GradientTransformation, shapes: dict, dtype: Any, topo: Any) -> Any:
  """Compiles ``tx``'s donated step on one device of ``topo``."""
  sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
  params = {k: jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for k, s in shapes.items()}
  state = jax.eval_shape(tx.init, params)
  state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), state)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  traced = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, params)
  return traced.lower(lowering_platforms=("cuda",)).compile()


def compile_zero1_step(
  tx: optax.GradientTransformation, shapes: dict, dtype: Any, topo: Any
) -> Any:
  """Compiles the step on a mesh of the topology's devices.

  Params replicated, the state split over ``"data"`` by :func:`mpx.zero1_shardings`.
  """
  mesh = jax.sharding.Mesh(np.array(topo.devices), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {k: jax.ShapeDtypeStruct(s, dtype, sharding=replicated) for k, s in shapes.items()}
  shardings = mpx.zero1_shardings(tx, params, mesh)
  state = jax.eval_shape(tx.init, params)
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings
  )
  param_shardings = jax.tree.map(lambda p: p.sharding, params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(param_shardings, shardings))
  return jitted.trace(params, state, params).lower(lowering_platforms=("cuda",)).compile()


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
  """Counts over the entry computation and the branches of its conditionals."""
  text = compiled.as_text()
  computations = _computations(text)
  entry = next(name for name in computations if name.startswith("ENTRY "))
  run = [entry]
  conditionals = 0
  for name in computations:
    for _, _, op, rest in computations[name]:
      if op == "conditional":
        conditionals += 1
        run += re.findall(r"(?:branch_computations=\{|true_computation=|false_computation=)"
                          r"%?([\w.-]+)", rest)  # fmt: skip
  kernels = copies = copied = total = 0
  for name in run:
    instructions = computations.get(name) or computations.get(_by_short(computations, name), [])
    types = {n: t for n, t, _, _ in instructions}
    for _, result, op, rest in instructions:
      if op not in KERNEL_OPS:
        continue
      kernels += 1
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
      moved = type_bytes(result) + sum(read)
      total += moved
      if op in ("copy", "copy-start"):
        copies += 1
        copied += moved
  scratch = compiled.memory_analysis().temp_size_in_bytes
  return Profile(conditionals, kernels, copies, copied, total, scratch)


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


def table(scale: float) -> list[str]:
  """Renders the one-GPU table's lines."""
  shapes = model_shapes(scale)
  n = param_count(shapes)
  topo = topology()
  lines = [
    f"{len(shapes)} leaves, {n / 1e6:.1f}M params; compiled for an H100 by XLA "
    f"(jax {jax.__version__}), not run",
    "",
    "| step | conditionals | kernels | bytes/param | floor | copies (B/param) | scratch B/param |",
    "|:--|--:|--:|--:|--:|--:|--:|",
  ]
  for variant in variants():
    p = profile(compile_step(variant.make(), shapes, variant.param_dtype, topo))
    lines.append(
      f"| {variant.name} | {p.conditionals} | {p.kernels} | {p.bytes / n:.1f} | "
      f"{FLOORS[variant.name]} | {p.copies} ({p.copied_bytes / n:.2f}) | {p.scratch / n:.2f} |"
    )
  return lines


# The sweep's leaves: one bfloat16 (rows, 4096) leaf per size, by its elements.
SWEEP_ROWS = {"64K": 16, "512K": 128, "1M": 256, "4M": 1024, "16M": 4096, "64M": 16384}
# Compiling allocates no buffers: a 64M leaf compiles as fast as a 64K one
# (2 to 4 s a step on 2 cores), so the sweep takes every size by default.
SWEEP_SIZES = tuple(SWEEP_ROWS)
SWEEP_MASTERS = ("full", "remainder", "24bit", "stochastic")
SWEEP_MOMENTS: tuple[str | dict[str, str], ...] = (
  "full",
  "8bit",
  "4bit",
  {"mu": "8bit", "nu": "4bit"},
)
SWEEP_WIDTH = 4096


@dataclasses.dataclass(frozen=True)
class SweepRow:
  """One mode of the sweep: its profile per leaf size, and its floors."""

  name: str
  masters: str
  moments: str | dict[str, str]
  profiles: dict[str, Profile]  # by size name
  floor: float  # floor_bytes
  two_pass_floor: float  # floor_bytes(two_pass=True)

  def bytes_per_param(self, size: str) -> float:
    return self.profiles[size].bytes / (SWEEP_ROWS[size] * SWEEP_WIDTH)

  def scratch_per_param(self, size: str) -> float:
    return self.profiles[size].scratch / (SWEEP_ROWS[size] * SWEEP_WIDTH)

  @property
  def conditionals(self) -> int:
    return max(p.conditionals for p in self.profiles.values())


def sweep(
  sizes: tuple[str, ...] = SWEEP_SIZES,
  masters: tuple[str, ...] = SWEEP_MASTERS,
  moments: tuple[str | dict[str, str], ...] = SWEEP_MOMENTS,
  topo: Any = None,
) -> list[SweepRow]:
  """Compiles AdamW's donated step on one bfloat16 leaf of each size, per mode."""
  topo = topology() if topo is None else topo
  rows = []
  for m in masters:
    for fmt in moments:
      profiles = {}
      for size in sizes:
        tx = mpx.mixed_precision(optax.adamw(1e-3), masters=m, moments=fmt)
        shapes = {"w": (SWEEP_ROWS[size], SWEEP_WIDTH)}
        profiles[size] = profile(compile_step(tx, shapes, jnp.bfloat16, topo))
      rows.append(
        SweepRow(
          mode_name(m, fmt),
          m,
          fmt,
          profiles,
          floor_bytes(m, fmt),
          floor_bytes(m, fmt, two_pass=True),
        )
      )
  return rows


def sweep_table(rows: list[SweepRow]) -> list[str]:
  """Renders the sweep's lines: per mode, B/param moved / scratch B/param by leaf size."""
  sizes = list(rows[0].profiles)
  lines = [
    f"One bfloat16 leaf of (rows, {SWEEP_WIDTH}), AdamW; compiled for an H100 by XLA "
    f"(jax {jax.__version__}), not run. Each cell: B/param moved / scratch B/param.",
    "",
    "| step | floor | two-pass floor | conditionals | " + " | ".join(sizes) + " |",
    "|:--|--:|--:|--:|" + "--:|" * len(sizes),
  ]
  for row in rows:
    cells = [f"{row.bytes_per_param(s):.1f} / {row.scratch_per_param(s):.2f}" for s in sizes]
    lines.append(
      f"| {row.name} | {row.floor:.2f} | {row.two_pass_floor:.2f} | {row.conditionals} | "
      + " | ".join(cells)
      + " |"
    )
  return lines


@dataclasses.dataclass(frozen=True)
class Zero1Profile:
  profile: Profile
  collectives: dict[str, int]
  state_bytes: int  # per device


def zero1_profile(variant: Variant, shapes: dict, topo: Any) -> Zero1Profile:
  """Compiles and profiles the ZeRO-1 step of ``variant`` on the topology's devices."""
  compiled = compile_zero1_step(variant.make(), shapes, variant.param_dtype, topo)
  # The arguments less the params and grads, both replicated: the state's shard.
  replicated = 2 * param_count(shapes) * np.dtype(variant.param_dtype).itemsize
  state = compiled.memory_analysis().argument_size_in_bytes - replicated
  return Zero1Profile(profile(compiled), collectives(compiled), state)


def zero1_table(scale: float, devices: int = 8) -> list[str]:
  """Renders the ZeRO-1 table's lines for ``devices`` GPUs."""
  shapes = model_shapes(scale)
  n = param_count(shapes)
  topo = topology(devices)
  lines = [
    f"{devices} H100s, params replicated, the state split by mpx.zero1_shardings "
    "(per device; B/param over all params)",
    "",
    "| step | conditionals | state B/param | scratch B/param | copies (B/param) | collectives |",
    "|:--|--:|--:|--:|--:|:--|",
  ]
  for variant in variants():
    if not variant.name.startswith("mpx"):
      continue
    z = zero1_profile(variant, shapes, topo)
    p = z.profile
    found = ", ".join(f"{k} {v}" for k, v in z.collectives.items())
    lines.append(
      f"| {variant.name} | {p.conditionals} | {z.state_bytes / n:.2f} | {p.scratch / n:.2f} | "
      f"{p.copies} ({p.copied_bytes / n:.2f}) | {found} |"
    )
  return lines


PAGE = """# The step compiled for an H100 by XLA, not run

Generated by `benchmarks/gpu_compile.py`; do not edit by hand. Regenerate with:

```bash
pip install --no-deps "jax-cuda12-plugin==$JAX" "jax-cuda12-pjrt==$JAX"  # jax's version
python benchmarks/gpu_compile.py --sweep --out docs/benchmarks_gpu.md
```

One optimizer step (AdamW update and `optax.apply_updates`, params and state
donated) compiled on a CPU machine for an NVIDIA H100 SXM (XLA's own target
description, `benchmarks/gpu/h100_sxm.txtpb`) and read from the optimized
HLO; nothing here ran on a GPU. *conditionals*: each one a host sync per step
on XLA:GPU. *kernels*: the fusions, library calls and copies the host
launches. *bytes/param*: each kernel's operands and results, summed, over the
parameter count: what a memory-bound step reads and writes. *floor*: what the
mode must move at least (gradients read twice, params read and written, and
what the mode stores read and written). *copies*: copy kernels, with the
bytes they move. *scratch*: `compiled.memory_analysis().temp_size_in_bytes`.
`tests/test_gpu_compile.py` asserts the goals on a smaller tree of the same
shapes.

## One GPU

{one}

## Eight GPUs, ZeRO-1

{eight}

## One leaf, by size

Regenerate with `python benchmarks/gpu_compile.py --sweep --no-tables`
(about 3 minutes on 2 cores). AdamW's step on a single bfloat16 leaf of
(rows, 4096) elements, per `masters=` and `moments=` (`"full"`: float32
moments, the reference). *floor*: the gradients read twice (2 x 2 B), the
params read and written (2 x 2), the master read and written (full 8,
remainder 4, stochastic 0) and each moment read and written at its stored
bytes (float32 2 x 4, 8bit 2 x (1 + 4/256), 4bit 2 x (0.5 + 4/128)).
*two-pass floor*: each compressed moment read once more, as a compress that
needs its block maxima before it codes must (the old codes feed both the
maxima and the codes); the one-GPU table's floors count so.
*conditionals*: the most in any size's step. The goal
(`tests/test_gpu_compile.py`, expected to fail where it does not hold):
at most the two-pass floor + 1 B/param moved, at most 0.1 B/param of
scratch, at every size. docs/design.md, "Compressed moments at the byte
floor", explains the 8- and 4-bit rows.

{sweep}
"""


def main(argv: list[str] | None = None) -> None:
  """Prints both tables (or, with ``--sweep``, the leaf-size sweep's), and
  writes the docs page with ``--out``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--scale", type=float, default=1.0, help="params relative to 67M")
  parser.add_argument("--devices", type=int, default=8, help="GPUs of the ZeRO-1 table (0: none)")
  parser.add_argument("--out", help="write a docs page (e.g. docs/benchmarks_gpu.md)")
  parser.add_argument(
    "--sweep", action="store_true", help="one leaf by size, per masters and moments format"
  )
  parser.add_argument(
    "--sweep-sizes",
    nargs="+",
    default=list(SWEEP_SIZES),
    choices=list(SWEEP_ROWS),
    help="the sweep's leaf sizes (default: all)",
  )
  parser.add_argument(
    "--tables",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="the one-GPU and ZeRO-1 tables (--no-tables with --sweep: the sweep's only)",
  )
  args = parser.parse_args(argv)
  one = eight = swept = "(not run)"
  if args.tables:
    one = "\n".join(table(args.scale))
    eight = "\n".join(zero1_table(args.scale, args.devices)) if args.devices else "(not run)"
    print(one, eight, sep="\n\n")
  if args.sweep:
    swept = "\n".join(sweep_table(sweep(tuple(args.sweep_sizes))))
    print(swept)
  if args.out:
    pathlib.Path(args.out).write_text(PAGE.format(one=one, eight=eight, sweep=swept))


if __name__ == "__main__":
  main()
