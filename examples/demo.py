"""Mixed-precision training demo: a small transformer LM in FP32, bf16 and fp16, side by side.

A byte-level decoder-only transformer (``examples/lm.py``) learns to predict
the Python standard library's own source (no download; split into train and
validation by file). It is trained from one FP32 initialisation, on the same
batches, once per row of :data:`ROWS`; a row names its params' dtype, the
transformation it wraps the shared AdamW in, and the bound its final
validation loss must meet:

* ``fp32``: plain optax (AdamW, warmup and cosine decay to 0), the reference.
* ``bf16+mpx``: bf16 params and compute with ``mpx.mixed_precision(adamw)``:
  float32 master weights and Adam moments live in the optimizer state
  (12 bytes per parameter).
* ``bf16 stochastic``: ``masters="stochastic"``: no master at all (8 bytes per
  parameter, as FP32); each bf16 param is updated in float32 and rounded up or
  down at random, so updates below half an ulp survive in expectation.
* ``bf16 remainder + 8bit moments``: ``masters="remainder", moments="8bit"``:
  only the low 16 bits of each float32 master are stored (an int16; the bf16
  param is the high half), bitwise the same masters as ``bf16+mpx``
  (tests/test_masters.py proves it over whole runs), and each of Adam's
  moments one byte per element plus a float32 scale per block of its last
  axis (at most 256 elements): about 4 bytes per parameter, exact masters.
* ``bf16 24bit + 4bit moments``: ``masters="24bit", moments="4bit"``: the
  top 8 bits of the remainder (a 24-bit master, rounded to nearest each
  step) and half a byte per moment and element, a float32 scale per block of
  at most 128: about 2 bytes per parameter, the leanest state with a master.
* ``bf16 24bit + 4bit accumulate 4``: the same, each step's batch split in
  4 micro-batches: ``mpx.accumulate(..., 4, accumulator="bfloat16")`` holds
  their running mean (2 more bytes per parameter), the first three only
  added by ``mpx.accumulate_gradients``; it must follow FP32 as its
  unaccumulated twin does.
* ``bf16 stochastic + 4bit moments``: no master and 4-bit moments, about 1
  byte per parameter; within 1% of FP32, as ``bf16 stochastic``.
* ``fp16+mpx+scale``: fp16 params and compute with
  ``mpx.loss_scale(mpx.mixed_precision(adamw))``, differentiating
  ``mpx.scale_loss(loss, opt_state)``.
* ``bf16 no masters``: bf16 params with plain optax, to show what goes wrong
  without mpx: every update smaller than half a bf16 ulp of its weight (weight
  decay, the small steps late in the cosine schedule) is rounded away.

Those byte counts are for AdamW on large leaves. mpx compresses only leaves
of at least 4,096 elements (under ``"8bit"`` with a last axis of at least 16,
under ``"4bit"`` of at least 6; smaller leaves stay float32), and the table's
``state B/param`` counts every byte. At the default size 98% of the params
(110,592 of 112,384) have compressed moments: the table shows 4.27 for 8 bits,
2.30 and 1.30 for 4 bits (4.30 with the accumulator), whose extra 0.27 and
0.30 are the small leaves' float32 moments (0.13) and the blocks' scales
(most of them the attention's ``qkv`` kernel, whose last axis, the head size,
is 16: a float32 scale per 16 elements). At the smoke size only 69% do
(12,288 of 17,888: the embedding and the MLP; the positions and attention
kernels are under 4,096 elements): 6.01, 4.32 (6.32 with the accumulator)
and 3.32.

In every row the attention softmax and the final softmax/cross-entropy run in
float32; everything else computes in the params' dtype. The whole run of each
row is a few jitted ``lax.scan`` chunks of steps that return the per-step loss
and loss scale, fetched one chunk behind, so the host never waits on a step.
Each row compiles its own step (its optimizer state has its own structure);
the rows compile side by side, one per core, before the first one trains,
and then train side by side too (``--jobs``, by default the CPU's cores: a
step of this small model keeps about one core busy), so each row's tokens/s
is measured while others run beside it.

Run from the repository root::

  python examples/demo.py                 # default: about 3 min on 2 quiet CPU cores
  python examples/demo.py --smoke         # tiny, under a minute (CI); or MPX_SMOKE=1
  python examples/demo.py --layers 6 --width 384 --heads 6 --context 256 \\
      --batch 64 --steps 5000 --lr 1e-3   # on a GPU

It prints a table with a line per row and writes a plot (``--out``, default
``demo_results/demo.png``). Unless ``--no-check``, it checks the outcome and
exits with status 1 unless every mpx row ends within its tolerance of the
FP32 validation loss, above or below (0.5%; 1% for the rows with stochastic
rounding or 4-bit moments), and
``bf16 no masters`` ends more than 2% above it (``--tolerance`` and
``--min-gap`` override the bounds). With ``--smoke`` (too small to mean
anything about losses) nothing is checked. ``--rows`` trains only some rows;
``--skip leaf`` trains the bf16 mpx rows with ``skip="leaf"`` (each leaf
updated as its gradient arrives; where no gradient is non-finite, the
default step's losses to the last bit under
``XLA_FLAGS=--xla_allow_excess_precision=false``, tests/test_demo.py);
``--json`` writes the run's numbers for scripts (``benchmarks/demo_matrix.py``).
Where XLA cannot compile float16 (x86 CPUs without F16C, from before 2012)
the fp16 row is skipped, with a note.

How the bounds and the settings were chosen. The losses depend on the machine:
XLA:CPU picks its kernels, vectorisation and fused multiply-adds by the CPU's
features (AVX2, AVX-512, native bf16 dot products) and its own version, so the
last bits of each step differ between machines and the differences grow over
the run; a rerun on one machine and version repeats the losses bit for bit. So
every run is one draw, and a bound must hold on every machine and seed, not
just on the run that set it. The bounds say what each row must deliver: 0.5%
for the rows with masters (float32, its low half beside the bf16 param, or
its top 24 bits) and float32 or 8-bit moments, and fp16 with loss scaling,
whose update is FP32's but for the 16-bit forward and backward pass (and
the 8-bit moments' rounding, whose noise spreads the runs a little); 1% for
the two stochastic rounding rows, which keep no master and follow one only
in expectation, and for the 4-bit moments, whose rounding noise spreads the
runs about FP32's loss two to three times as far (below;
docs/concepts_masters.md, "Which moments to pick", measures each format's
spread); more than 2% for bf16 without masters, which must visibly fall
off FP32's curve. The settings were then chosen so that each effect is
many times the spread between runs, and ``benchmarks/demo_matrix.py``
measures that spread over seeds and instruction sets
(``XLA_FLAGS=--xla_cpu_max_isa=...``): its table, ``docs/demo_matrix.md``,
gives each row's range, and the README says what they show. The bounds are
two-sided: a row that trains faster than FP32 fails as one that trains
slower does, since it is another optimizer all the same.

* Peak learning rate 1e-3 (it was 3e-3). An update below half a bf16 ulp of
  its weight is rounded away without masters, and the fraction of such updates
  grows as the learning rate shrinks (late in the cosine schedule, or a lower
  peak) and with weight decay, whose per-step shrink ``lr * wd`` (1e-4 at the
  peak) is far below bf16's relative precision of ``2**-9``. This tiny model
  tolerates unusually large steps (relative to its weights, larger than big
  models take), and at 3e-3 enough of them survived rounding that bf16 without
  masters ended only +2.3% to +3.1% above FP32 on one Xeon (seeds 0 to 2),
  against its 2% bound, while the mpx rows spread over 0.9% on the same
  machine. At 1e-3 it ends +3.63% to +4.66% above FP32 over the matrix, while
  the rows with exact masters and float32 or 8-bit moments stay within -0.23%
  to +0.04%. Larger peaks
  shrink that gap again: other sizes and learning rates may need
  ``--no-check``.
* 4,096 validation windows of 65 bytes (266,240 of the 451,465 validation
  bytes; it was 1,024): the gaps compare the rows on the same text, and a
  larger sample of it leaves less room for one row to be favoured by chance.
* The rows with stochastic rounding or 4-bit moments are random variables
  (the seed also seeds the rounding): each run is one draw, and a bound is
  judged against the draws' spread. Over seeds 0 to 9 ``bf16 24bit + 4bit
  moments`` averages -0.13% with a standard deviation of 0.24%
  (docs/concepts_masters.md, "Which moments to pick"), so about one draw in
  7,000 would land beyond 1% if they were normal, but one in 15 beyond 0.5%:
  the 4-bit rows keep 1%. Over the matrix ``bf16 24bit + 4bit accumulate 4``
  keeps less than half its bound to spare (-0.57% at seed 0).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import lm
import numpy as np
import optax
from tqdm import tqdm

import mpx


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a run, shared by all rows."""

  model: lm.ModelConfig
  opt: lm.OptConfig
  batch: int
  chunk: int  # steps per jitted lax.scan call
  eval_windows: int
  growth_interval: int
  fp32_norms: bool
  seed: int
  skip: str = "step"  # mixed_precision's skip= in the rows without a loss scale


