"""The parameter trees, arrays and gradients the optimizer-step benchmarks share."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
F32 = jnp.float32
F16 = jnp.float16
BF16 = jnp.bfloat16
SCALE = 2.0**15  # the loss scale the fp16 gradients were made with
LR = 1e-3


def adam() -> optax.GradientTransformation:
  """Returns the Adam every optimizer-step variant runs."""
  return optax.adam(LR)


def param_shapes(n_params: int, layers: int = 4) -> dict[str, Any]:
  """Builds a transformer-shaped tree of about ``n_params`` parameter shapes.

  ``layers`` blocks of width ``d`` (qkv ``d x 3d``, attention output ``d x d``,
  MLP ``d x 4d`` and ``4d x d``, two norm scales), a final norm, and an
  embedding whose vocabulary makes up the rest. ``d`` is the largest power of
  two that leaves the embedding at least a quarter of the parameters.
  """
  per_width_sq = 12 * layers
  d = 2 ** max(3, math.floor(math.log2(math.sqrt(0.75 * n_params / per_width_sq)) + 1e-9))
  blocks = layers * (12 * d * d + 2 * d) + d
  vocab = max(1, (n_params - blocks) // d)
  tree: dict[str, Any] = {"embed": {"embedding": (vocab, d)}}
  for i in range(layers):
    tree[f"block_{i}"] = {
      "attn": {"qkv": {"kernel": (d, 3 * d)}, "out": {"kernel": (d, d)}},
      "ln1": {"scale": (d,)},
      "ln2": {"scale": (d,)},
      "mlp": {"up": {"kernel": (d, 4 * d)}, "down": {"kernel": (4 * d, d)}},
    }
  tree["ln_f"] = {"scale": (d,)}
  return tree


def many_leaf_shapes(leaves: int, side: int = 128) -> dict[str, Any]:
  """Builds a tree of ``leaves`` square ``side x side`` shapes, in blocks of ten.

  Per-leaf costs (a kernel launch, a reduction, a branch operand) dominate
  here, where the transformer-shaped trees' few large leaves hide them.
  """
  tree: dict[str, Any] = {}
  for i in range(leaves):
    tree.setdefault(f"block_{i // 10:03d}", {})[f"w{i % 10}"] = (side, side)
  return tree


def is_shape(x: Any) -> bool:
  """Tells whether ``x`` is a leaf of a tree of shapes."""
  return isinstance(x, tuple)


def n_params(shapes: PyTree) -> int:
  """Counts the parameters of a tree of shapes."""
  return sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=is_shape))


def make_arrays(shapes: PyTree, seed: int = 0) -> tuple[PyTree, PyTree]:
  """Draws float32 ``(params, grads)`` with the shapes of ``shapes``, on the device.

  Drawn with numpy on the host: jax's threefry would take longer to compile
  for each leaf shape than numpy takes to draw 64M numbers.
  """
  rng = np.random.default_rng(seed)

  def draw(scale):
    return lambda s: jnp.asarray(scale * rng.standard_normal(s, dtype=np.float32))

  params = jax.tree.map(draw(0.02), shapes, is_leaf=is_shape)
  grads = jax.tree.map(draw(1e-3), shapes, is_leaf=is_shape)
  return params, grads


@functools.partial(jax.jit, static_argnums=1)
def copy_tree(tree: PyTree, dtype: Any = None) -> PyTree:
  """Makes a fresh device copy (optionally cast): donated buffers must not be shared."""
  return jax.tree.map(lambda x: jnp.array(x, dtype or x.dtype, copy=True), tree)


def with_inf(grads: PyTree) -> PyTree:
  """Replaces the last (smallest) leaf of ``grads`` by infs; other leaves are shared."""
  leaves, treedef = jax.tree.flatten(grads)
  leaves[-1] = jnp.full_like(leaves[-1], jnp.inf)
  return treedef.unflatten(leaves)


class Grads(NamedTuple):
  """The gradients the variants consume; not donated, so shared between them.

  Attributes:
    f32: float32 gradients (plain Adam).
    bf16: the same in bfloat16 (mpx bf16, no loss scale).
    f16: float16 gradients of a loss multiplied by ``SCALE`` (every fp16 variant;
      the hand-written ones, which do not unscale, take them as they are).
  """

  f32: PyTree
  bf16: PyTree
  f16: PyTree


@jax.jit
def make_grads(g32: PyTree) -> Grads:
  """Casts float32 gradients to every dtype the variants consume."""
  return Grads(
    f32=g32,
    bf16=jax.tree.map(lambda g: g.astype(BF16), g32),
    f16=jax.tree.map(lambda g: (g * SCALE).astype(F16), g32),
  )
