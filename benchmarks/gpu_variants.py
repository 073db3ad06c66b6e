"""The modes compiled for an H100: their transformations, floors, model shapes and topology."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx

TARGET = pathlib.Path(__file__).parent / "gpu" / "h100_sxm.txtpb"
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