# --- The rows: the only row-specific code ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
  """One way to train the model: a line of the table, and what it must show.

  Attributes:
    name: the row's name in the table.
    dtype: the params' dtype, which is also the compute dtype.
    tx: ``tx(adamw, settings)``: the transformation, from the AdamW every row shares.
    tolerance: if set, the row's validation loss must end within this
      relative gap of FP32's, above or below (``--tolerance`` overrides it).
    worse_by: if set, the row must end more than this relative gap above
      FP32's validation loss (``--min-gap`` overrides it).
    masters: whether ``tx`` keeps a float32 master of every 16-bit param: the
      row then starts with its masters seeded from the exact FP32 weights
      (``mpx.init_from_full_precision``; ``tx.init`` on cast params could only
      recover rounded ones). Otherwise it starts from the cast params.
    rounded_masters: whether those masters keep fewer bits than the FP32
      weights (``masters="24bit"``): they then start at the weights' rounding
      (``allow_rounding=True``).
    micro_batches: into how many micro-batches each step's batch is split
      (fewer where the batch does not divide: their greatest common
      divisor, as ``tx`` must count them); all but the last are added by
      ``mpx.accumulate_gradients`` (``tx`` is an ``mpx.accumulate``), so each
      step sees the same data as every row.
  """

  name: str
  dtype: Any
  tx: Callable[[optax.GradientTransformation, Settings], optax.GradientTransformation]
  tolerance: float | None = None
  worse_by: float | None = None
  masters: bool = True
  rounded_masters: bool = False
  micro_batches: int = 1


