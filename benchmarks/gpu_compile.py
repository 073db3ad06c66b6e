"""What XLA would run on an H100, compiled on this machine without one.

Renders the tables and docs/benchmarks_gpu.md from gpu_variants.py's steps, read by gpu_hlo.py."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpx  # noqa: E402
from benchmarks.gpu_hlo import Profile, collectives, profile  # noqa: E402
from benchmarks.gpu_variants import (  # noqa: E402
  FLOORS,
  Variant,
  compile_step,
  compile_zero1_step,
  floor_bytes,
  mode_name,
  model_shapes,
  param_count,
  topology,
  variants,
)


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
scratch, at every size. A 4-bit `nu`'s range keeps more per-block arrays
(its smallest positive value and its word between the passes, 4 bytes a
block of 128 each, and from 4M on its step and levels per bit between
kernels): its goal is 0.1625 B/param at 64K and 512K, and from 4M on it
keeps up to 0.25; 24-bit masters with a 4-bit `nu` miss both goals at 64K,
where the new `nu` is written out of the first pass. docs/design.md,
"Compressed moments at the byte floor", explains the 8- and 4-bit rows.

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
