"""A small byte-level decoder-only transformer and its data, for the demo and benchmarks.

The text is the Python standard library's own source, read from the running
interpreter's installation, so every machine has it without a download.

Import it from the repository root (``sys.path`` holding ``examples/``)::

  import lm
  train, valid = lm.load_corpus()
  model = lm.TransformerLM(lm.ModelConfig(), dtype=jnp.bfloat16)
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sysconfig
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB = 128  # ASCII; the few non-ASCII bytes in the stdlib map to 0
VALID_EVERY = 8  # every 8th file (in sorted order) is validation text


# --- Data ------------------------------------------------------------------------


def load_corpus() -> tuple[np.ndarray, np.ndarray]:
  """Returns (train, validation) byte arrays made of the stdlib's sources.

  The top-level ``*.py`` files of ``sysconfig.get_paths()['stdlib']`` are read
  in sorted order and every ``VALID_EVERY``-th goes to validation: the split is
  deterministic and by file, so no validation text is seen in training (random
  windows of one stream would overlap).

  Returns:
    Two uint8 arrays of byte ids below ``VOCAB``.
  """
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  # _sysconfigdata* is generated per machine; leave it out.
  files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_sysconfigdata"))
  train, valid = [], []
  for i, path in enumerate(files):
    (valid if i % VALID_EVERY == 0 else train).append(path.read_bytes())
  return _ascii(b"\n".join(train)), _ascii(b"\n".join(valid))


def _ascii(text: bytes) -> np.ndarray:
  data = np.frombuffer(text, np.uint8)
  return np.where(data < VOCAB, data, 0).astype(np.uint8)


def sample_batch(corpus: jax.Array, key: jax.Array, batch: int, context: int) -> jax.Array:
  """``batch`` random windows of ``context + 1`` bytes, as int32 ``[batch, context + 1]``.

  Runs on device (inside the jitted training chunk), so no batch ever crosses
  from the host. The same key gives the same batch in every mode.
  """
  starts = jax.random.randint(key, (batch,), 0, corpus.shape[0] - context - 1)
  return corpus[starts[:, None] + jnp.arange(context + 1)].astype(jnp.int32)


def eval_windows(corpus: np.ndarray, n: int, context: int) -> np.ndarray:
  """``n`` evenly spaced windows of ``context + 1`` bytes covering ``corpus``."""
  starts = np.linspace(0, corpus.shape[0] - context - 1, n).astype(np.int64)
  return corpus[starts[:, None] + np.arange(context + 1)].astype(np.int32)


# --- Model -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Transformer size.

  Attributes:
    layers: number of transformer blocks.
    width: model (residual stream) width.
    heads: attention heads; must divide ``width``.
    context: sequence length the model is trained on (positions are learned).
  """

  layers: int = 2
  width: int = 128
  heads: int = 4
  context: int = 128

  def __post_init__(self):
    if min(self.layers, self.width, self.heads, self.context) < 1:
      raise ValueError(f"every model size must be >= 1, got {self}")
    if self.width % self.heads:
      raise ValueError(f"heads ({self.heads}) must divide width ({self.width})")