BF16, FP16 = jnp.bfloat16, jnp.float16
ACCUMULATED = 4  # micro-batches a step in the accumulation row
# The first row is the reference. PyTorch's growth_interval of 2000 suits long
# runs; fp16's shorter one lets this run show the loss scale grow, overflow
# fp16 (that step is skipped) and back off. The bounds are the module
# docstring's: 0.5% with a master and float32 or 8-bit moments, 1% without a
# master (stochastic rounding follows one only in expectation) or with 4-bit
# moments (whose noise spreads the runs: benchmarks/demo_spread.py).
ROWS = (
  Row("fp32", jnp.float32, lambda adamw, s: adamw, masters=False),
  Row("bf16+mpx", BF16, lambda adamw, s: mpx.mixed_precision(adamw, skip=s.skip), tolerance=0.005),
  Row(
    "bf16 stochastic",
    BF16,
    lambda adamw, s: mpx.mixed_precision(adamw, masters="stochastic", seed=s.seed, skip=s.skip),
    tolerance=0.01,
    masters=False,
  ),
  Row(
    "bf16 remainder + 8bit moments",
    BF16,
    lambda adamw, s: mpx.mixed_precision(
      adamw, masters="remainder", moments="8bit", seed=s.seed, skip=s.skip
    ),
    tolerance=0.005,
  ),
  Row(
    "bf16 24bit + 4bit moments",
    BF16,
    lambda adamw, s: mpx.mixed_precision(
      adamw, masters="24bit", moments="4bit", seed=s.seed, skip=s.skip
    ),
    tolerance=0.01,
    rounded_masters=True,
  ),
  Row(
    "bf16 24bit + 4bit accumulate 4",
    BF16,
    lambda adamw, s: mpx.accumulate(
      mpx.mixed_precision(adamw, masters="24bit", moments="4bit", seed=s.seed, skip=s.skip),
      math.gcd(ACCUMULATED, s.batch),  # as one_step splits the batch
      accumulator="bfloat16",
    ),
    tolerance=0.01,
    rounded_masters=True,
    micro_batches=ACCUMULATED,
  ),
  Row(
    "bf16 stochastic + 4bit moments",
    BF16,
    lambda adamw, s: mpx.mixed_precision(
      adamw, masters="stochastic", moments="4bit", seed=s.seed, skip=s.skip
    ),
    tolerance=0.01,
    masters=False,
  ),
  Row(
    "fp16+mpx+scale",
    FP16,
    lambda adamw, s: mpx.loss_scale(mpx.mixed_precision(adamw), growth_interval=s.growth_interval),
    tolerance=0.005,
  ),
  Row("bf16 no masters", BF16, lambda adamw, s: adamw, worse_by=0.02, masters=False),
)
ROW_BY_NAME = {row.name: row for row in ROWS}
MODES = tuple(ROW_BY_NAME)  # the rows' names, in the table's order


# Presets for the flags: (layers, width, heads, context, batch, steps, warmup,
# chunk, eval windows, growth interval). The default is sized for a 2-core CPU:
# 800 steps of 16 sequences cost what 400 of 32 do (the step's time is the
# tokens'), and the twice as many updates take every seed we tried (0, 1, 2)
# out of the steep early descent, where a last-bit difference still moves the
# final loss by a percent: at 400 x 32, bf16 without masters ended +3.6%,
# +1.4%, +1.5% above FP32 and stochastic rounding -1.2% below; at 800 x 16,
# +2.7%, +3.0%, +3.3%, with every mpx row within 0.6% (peak lr 3e-3 then; see
# the docstring for why it is now 1e-3, and docs/demo_matrix.md for the spread
# over seeds and instruction sets). 4,096 validation windows of 65 bytes are
# 59% of the validation text.
DEFAULT = dict(
  layers=2,
  width=64,
  heads=4,
  context=64,
  batch=16,
  steps=800,
  warmup=40,
  chunk=50,
  eval_windows=4096,
  growth_interval=100,
)
SMOKE = dict(
  layers=1,
  width=32,
  heads=2,
  context=32,
  batch=8,
  steps=40,
  warmup=4,
  chunk=20,
  eval_windows=64,
  growth_interval=10,
)


def make_optimizer(
  row: Row, settings: Settings
) -> tuple[optax.GradientTransformation, Callable[[Any], tuple[Any, optax.OptState]]]:
  """Returns ``(tx, init)`` for ``row``.

  Args:
    row: one of ``ROWS``.
    settings: the run's settings.

  Returns:
    The transformation, and ``init(fp32_params) -> (params, opt_state)`` which
    starts the row from the shared FP32 weights, with the params in the row's
    dtype.
  """
  tx = row.tx(lm.adamw(settings.opt), settings)
  # By default every param is cast, LayerNorm scales included: mpx's float32
  # masters keep their small updates, and a bf16 gain is rounded no worse than
  # any weight. Without masters the gains suffer most: next to 1.0 an update
  # must exceed 2**-8 to round up, more than the peak learning rate.
  # --fp32-norms keeps them in float32 in every 16-bit row (mixed_precision
  # then gives them no master and updates them directly).
  where = (lambda path, leaf: not lm.is_norm(path, leaf)) if settings.fp32_norms else None
  if row.masters:
    return tx, lambda params: mpx.init_from_full_precision(
      tx, params, row.dtype, where, allow_rounding=row.rounded_masters
    )

  def init(params):
    params = mpx.cast_tree(params, row.dtype, where)
    return params, tx.init(params)

  return tx, init


