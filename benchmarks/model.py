"""A small decoder-only transformer for the whole-training-step benchmark.

Sized by ``ModelSize`` (``benchmarks/run.py``'s ``--model-*`` flags). No layer
sets ``dtype``, so flax computes in the parameters' dtype; the loss is float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class ModelSize:
  """Shape of the model and of one batch.

  Attributes:
    width: model width (embedding size).
    depth: number of transformer blocks.
    heads: attention heads (must divide ``width``).
    seq: tokens per sequence.
    batch: sequences per step.
    vocab: vocabulary size.
  """

  width: int = 256
  depth: int = 2
  heads: int = 4
  seq: int = 64
  batch: int = 8
  vocab: int = 512


class Block(nn.Module):
  """Pre-norm block: causal self-attention, then a 4x GELU MLP."""

  width: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm(use_bias=False)(x)
    x = x + nn.SelfAttention(num_heads=self.heads, use_bias=False)(h, mask=mask)
    h = nn.LayerNorm(use_bias=False)(x)
    h = nn.gelu(nn.Dense(4 * self.width, use_bias=False)(h))
    return x + nn.Dense(self.width, use_bias=False)(h)


class Transformer(nn.Module):
  """Token and position embeddings, ``depth`` blocks, a final norm, tied readout."""

  size: ModelSize

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    s = self.size
    embed = nn.Embed(s.vocab, s.width)
    positions = self.param("positions", nn.initializers.normal(0.02), (s.seq, s.width))
    x = embed(tokens) + positions[: tokens.shape[1]].astype(embed.embedding.dtype)
    for _ in range(s.depth):
      x = Block(s.width, s.heads)(x)
    x = nn.LayerNorm(use_bias=False)(x)
    return embed.attend(x)


def init_params(size: ModelSize, seed: int = 0) -> Any:
  """Initialises float32 parameters (one jitted init: quicker than flax's op by op)."""
  tokens = jnp.zeros((1, size.seq), jnp.int32)
  return jax.jit(Transformer(size).init)(jax.random.key(seed), tokens)["params"]


def make_batch(size: ModelSize, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  """Draws random ``(inputs, next-token targets)`` of shape ``(batch, seq)``."""
  tokens = jax.random.randint(jax.random.key(seed), (size.batch, size.seq + 1), 0, size.vocab)
  return tokens[:, :-1], tokens[:, 1:]


def loss_fn(size: ModelSize, params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
  """Computes the mean next-token cross-entropy, in float32."""
  logits = Transformer(size).apply({"params": params}, inputs).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