def _normal(stddev: float) -> nn.initializers.Initializer:
  return nn.initializers.normal(stddev)


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention; the softmax runs in float32.

  Attributes:
    config: the model size.
    dtype: the compute dtype of the projections.
  """

  config: ModelConfig
  dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    head_dim = cfg.width // cfg.heads
    qkv = nn.DenseGeneral(
      (3, cfg.heads, head_dim), dtype=self.dtype, kernel_init=_normal(0.02), name="qkv"
    )(x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [batch, time, heads, head_dim]
    # Scaling q before the product keeps fp16 logits far from overflow.
    q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    time = x.shape[1]
    causal = jnp.tril(jnp.ones((time, time), jnp.bool_))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    # A 16-bit softmax would lose most of the attention weights' precision.
    weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    # GPT-2's scaled init of the projections into the residual stream.
    return nn.DenseGeneral(
      cfg.width,
      axis=(-2, -1),
      dtype=self.dtype,
      kernel_init=_normal(0.02 / math.sqrt(2 * cfg.layers)),
      name="out",
    )(out)


class Block(nn.Module):
  """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

  Attributes:
    config: the model size.
    dtype: the compute dtype.
  """

  config: ModelConfig
  dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    # LayerNorm computes its mean and variance in float32 whatever `dtype` is,
    # and returns `dtype`, so the matmuls that follow run in 16 bits.
    h = nn.LayerNorm(dtype=self.dtype, name="attn_norm")(x)
    x = x + CausalSelfAttention(cfg, self.dtype, name="attn")(h)
    h = nn.LayerNorm(dtype=self.dtype, name="mlp_norm")(x)
    h = nn.Dense(4 * cfg.width, dtype=self.dtype, kernel_init=_normal(0.02), name="mlp_in")(h)
    h = nn.Dense(
      cfg.width,
      dtype=self.dtype,
      kernel_init=_normal(0.02 / math.sqrt(2 * cfg.layers)),
      name="mlp_out",
    )(nn.gelu(h))
    return x + h


class TransformerLM(nn.Module):
  """Decoder-only byte-level language model with learned positions and tied embeddings.

  The params are created in float32 (``param_dtype``); cast them to train in
  16 bits. Every matmul computes in ``dtype``, which should be the params'
  dtype: flax would otherwise promote, and a float32 LayerNorm scale would
  drag the next matmul up to float32. The logits come out in float32.

  Attributes:
    config: the model size.
    dtype: the compute dtype (float32, bfloat16 or float16).
  """

  config: ModelConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Maps int tokens ``[batch, time]`` to float32 logits ``[batch, time, VOCAB]``."""
    cfg = self.config
    embed = nn.Embed(VOCAB, cfg.width, dtype=self.dtype, embedding_init=_normal(0.02))
    positions = self.param("positions", _normal(0.01), (cfg.context, cfg.width))
    x = embed(tokens) + positions[: tokens.shape[1]].astype(self.dtype)
    for i in range(cfg.layers):
      x = Block(cfg, self.dtype, name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=self.dtype, name="final_norm")(x)
    # Tied readout with float32 output: 16-bit logits would round the loss.
    table = embed.embedding.astype(self.dtype)
    return jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32)


def init_params(model: TransformerLM, seed: int) -> Any:
  """Float32 params of ``model`` from ``seed`` (jitted: one compile beats op-by-op init)."""
  dummy = jnp.zeros((1, model.config.context), jnp.int32)
  return jax.jit(model.init)(jax.random.key(seed), dummy)["params"]


def is_norm(path: str, leaf: Any) -> bool:
  """True for LayerNorm scales and biases (``where``-style predicate on a param path)."""
  del leaf
  return "norm" in path


def count_params(params: Any) -> int:
  """Number of scalars in ``params``."""
  return sum(x.size for x in jax.tree.leaves(params))


def token_losses(model: TransformerLM, params: Any, tokens: jax.Array) -> jax.Array:
  """Per-token next-byte cross-entropy ``[batch, time]``, in float32.

  ``tokens`` is ``[batch, context + 1]``: inputs are all but the last byte,
  targets all but the first.
  """
  logits = model.apply({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])


# --- Optimizer -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptConfig:
  """The optimizer every mode shares: AdamW with warmup and cosine decay.

  Attributes:
    steps: total training steps (the schedule decays to 0 at the end).
    peak_lr: learning rate after warmup.
    warmup: warmup steps.
    weight_decay: decoupled weight decay on matrices (not on norms, biases, positions).
    clip: global gradient-norm clip, or None for none (it costs compile time
      on the CPU, and this small model trains stably without it).
  """

  steps: int
  peak_lr: float = 3e-3
  warmup: int = 100
  weight_decay: float = 0.1
  clip: float | None = None


def adamw(config: OptConfig) -> optax.GradientTransformation:
  """The base rule, identical in every mode; mpx wraps it, never changes it."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.peak_lr,
    warmup_steps=min(config.warmup, max(1, config.steps // 2)),
    decay_steps=config.steps,
  )

  def decay_mask(params):
    # Matrices and the embedding table decay; vectors (norms, biases) do not.
    # The learned positions are a matrix too, but decaying them is harmless.
    return jax.tree.map(lambda x: x.ndim >= 2, params)

  tx = optax.adamw(schedule, weight_decay=config.weight_decay, mask=decay_mask)
  if config.clip is None:
    return tx
  # Inside mpx the clip sees float32 gradients, already unscaled: their true norm.
  return optax.chain(optax.clip_by_global_norm(config.clip), tx)