# --- Training --------------------------------------------------------------------


@dataclasses.dataclass
class Result:
  """What one row produced: the table's line and the plot's curves."""

  mode: str  # the row's name
  param_dtype: str
  train_loss: float  # mean over the last chunk of steps
  val_loss: float
  tokens_per_s: float
  state_bytes_per_param: float
  skipped_steps: int | None
  loss_scale: float | None
  params: Any  # the final params, on the host
  losses: np.ndarray  # per step
  scales: np.ndarray  # per step: the scale that step's loss was multiplied by
  finite: np.ndarray  # per step: whether it was applied


@dataclasses.dataclass
class Prepared:
  """A row ready to train: its starting params and state, and its step, lowered
  (then compiled) once per chunk length."""

  row: Row
  model: lm.TransformerLM
  params: Any
  opt_state: optax.OptState
  sizes: list[int]  # the chunks' lengths, in order
  chunks: dict[int, Any]  # chunk length -> its jitted scan: jax Lowered, then Compiled


def prepare(row: Row, settings: Settings, data: dict[str, jax.Array], fp32_params: Any) -> Prepared:
  """Starts ``row`` from ``fp32_params`` and lowers its training chunks.

  Args:
    row: one of ``ROWS``.
    settings: the run's settings.
    data: ``"train"`` (device uint8 corpus) and ``"valid"`` (windows, int32).
    fp32_params: the shared FP32 initialisation (not modified).

  Returns:
    The row, lowered: :func:`compile_all` compiles it, :func:`train` runs it.
  """
  steps, batch, context = settings.opt.steps, settings.batch, settings.model.context
  tx, init = make_optimizer(row, settings)
  # One compiled call instead of dozens of small ones; on a fresh copy, since
  # the training chunks donate (delete) their inputs.
  params, opt_state = jax.jit(lambda p: init(jax.tree.map(jnp.copy, p)))(fp32_params)
  # Compute in the params' dtype (norms kept in float32 by --fp32-norms included).
  model = lm.TransformerLM(settings.model, dtype=jnp.dtype(row.dtype))

  def run_chunk(params, opt_state, corpus, key, step_ids):
    def one_step(carry, step_id):
      params, opt_state = carry
      # The batch depends only on the step number: the same in every row.
      tokens = lm.sample_batch(corpus, jax.random.fold_in(key, step_id), batch, context)

      def scaled_loss(p, tokens):
        loss = lm.token_losses(model, p, tokens).mean()
        # Times the loss scale held in opt_state, or times 1 where it holds
        # none, so this one step serves every row.
        return mpx.scale_loss(loss, opt_state), loss

      # With accumulation, the batch in micro-batches: all but the last only
      # add their gradients to the accumulator, the last one ends the window.
      micro = tokens.reshape(math.gcd(row.micro_batches, batch), -1, *tokens.shape[1:])
      losses = []
      for tokens in micro[:-1]:
        grads, loss = jax.grad(scaled_loss, has_aux=True)(params, tokens)
        opt_state = mpx.accumulate_gradients(grads, opt_state)
        losses.append(loss)
      grads, loss = jax.grad(scaled_loss, has_aux=True)(params, micro[-1])
      loss = jnp.mean(jnp.stack([*losses, loss]))
      scale = mpx.get_loss_scale(opt_state)  # the scale this step's loss used
      # mpx unscales the gradients itself, skips steps with inf/NaN gradients,
      # and returns float32 updates that land each 16-bit param on its master.
      updates, opt_state = tx.update(grads, opt_state, params)
      finite = optax.tree.get(opt_state, "last_step_finite", jnp.asarray(True))
      return (optax.apply_updates(params, updates), opt_state), (loss, scale, finite)

    (params, opt_state), trace = jax.lax.scan(one_step, (params, opt_state), step_ids)
    return params, opt_state, trace

  chunk = min(settings.chunk, steps)
  sizes = [chunk] * (steps // chunk) + ([steps % chunk] if steps % chunk else [])
  key = jax.random.key(settings.seed)
  # Donating params and opt_state lets XLA update them in place.
  jitted = jax.jit(run_chunk, donate_argnums=(0, 1))
  lowered = {
    n: jitted.lower(params, opt_state, data["train"], key, jnp.arange(n))
    for n in sorted(set(sizes))
  }
  return Prepared(row, model, params, opt_state, sizes, lowered)


def compile_all(prepared: list[Prepared]) -> float:
  """Compiles every row's step ahead of training, and returns the seconds it took.

  The rows cannot share compiled code (each optimizer state has its own
  structure), but XLA compiles a program on one thread without holding
  Python's lock, so on several cores the rows compile side by side; and
  tokens/s then counts no compilation.
  """
  start = time.perf_counter()
  jobs = [(p, n) for p in prepared for n in p.chunks]
  with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
    done = list(pool.map(lambda job: job[0].chunks[job[1]].compile(), jobs))
  for (p, n), compiled in zip(jobs, done, strict=True):
    p.chunks[n] = compiled
  return time.perf_counter() - start


def train_all(
  prepared: list[Prepared], settings: Settings, data: dict[str, jax.Array], jobs: int
) -> list[Result]:
  """Trains the compiled rows, ``jobs`` side by side, and returns their results in order.

  A step of this small model keeps about one core busy, and XLA runs each
  thread's programs without holding Python's lock, so on several cores rows
  train side by side; a row's bits do not depend on what runs beside it.
  """
  with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
    futures = [pool.submit(train, p, settings, data, line) for line, p in enumerate(prepared)]
    return [future.result() for future in futures]


def train(
  prepared: Prepared, settings: Settings, data: dict[str, jax.Array], line: int = 0
) -> Result:
  """Trains a compiled row (see :func:`compile_all`) and evaluates it.

  Args:
    prepared: the row, compiled; its params and state are consumed.
    settings: the run's settings.
    data: ``"train"`` (device uint8 corpus) and ``"valid"`` (windows, int32).
    line: the row's progress bar's line on the terminal.

  Returns:
    The row's :class:`Result`.
  """
  row, model, params, opt_state = prepared.row, prepared.model, prepared.params, prepared.opt_state
  prepared.params = prepared.opt_state = None  # donated to the first chunk
  steps, batch, context = settings.opt.steps, settings.batch, settings.model.context
  key = jax.random.key(settings.seed)
  has_scale = optax.tree.get(opt_state, "loss_scale") is not None

  traces = []
  width = max(map(len, MODES))
  desc = f"{row.name:<{width}}"
  bar = tqdm(total=steps, desc=desc, unit="step", position=line, leave=True, file=sys.stderr)

  def collect(trace):
    trace = jax.tree.map(np.asarray, trace)
    traces.append(trace)
    bar.update(trace[0].size)
    postfix = {"loss": f"{trace[0][-1]:.3f}"}
    if has_scale:
      postfix["scale"] = f"{trace[1][-1]:g}"
    bar.set_postfix(postfix)

  start, pending = time.perf_counter(), None
  first = 0
  for n in prepared.sizes:
    step_ids = jnp.arange(first, first + n)
    params, opt_state, trace = prepared.chunks[n](params, opt_state, data["train"], key, step_ids)
    first += n
    # Fetch the previous chunk's trace while this one runs: never idle the device.
    if pending is not None:
      collect(pending)
    pending = trace
  collect(pending)
  seconds = time.perf_counter() - start
  bar.close()

  losses, scales, finite = (np.concatenate(x) for x in zip(*traces, strict=True))
  # optax.tree.get finds mpx's state fields by name at any depth (None if absent).
  skipped = optax.tree.get(opt_state, "skipped_steps")
  scale = optax.tree.get(opt_state, "loss_scale")
  return Result(
    mode=row.name,
    param_dtype=model.dtype.name,
    train_loss=float(losses[-prepared.sizes[0] :].mean()),
    val_loss=float(validation_loss(model, params, data["valid"])),
    tokens_per_s=steps * batch * context / seconds,
    state_bytes_per_param=state_bytes(opt_state) / lm.count_params(params),
    skipped_steps=None if skipped is None else int(skipped),
    loss_scale=None if scale is None else float(scale),
    params=jax.tree.map(np.asarray, params),
    losses=losses,
    scales=scales,
    finite=finite,
  )


def state_bytes(opt_state: optax.OptState) -> int:
  """Bytes of the floating and integer arrays in ``opt_state``: moments,
  masters, remainders, rounding keys, counters and the loss scale."""
  return sum(
    x.nbytes
    for x in jax.tree.leaves(opt_state)
    if jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
  )


@functools.partial(jax.jit, static_argnums=0)
def validation_loss(model: lm.TransformerLM, params: Any, batches: jax.Array) -> jax.Array:
  """Mean per-token loss over ``batches`` ``[n, batch, context + 1]`` of validation windows.

  The model is evaluated as trained, in the params' dtype: that is the model a
  mixed-precision run delivers (``mpx.master_params(opt_state, params)``
  would give the float32 masters instead). One compiled call per model and
  dtype: the bf16 rows share it.
  """
  return jax.lax.map(lambda tokens: lm.token_losses(model, params, tokens).mean(), batches).mean()


# --- Report ----------------------------------------------------------------------


def eval_batches(corpus: np.ndarray, n: int, context: int, batch: int = 128) -> np.ndarray:
  """``n`` evenly spaced validation windows as ``[n / batch, batch, context + 1]``.

  ``n`` is rounded up to a whole number of batches (of at most ``batch``).
  """
  batch = min(batch, n)
  count = -(-n // batch)
  return lm.eval_windows(corpus, count * batch, context).reshape(count, batch, context + 1)


def relative_gap(result: Result, reference: Result) -> float:
  """Relative validation-loss gap of ``result`` to ``reference`` (positive: worse)."""
  return (result.val_loss - reference.val_loss) / reference.val_loss


NAME_WIDTH = max(19, 1 + max(map(len, MODES)))
TABLE_HEADER = (
  f"{'mode':<{NAME_WIDTH}}{'params':>9}{'train loss':>11}{'val loss':>9}{'vs fp32':>9}"
  f"{'tokens/s':>10}{'state B/param':>14}{'skipped':>8}{'loss scale':>11}"
)


def table_lines(results: list[Result]) -> list[str]:
  """One line per row, FP32 (the first) as the reference, and a legend."""
  reference = results[0]
  lines = [TABLE_HEADER, "-" * len(TABLE_HEADER)]
  for r in results:
    lines.append(
      f"{r.mode:<{NAME_WIDTH}}{r.param_dtype:>9}{r.train_loss:>11.4f}{r.val_loss:>9.4f}"
      f"{relative_gap(r, reference):>+9.2%}{r.tokens_per_s:>10,.0f}"
      f"{r.state_bytes_per_param:>14.2f}"
      f"{'-' if r.skipped_steps is None else r.skipped_steps:>8}"
      f"{'-' if r.loss_scale is None else f'{r.loss_scale:g}':>11}"
    )
  return [
    *lines,
    "losses: nats per byte; train loss: mean of the last chunk of steps; vs fp32: relative",
    "validation-loss gap; state B/param: optimizer-state bytes per parameter. On a CPU the",
    "16-bit rows are no faster than FP32: their speed-up needs a GPU's or TPU's 16-bit units.",
  ]


def check(
  results: list[Result],
  tolerance: float | None = None,
  min_gap: float | None = None,
  gaps: bool = True,
) -> tuple[bool, list[str]]:
  """An OK or FAIL line per claim its row makes (see :class:`Row`), and whether all hold.

  With ``gaps`` (not for the smoke size, too small to mean anything), a row
  with a ``tolerance`` must end within it of the first row's (FP32's)
  validation loss, and a row with ``worse_by`` more than that above it.

  Args:
    results: one per row, FP32's first.
    tolerance: if not None, replaces every row's ``tolerance``.
    min_gap: if not None, replaces every row's ``worse_by``.
    gaps: whether to check the gaps to FP32.

  Returns:
    ``(all hold, lines)``.
  """
  rows = [ROW_BY_NAME[r.mode] for r in results]
  ok, lines = True, []
  if not gaps:
    return ok, lines
  reference = results[0]
  for r, row in zip(results, rows, strict=True):
    if row.tolerance is None:
      continue
    bound = row.tolerance if tolerance is None else tolerance
    gap = relative_gap(r, reference)
    good = abs(gap) <= bound
    ok &= good
    lines.append(
      f"{'OK' if good else 'FAIL'}: {r.mode} validation loss {gap:+.2%} vs FP32 "
      f"(must be within {bound:.1%} of it)"
    )
  for r, row in zip(results, rows, strict=True):
    if row.worse_by is None:
      continue
    bound = row.worse_by if min_gap is None else min_gap
    gap = relative_gap(r, reference)
    good = gap > bound
    ok &= good
    lines.append(
      f"{'OK' if good else 'FAIL'}: {r.mode} validation loss {gap:+.2%} vs FP32 "
      f"(must be worse by more than {bound:.1%})"
    )
  return ok, lines


def smooth(x: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
  """Moving average of ``x`` and the step each value belongs to (its window's end)."""
  window = max(1, min(window, x.size))
  averaged = np.convolve(x, np.ones(window) / window, mode="valid")
  return np.arange(window, x.size + 1), averaged


def plot(results: list[Result], path: pathlib.Path, title: str) -> None:
  """Writes the loss curves, their gap to FP32 and the fp16 loss scale to ``path``."""
  import matplotlib

  matplotlib.use("Agg")  # no display needed
  import matplotlib.pyplot as plt

  window = max(1, results[0].losses.size // 40)
  fig, (ax_loss, ax_gap, ax_scale) = plt.subplots(
    3, 1, figsize=(9, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.5]}
  )
  reference = smooth(results[0].losses, window)[1]
  for i, r in enumerate(results):
    steps, loss = smooth(r.losses, window)
    label = f"{r.mode} (val {r.val_loss:.3f})"
    # FP32, the reference the others nearly cover, is drawn black and on top.
    style = dict(color=f"C{i}", lw=1.2, ls="-")
    if i == 0:
      style = dict(color="k", lw=1.6, ls=":", zorder=10)
    ax_loss.plot(steps, loss, label=label, **style)
    ax_gap.plot(steps, 100 * (loss - reference) / reference, label=r.mode, **style)
  ax_loss.set_ylabel(f"train loss (nats/byte,\nmean of {window} steps)")
  ax_loss.set_title(title, fontsize=10)
  ax_loss.legend(fontsize=8)
  ax_loss.grid(alpha=0.3)
  lo = min(smooth(r.losses, window)[1].min() for r in results)
  ax_loss.set_ylim(lo - 0.05, lo + 1.5)  # the interesting, late part of training
  ax_gap.axhline(0, color="k", lw=0.5)
  ax_gap.set_ylabel("train loss vs fp32 (%)")
  ax_gap.legend(fontsize=8, ncol=2)
  ax_gap.grid(alpha=0.3)
  for i, r in enumerate(results):
    if r.loss_scale is not None:
      steps = np.arange(1, r.scales.size + 1)
      ax_scale.step(steps, r.scales, where="post", color=f"C{i}", label=f"{r.mode} loss scale")
      skipped = ~r.finite.astype(bool)
      ax_scale.plot(
        steps[skipped], r.scales[skipped], "rx", label=f"skipped step ({skipped.sum()})"
      )
      ax_scale.set_yscale("log", base=2)
      ax_scale.legend(loc="lower right")
  ax_scale.set_ylabel("fp16 loss scale")
  ax_scale.set_xlabel("step")
  ax_scale.grid(alpha=0.3)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --- Command line ----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
  """Returns the run's settings and the remaining options.

  ``--smoke`` (or ``MPX_SMOKE=1``) switches every size default to the tiny preset;
  explicit flags still override it.
  """
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny run for CI (or MPX_SMOKE=1)")
  sizes = parser.add_argument_group("size (defaults: the default or the smoke preset)")
  sizes.add_argument("--layers", type=int, help=f"transformer blocks ({DEFAULT['layers']})")
  sizes.add_argument("--width", type=int, help=f"model width ({DEFAULT['width']})")
  sizes.add_argument("--heads", type=int, help=f"attention heads ({DEFAULT['heads']})")
  sizes.add_argument("--context", type=int, help=f"sequence length ({DEFAULT['context']})")
  sizes.add_argument("--batch", type=int, help=f"sequences per step ({DEFAULT['batch']})")
  sizes.add_argument("--steps", type=int, help=f"training steps ({DEFAULT['steps']})")
  sizes.add_argument("--warmup", type=int, help=f"warmup steps ({DEFAULT['warmup']})")
  sizes.add_argument(
    "--chunk", type=int, help=f"steps per jitted scan, between fetches ({DEFAULT['chunk']})"
  )
  sizes.add_argument(
    "--eval-windows", type=int, help=f"validation sequences ({DEFAULT['eval_windows']})"
  )
  sizes.add_argument(
    "--growth-interval",
    type=int,
    help=f"fp16 loss scale: finite steps before it doubles ({DEFAULT['growth_interval']})",
  )
  parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (1e-3)")
  parser.add_argument(
    "--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (0.1)"
  )
  parser.add_argument("--clip", type=float, help="clip gradients to this global norm (none)")
  parser.add_argument(
    "--fp32-norms", action="store_true", help="keep LayerNorm params in float32 in 16-bit rows"
  )
  parser.add_argument("--seed", type=int, default=0, help="init and batch seed (0)")
  parser.add_argument(
    "--skip",
    choices=("step", "leaf"),
    default="step",
    help="mixed_precision's skip= in the bf16 rows (step); leaf: each leaf updated as its "
    "gradient arrives, skipped alone if non-finite (the fp16 row keeps step: loss_scale)",
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("demo_results/demo.png"),
    help="where to write the plot (demo_results/demo.png)",
  )
  parser.add_argument(
    "--tolerance",
    type=float,
    help="largest relative val-loss gap of every mpx row to FP32 (default: each row's own, "
    + ", ".join(f"{r.name} {r.tolerance}" for r in ROWS if r.tolerance is not None)
    + ")",
  )
  parser.add_argument(
    "--min-gap",
    type=float,
    help="smallest relative val-loss gap to FP32 of the rows that must be worse (default: "
    + ", ".join(f"{r.name} {r.worse_by}" for r in ROWS if r.worse_by is not None)
    + ")",
  )
  parser.add_argument("--no-check", action="store_true", help="report only; always exit 0")
  parser.add_argument(
    "--jobs",
    type=int,
    default=os.cpu_count() or 1,
    help="rows trained side by side (the CPU's cores; 1: one after another)",
  )
  parser.add_argument(
    "--rows",
    help="train only these rows, comma-separated names (fp32, the reference, always): for "
    "cheaper experiments",
  )
  parser.add_argument(
    "--json",
    type=pathlib.Path,
    help="also write the run's settings, per-row losses and gaps and the checks to this file",
  )
  args = parser.parse_args(argv)
  args.smoke = args.smoke or os.environ.get("MPX_SMOKE", "") not in ("", "0")
  if args.rows is None:
    args.rows = list(ROWS)
  else:
    names = {name.strip() for name in args.rows.split(",") if name.strip()}
    unknown = names - set(MODES)
    if unknown:
      parser.error(f"--rows: unknown {sorted(unknown)}; the rows are {', '.join(MODES)}")
    names.add(ROWS[0].name)
    args.rows = [row for row in ROWS if row.name in names]
  preset = SMOKE if args.smoke else DEFAULT
  for name, value in preset.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  counts = ("layers", "width", "heads", "context", "batch", "steps", "chunk", "eval_windows")
  if min(getattr(args, name) for name in counts) < 1 or args.growth_interval < 1:
    parser.error("sizes, counts and --growth-interval must be >= 1")
  if args.warmup < 0:
    parser.error("--warmup must be >= 0")
  try:
    model = lm.ModelConfig(args.layers, args.width, args.heads, args.context)
  except ValueError as error:
    parser.error(str(error))
  settings = Settings(
    model=model,
    opt=lm.OptConfig(
      steps=args.steps,
      peak_lr=args.lr,
      warmup=args.warmup,
      weight_decay=args.weight_decay,
      clip=args.clip,
    ),
    batch=args.batch,
    chunk=args.chunk,
    eval_windows=args.eval_windows,
    growth_interval=args.growth_interval,
    fp32_norms=args.fp32_norms,
    seed=args.seed,
    skip=args.skip,
  )
  return settings, args


class Run(NamedTuple):
  """What a run printed and measured: the report (table and checks), each
  row's result, its wall time in seconds and whether every check held."""

  report: list[str]
  results: list[Result]
  seconds: float
  ok: bool


def main(argv: list[str] | None = None) -> int:
  settings, args = parse_args(argv)
  return 0 if run(settings, args).ok else 1


def run(settings: Settings, args: argparse.Namespace) -> Run:
  """Trains every row of ``args.rows``, prints the table and the checks, and
  writes the plot (and ``--json``)."""
  if args.smoke:
    # The smoke run only checks that everything runs, and on the CPU it is
    # mostly compilation: skipping XLA's LLVM optimisations halves it. Set
    # before the first computation starts the backend, which reads XLA_FLAGS.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
  start = time.perf_counter()
  train_bytes, valid_bytes = lm.load_corpus()
  cfg = settings.model
  data = {
    "train": jnp.asarray(train_bytes),
    "valid": jnp.asarray(eval_batches(valid_bytes, settings.eval_windows, cfg.context)),
  }
  fp32_params = lm.init_params(lm.TransformerLM(cfg), settings.seed)
  title = (
    f"{cfg.layers}-layer transformer, width {cfg.width}, {cfg.heads} heads, "
    f"context {cfg.context}, {lm.count_params(fp32_params):,} params; "
    f"{settings.opt.steps} steps x {settings.batch} sequences"
    + ("" if settings.skip == "step" else f"; skip={settings.skip!r}")
  )
  print(
    f"{title}\nbyte-level LM on {train_bytes.size:,} train / {valid_bytes.size:,} validation "
    f"bytes of stdlib source ({jax.default_backend()})"
  )

  rows = args.rows
  if any(row.dtype == FP16 for row in rows) and not float16_compiles():
    # XLA:CPU converts to float16 with F16C's instructions; on a CPU without
    # them (x86 before 2012, or XLA_FLAGS=--xla_cpu_max_isa=SSE4_2) LLVM calls
    # __truncsfhf2 instead, which XLA's JIT does not provide (jax 0.10).
    rows = [row for row in rows if row.dtype != FP16]
    print(
      "skipping the float16 rows: XLA cannot compile a conversion to float16 on this CPU "
      "(no F16C instructions, and XLA's runtime lacks __truncsfhf2)"
    )
  prepared = [prepare(row, settings, data, fp32_params) for row in rows]
  print(f"compiling the {len(prepared)} rows' training steps...", file=sys.stderr)
  compile_seconds = compile_all(prepared)
  results = train_all(prepared, settings, data, args.jobs)
  ok, checks = True, []
  if not args.no_check:
    ok, checks = check(results, args.tolerance, args.min_gap, gaps=not args.smoke)
  report = table_lines(results) + checks
  print()
  print("\n".join(report))
  plot(results, args.out, title)
  print(f"plot: {args.out}")
  seconds = time.perf_counter() - start
  print(f"wall time: {seconds:.0f} s ({compile_seconds:.0f} s compiling the steps) on {machine()}")
  if args.json:
    write_json(args.json, settings, results, checks, ok, seconds, compile_seconds)
    print(f"wrote {args.json}")
  return Run(report, results, seconds, ok)


def float16_compiles() -> bool:
  """Whether XLA can compile and run a float32-to-float16 conversion here."""
  try:
    x = jax.jit(lambda x: (x * 3).astype(FP16))(jnp.arange(4, dtype=jnp.float32))
    return bool(np.asarray(x.astype(jnp.float32))[1] == 3)
  except jax.errors.JaxRuntimeError:
    return False


def machine() -> str:
  """Where this runs, with what changes its numbers: the CPU's vector features
  (or the accelerator) and the jax and jaxlib versions."""
  versions = f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}"
  backend = jax.default_backend()
  if backend != "cpu":
    return f"{jax.devices()[0].device_kind} ({backend}), {versions}"
  model, flags = platform.processor() or "", set()
  try:
    with open("/proc/cpuinfo") as cpuinfo:  # Linux; elsewhere the features stay unnamed
      for line in cpuinfo:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not flags:
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
          break
  except OSError:
    pass
  # The features XLA:CPU's kernels and fused multiply-adds depend on.
  names = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX-512 BF16",
    "avx512_fp16": "AVX-512 FP16",
    "amx_bf16": "AMX BF16",
  }
  features = ", ".join(name for flag, name in names.items() if flag in flags)
  details = "; ".join(x for x in (model, features) if x)
  cpu = f"{os.cpu_count()}-core {platform.machine()} CPU"
  return f"a {cpu}{f' ({details})' if details else ''}, {versions}"


def write_json(
  path: pathlib.Path,
  settings: Settings,
  results: list[Result],
  checks: list[str],
  ok: bool,
  seconds: float,
  compile_seconds: float,
) -> None:
  """Writes the run to ``path`` as JSON, for scripts (``benchmarks/demo_matrix.py``):
  its settings, where it ran (``XLA_FLAGS`` included), each row's losses, gap
  to FP32 and bounds, the check lines and whether they all hold."""
  reference = results[0]
  rows = []
  for r in results:
    row = ROW_BY_NAME[r.mode]
    rows.append(
      dict(
        mode=r.mode,
        param_dtype=r.param_dtype,
        train_loss=r.train_loss,
        val_loss=r.val_loss,
        gap=relative_gap(r, reference),
        tolerance=row.tolerance,
        worse_by=row.worse_by,
        state_bytes_per_param=r.state_bytes_per_param,
        skipped_steps=r.skipped_steps,
        tokens_per_s=r.tokens_per_s,
      )
    )
  record = dict(
    settings=dataclasses.asdict(settings),
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    machine=machine(),
    seconds=seconds,
    compile_seconds=compile_seconds,
    rows=rows,
    checks=checks,
    ok=ok,
  )
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  sys.exit(main())
