"""The whole training step's peak on an H100, compiled here without one.

One jit of loss, gradient, update and ``optax.apply_updates`` (params and
state donated) on a stack of MLP blocks, unrolled or under ``lax.scan``; with
accumulation, also the micro-step (``mpx.accumulate_gradients``, the state
donated). Per param: what the step keeps (params, state, accumulator), its
transient peak (``memory_analysis().temp_size_in_bytes``) and the bytes its
kernels move (gpu_hlo.py). ``python benchmarks/whole_step.py [--blocks 8
--width 1024 --batch 64]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpx  # noqa: E402
from benchmarks.gpu_compile import SWEEP_MASTERS, SWEEP_MOMENTS  # noqa: E402
from benchmarks.gpu_hlo import profile  # noqa: E402
from benchmarks.gpu_variants import mode_name, topology  # noqa: E402

K = 4  # micro-batches per window in the accumulation rows
# The moments of the rows ``--4bit-only`` keeps: those with a 4-bit moment.
FOUR_BIT: tuple[str | dict[str, str], ...] = ("4bit", {"mu": "8bit", "nu": "4bit"})


@dataclasses.dataclass(frozen=True)
class Model:
  """A residual stack of ``blocks`` MLP blocks ``x + relu(x @ up) @ down`` of
  ``width`` (hidden ``4 * width``), bfloat16 params, a float32 loss."""

  blocks: int = 8
  width: int = 1024
  batch: int = 64
  scanned: bool = False

  def shapes(self) -> dict[str, tuple[int, ...]]:
    up, down = (self.width, 4 * self.width), (4 * self.width, self.width)
    if self.scanned:
      return {"up": (self.blocks, *up), "down": (self.blocks, *down)}
    return {f"{name}{i}": s for i in range(self.blocks) for name, s in (("up", up), ("down", down))}

  @property
  def params(self) -> int:
    return sum(int(np.prod(s)) for s in self.shapes().values())

  def loss(self, params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    def block(x: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
      return x + jax.nn.relu(x @ up) @ down

    if self.scanned:
      x, _ = jax.lax.scan(lambda x, w: (block(x, *w), None), x, (params["up"], params["down"]))
    else:
      for i in range(self.blocks):
        x = block(x, params[f"up{i}"], params[f"down{i}"])
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


@dataclasses.dataclass(frozen=True)
class Row:
  """One step's figures, per param."""

  name: str
  kept: float  # params, state and accumulator, as the step's arguments hold them
  transient: float  # the step's temporaries at their peak
  moved: float  # every kernel's operands and results
  conditionals: int

  @property
  def total(self) -> float:
    return self.kept + self.transient


def _abstract(tree: Any, sharding: Any) -> Any:
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def measure(
  name: str,
  model: Model,
  tx: optax.GradientTransformation,
  micro_step: bool = False,
  topo: Any = None,
  clip: float | None = None,
) -> Row:
  """Compiles ``tx``'s whole step (or, with ``micro_step``, its accumulation
  micro-step) for one H100 of ``topo`` (by default a new one) and reads its
  figures; with ``clip``, on gradients from ``mpx.clipped_grad(loss, clip)``."""
  topo = topology() if topo is None else topo
  sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
  params = {
    k: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for k, s in model.shapes().items()
  }
  state = _abstract(jax.eval_shape(tx.init, params), sharding)
  batch = jax.ShapeDtypeStruct((model.batch, model.width), jnp.bfloat16, sharding=sharding)

  def step(params, state, batch):
    if clip is None:
      grads = jax.grad(model.loss)(params, batch)
    else:
      grads, _ = mpx.clipped_grad(model.loss, clip)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def micro(params, state, batch):
    return mpx.accumulate_gradients(jax.grad(model.loss)(params, batch), state)

  jitted = jax.jit(micro, donate_argnums=1) if micro_step else jax.jit(step, donate_argnums=(0, 1))
  compiled = jitted.trace(params, state, batch).lower(lowering_platforms=("cuda",)).compile()
  n = model.params
  kept = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, state)))
  p = profile(compiled)
  return Row(name, kept / n, p.scratch / n, p.bytes / n, p.conditionals)


def measure_scan_layers(
  name: str, model: Model, tx: optax.GradientTransformation, topo: Any
) -> Row:
  """As :func:`measure`, for the scanned stack's step under ``mpx.scan_layers(block,
  tx)``: each layer updated in the backward scan's iteration."""
  sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
  params = {
    k: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for k, s in model.shapes().items()
  }
  stack = mpx.scan_layers(lambda p, x: x + jax.nn.relu(x @ p["up"]) @ p["down"], tx)
  layers = _abstract(jax.eval_shape(stack.init, params), sharding)
  batch = jax.ShapeDtypeStruct((model.batch, model.width), jnp.bfloat16, sharding=sharding)

  def step(layers, batch):
    return jax.grad(lambda layers: jnp.mean(jnp.square(stack(layers, batch).astype(jnp.float32))))(
      layers
    )

  jitted = jax.jit(step, donate_argnums=0)
  compiled = jitted.trace(layers, batch).lower(lowering_platforms=("cuda",)).compile()
  n = model.params
  kept = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layers))
  p = profile(compiled)
  return Row(name, kept / n, p.scratch / n, p.bytes / n, p.conditionals)


Maker = Callable[[], optax.GradientTransformation]


class Step(NamedTuple):
  """A step compared: its name, its transformation's maker, whether it is the
  accumulation micro-step, and the norm ``mpx.clipped_grad`` clips to (None: no
  two-pass clipping)."""

  name: str
  make: Maker
  micro_step: bool = False
  clip: float | None = None


def rows(every_mode: bool = True) -> list[Step]:
  """The steps compared: optax's beside mpx's (every masters x moments mode,
  or with ``every_mode=False`` those with a 4-bit moment; each with ``skip="step"``, the
  default, and ``skip="leaf"``); clipping by the global norm in one pass
  (optax's) and in two (``mpx.clipped_grad``), and by each leaf's RMS
  (``optax.clip_by_block_rms``); and accumulation, by ``optax.MultiSteps``
  and by ``mpx.accumulate`` (its two programs) with 4-bit moments and each
  masters mode (bfloat16 accumulator; float32 too for the exact and 24-bit
  masters)."""

  def mp(m: str, f: Any, inner: Maker = lambda: optax.adamw(1e-3), **kw: Any) -> Maker:
    return lambda: mpx.mixed_precision(inner(), masters=m, moments=f, **kw)

  steps = [Step("optax adamw", lambda: optax.adamw(1e-3))]
  for masters in SWEEP_MASTERS:
    for moments in SWEEP_MOMENTS if every_mode else FOUR_BIT:
      steps.append(Step(mode_name(masters, moments), mp(masters, moments)))
  for masters in SWEEP_MASTERS:
    for moments in SWEEP_MOMENTS if every_mode else FOUR_BIT:
      steps.append(
        Step(f"{mode_name(masters, moments)}, skip=leaf", mp(masters, moments, skip="leaf"))
      )
  clip_then_adamw = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))  # noqa: E731
  rms_then_adamw = lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.adamw(1e-3))  # noqa: E731
  steps += [
    Step("optax clip_by_global_norm + adamw", clip_then_adamw),
    Step("optax adamw, mpx.clipped_grad", lambda: optax.adamw(1e-3), clip=1.0),
  ]
  for f in ("bfloat16", "4bit"):
    name = f"mpx 24bit + {f} moments"
    steps += [
      Step(f"{name}, clip_by_global_norm", mp("24bit", f, clip_then_adamw)),
      Step(f"{name}, skip=leaf, mpx.clipped_grad", mp("24bit", f, skip="leaf"), clip=1.0),
      Step(f"{name}, skip=leaf, clip_by_block_rms", mp("24bit", f, rms_then_adamw, skip="leaf")),
    ]
  for masters in ("remainder", "stochastic"):  # 4-bit moments clipped in two passes
    name = f"mpx {masters} + 4bit moments, skip=leaf, mpx.clipped_grad"
    steps.append(Step(name, mp(masters, "4bit", skip="leaf"), clip=1.0))
  steps.append(Step("mpx.scan_layers(optax adamw)", lambda: optax.adamw(1e-3)))
  for masters in SWEEP_MASTERS:
    for moments in SWEEP_MOMENTS if every_mode else FOUR_BIT:
      for skip in ("step", "leaf"):
        name = f"mpx.scan_layers({mode_name(masters, moments)}, skip={skip})"
        steps.append(Step(name, mp(masters, moments, skip=skip)))
  steps.append(
    Step(f"optax.MultiSteps(adamw, {K})", lambda: optax.MultiSteps(optax.adamw(1e-3), K))
  )
  r24 = mp("24bit", "4bit")
  steps.append(Step(f"optax.MultiSteps(mpx 24bit + 4bit, {K})", lambda: optax.MultiSteps(r24(), K)))
  for masters in SWEEP_MASTERS:
    for accumulator in ("bfloat16", "float32"):
      if accumulator == "float32" and masters not in ("remainder", "24bit"):
        continue
      make = lambda m=masters, a=accumulator: mpx.accumulate(mp(m, "4bit")(), K, accumulator=a)  # noqa: E731
      name = f"mpx.accumulate({masters} + 4bit, {K}, {accumulator})"
      steps += [Step(f"{name}, applying", make), Step(f"{name}, micro-step", make, True)]
  return steps


def table(model: Model, every_mode: bool = True) -> list[str]:
  """Renders the table's lines, printing each as it comes."""
  lines = [
    f"{model.blocks} MLP blocks of width {model.width}, batch {model.batch}, "
    f"{'scanned' if model.scanned else 'unrolled'}: {model.params / 1e6:.0f}M bfloat16 params; "
    f"compiled for an H100 by XLA (jax {jax.__version__}), not run. Bytes per param.",
    "",
    "| step | kept | transient | total | moved | conditionals |",
    "|:--|--:|--:|--:|--:|--:|",
  ]
  print("\n".join(lines), flush=True)
  topo = topology()
  for step in rows(every_mode):
    if step.name.startswith("mpx.scan_layers") and not model.scanned:
      continue
    if step.name.startswith("mpx.scan_layers"):
      row = measure_scan_layers(step.name, model, step.make(), topo)
    else:
      row = measure(step.name, model, step.make(), step.micro_step, topo, step.clip)
    lines.append(
      f"| {row.name} | {row.kept:.2f} | {row.transient:.2f} | {row.total:.2f} | "
      f"{row.moved:.1f} | {row.conditionals} |"
    )
    print(lines[-1], flush=True)
  return lines


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--blocks", type=int, default=8)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--scanned", action="store_true")
  parser.add_argument("--4bit-only", dest="every_mode", action="store_false", help="fewer rows")
  args = parser.parse_args(argv)
  table(Model(args.blocks, args.width, args.batch, args.scanned), args.every_mode)


if __name__ == "__main__":
  main()
