"""Mixed-precision training demo: a small transformer LM in FP32, bf16 and fp16, side by side.

A byte-level decoder-only transformer (``examples/lm.py``) learns to predict
the Python standard library's own source (no download; split into train and
validation by file). It is trained from one FP32 initialisation, on the same
batches, in six modes; :func:`make_optimizer` is the only mode-specific code:

* ``fp32``: plain optax (AdamW, warmup and cosine decay to 0), the reference.
* ``bf16+mpx``: bf16 params and compute with ``mpx.mixed_precision(adamw)``:
  float32 master weights and Adam moments live in the optimizer state
  (12 bytes per parameter).
* ``bf16+mpx remainder``: the same with ``masters="remainder"``: only the low
  16 bits of each float32 master are stored (an int16; the bf16 param is the
  high half), 10 bytes per parameter. It must reproduce ``bf16+mpx`` bit for
  bit: the same losses at every step, the same final params.
* ``bf16 stochastic``: ``masters="stochastic"``: no master at all (8 bytes per
  parameter, as FP32); each bf16 param is updated in float32 and rounded up or
  down at random, so updates below half an ulp survive in expectation.
* ``fp16+mpx+scale``: fp16 params and compute with
  ``mpx.loss_scale(mpx.mixed_precision(adamw))``, differentiating
  ``mpx.scale_loss(loss, opt_state)``.
* ``bf16 no masters``: bf16 params with plain optax, to show what goes wrong
  without mpx: every update smaller than half a bf16 ulp of its weight (weight
  decay, the small steps late in the cosine schedule) is rounded away.

In every mode the attention softmax and the final softmax/cross-entropy run in
float32; everything else computes in the params' dtype. The whole run of each
mode is a few jitted ``lax.scan`` chunks of steps that return the per-step loss
and loss scale, fetched one chunk behind, so the host never waits on a step.

Run from the repository root::

  python examples/demo.py                 # default: about 5 min on 2 (shared) CPU cores
  python examples/demo.py --smoke         # tiny, under a minute (CI); or MPX_SMOKE=1
  python examples/demo.py --layers 6 --width 384 --heads 6 --context 256 \\
      --batch 64 --steps 5000 --lr 1e-3   # on a GPU

It prints a table per mode and writes a plot (``--out``, default
``demo_results/demo.png``). Unless ``--no-check``, it checks the outcome and
exits with status 1 unless ``bf16+mpx remainder`` is bitwise identical to
``bf16+mpx`` (per-step losses, final params, validation loss), every mpx mode
ends within ``--tolerance`` (relative) of the FP32 validation loss and ``bf16
no masters`` ends more than ``--min-gap`` above it. With ``--smoke`` (too small
to mean anything about losses) only the first, which holds at any size, is
checked.

Why ``bf16 no masters`` fails, and where it would not: an update below half a bf16 ulp of
its weight is rounded away, and the fraction of such updates grows as the
learning rate shrinks (late in the cosine schedule, or a lower peak) and with
weight decay, whose per-step shrink ``lr * wd`` is far below bf16's relative
precision of ``2**-9``. The defaults (peak 3e-3, weight decay 0.1, cosine to 0)
are ordinary transformer settings, and there bf16 without masters ends about 3%
worse. This tiny model tolerates unusually large steps, though (relative to its
weights, larger than big models take): FP32 does best near a peak of 5e-3,
about 4% lower, where the gap shrinks to under 2%, and at 7e-3 it is nearly
gone, because steps that large survive rounding. Other sizes and learning rates
may therefore need ``--no-check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import lm
import numpy as np
import optax
from tqdm import tqdm

import mpx

REMAINDER = "bf16+mpx remainder"  # must be bitwise identical to bf16+mpx
STOCHASTIC = "bf16 stochastic"
NO_MASTERS = "bf16 no masters"  # must be more than --min-gap worse than FP32
MODES = ("fp32", "bf16+mpx", REMAINDER, STOCHASTIC, "fp16+mpx+scale", NO_MASTERS)
MIXED = ("bf16+mpx", REMAINDER, STOCHASTIC, "fp16+mpx+scale")  # within --tolerance of FP32
DTYPES = {
  "fp32": jnp.float32,
  "bf16+mpx": jnp.bfloat16,
  REMAINDER: jnp.bfloat16,
  STOCHASTIC: jnp.bfloat16,
  "fp16+mpx+scale": jnp.float16,
  NO_MASTERS: jnp.bfloat16,
}


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a run, shared by all modes."""

  model: lm.ModelConfig
  opt: lm.OptConfig
  batch: int
  chunk: int  # steps per jitted lax.scan call
  eval_windows: int
  growth_interval: int
  fp32_norms: bool
  seed: int


# Presets for the flags: (layers, width, heads, context, batch, steps, warmup,
# chunk, eval windows, growth interval).
DEFAULT = dict(
  layers=2,
  width=64,
  heads=4,
  context=64,
  batch=32,
  steps=1000,
  warmup=50,
  chunk=50,
  eval_windows=1024,
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


# --- Optimizers: the only mode-specific code ----------------------------------------


def make_optimizer(
  mode: str, settings: Settings
) -> tuple[optax.GradientTransformation, Callable[[Any], tuple[Any, optax.OptState]]]:
  """Returns ``(tx, init)`` for ``mode``.

  Args:
    mode: one of ``MODES``.
    settings: the run's settings.

  Returns:
    The transformation, and ``init(fp32_params) -> (params, opt_state)`` which
    starts the mode from the shared FP32 weights, with the params in the mode's
    dtype.
  """
  adamw = lm.adamw(settings.opt)
  # By default every param is cast, LayerNorm scales included: mpx's float32
  # masters keep their small updates, and a bf16 gain is rounded no worse than
  # any weight (at the default size, float32 norms only move bf16+mpx from
  # +0.4% to +0.2% of FP32). Without masters the gains suffer most: next to 1.0
  # an update must exceed 2**-8 to round up, more than the peak learning rate.
  # --fp32-norms keeps them in float32 in every 16-bit mode (mixed_precision
  # then gives them no master and updates them directly).
  where = (lambda path, leaf: not lm.is_norm(path, leaf)) if settings.fp32_norms else None
  if mode == "fp32":
    return adamw, lambda params: (params, adamw.init(params))
  if mode == "bf16+mpx":
    tx = mpx.mixed_precision(adamw)
    # Casts to bf16 and seeds the float32 masters with the exact FP32 weights
    # (tx.init on bf16 params could only recover rounded ones).
    return tx, lambda params: mpx.init_from_full_precision(tx, params, jnp.bfloat16, where)
  if mode == REMAINDER:
    # The same masters, stored as int16 remainders: the same seeding, bit for bit.
    tx = mpx.mixed_precision(adamw, masters="remainder")
    return tx, lambda params: mpx.init_from_full_precision(tx, params, jnp.bfloat16, where)
  if mode == STOCHASTIC:
    # No master to seed: the params start rounded, as without masters.
    tx = mpx.mixed_precision(adamw, masters="stochastic", seed=settings.seed)

    def init(params):
      params = mpx.cast_tree(params, jnp.bfloat16, where)
      return params, tx.init(params)

    return tx, init
  if mode == "fp16+mpx+scale":
    # Loss scaling goes outside mixed_precision. PyTorch's growth_interval of
    # 2000 suits long runs; a shorter one lets this run show the scale grow,
    # overflow fp16 (that step is skipped) and back off.
    tx = mpx.loss_scale(mpx.mixed_precision(adamw), growth_interval=settings.growth_interval)
    return tx, lambda params: mpx.init_from_full_precision(tx, params, jnp.float16, where)
  if mode == NO_MASTERS:

    def init(params):
      params = mpx.cast_tree(params, jnp.bfloat16, where)
      return params, adamw.init(params)

    return adamw, init
  raise ValueError(f"unknown mode {mode!r}")


# --- Training --------------------------------------------------------------------


@dataclasses.dataclass
class Result:
  """What one mode produced: the table's row and the plot's curves."""

  mode: str
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


def train(mode: str, settings: Settings, data: dict[str, jax.Array], fp32_params: Any) -> Result:
  """Trains the model in ``mode`` from ``fp32_params`` and evaluates it.

  Args:
    mode: one of ``MODES``.
    settings: the run's settings.
    data: ``"train"`` (device uint8 corpus) and ``"valid"`` (windows, int32).
    fp32_params: the shared FP32 initialisation (not modified).

  Returns:
    The mode's :class:`Result`.
  """
  steps, batch, context = settings.opt.steps, settings.batch, settings.model.context
  tx, init = make_optimizer(mode, settings)
  # One compiled call instead of dozens of small ones; on a fresh copy, since
  # the training chunks donate (delete) their inputs.
  params, opt_state = jax.jit(lambda p: init(jax.tree.map(jnp.copy, p)))(fp32_params)
  # Compute in the params' dtype (norms kept in float32 by --fp32-norms included).
  dtype = jnp.dtype(DTYPES[mode])
  model = lm.TransformerLM(settings.model, dtype=dtype)

  def run_chunk(params, opt_state, corpus, key, step_ids):
    def one_step(carry, step_id):
      params, opt_state = carry
      # The batch depends only on the step number: the same in every mode.
      tokens = lm.sample_batch(corpus, jax.random.fold_in(key, step_id), batch, context)

      def scaled_loss(p):
        loss = lm.token_losses(model, p, tokens).mean()
        # Times the loss scale held in opt_state, or times 1 where it holds
        # none, so this one step serves every mode.
        return mpx.scale_loss(loss, opt_state), loss

      grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
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
  # Compiled ahead of time (once per chunk length), so tokens/s counts no compilation.
  # Donating params and opt_state lets XLA update them in place.
  jitted = jax.jit(run_chunk, donate_argnums=(0, 1))
  compiled = {
    n: jitted.lower(params, opt_state, data["train"], key, jnp.arange(n)).compile()
    for n in sorted(set(sizes))
  }

  traces = []
  bar = tqdm(total=steps, desc=f"{mode:<18}", unit="step", leave=True, file=sys.stderr)

  def collect(trace):
    trace = jax.tree.map(np.asarray, trace)
    traces.append(trace)
    bar.update(trace[0].size)
    postfix = {"loss": f"{trace[0][-1]:.3f}"}
    if mode == "fp16+mpx+scale":
      postfix["scale"] = f"{trace[1][-1]:g}"
    bar.set_postfix(postfix)

  start, pending = time.perf_counter(), None
  first = 0
  for n in sizes:
    step_ids = jnp.arange(first, first + n)
    params, opt_state, trace = compiled[n](params, opt_state, data["train"], key, step_ids)
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
    mode=mode,
    param_dtype=dtype.name,
    train_loss=float(losses[-chunk:].mean()),
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
  dtype: the bf16 modes share it.
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


TABLE_HEADER = (
  f"{'mode':<19}{'params':>9}{'train loss':>11}{'val loss':>9}{'vs fp32':>9}"
  f"{'tokens/s':>10}{'state B/param':>14}{'skipped':>8}{'loss scale':>11}"
)


def table_lines(results: list[Result]) -> list[str]:
  """One row per mode, FP32 (the first) as the reference, and a legend."""
  reference = results[0]
  lines = [TABLE_HEADER, "-" * len(TABLE_HEADER)]
  for r in results:
    lines.append(
      f"{r.mode:<19}{r.param_dtype:>9}{r.train_loss:>11.4f}{r.val_loss:>9.4f}"
      f"{relative_gap(r, reference):>+9.2%}{r.tokens_per_s:>10,.0f}"
      f"{r.state_bytes_per_param:>14.2f}"
      f"{'-' if r.skipped_steps is None else r.skipped_steps:>8}"
      f"{'-' if r.loss_scale is None else f'{r.loss_scale:g}':>11}"
    )
  return [
    *lines,
    "losses: nats per byte; train loss: mean of the last chunk of steps; vs fp32: relative",
    "validation-loss gap; state B/param: optimizer-state bytes per parameter. CPUs have no",
    "fast 16-bit matmuls, so tokens/s of the 16-bit modes only improves on GPUs and TPUs.",
  ]


def differences(result: Result, reference: Result) -> list[str]:
  """What is not bitwise identical between two runs: per-step losses, final
  params (dtype, shape and every bit), validation loss. Empty if nothing."""
  found = []
  losses, ref_losses = result.losses, reference.losses
  if losses.dtype != ref_losses.dtype or losses.shape != ref_losses.shape:
    found.append("training losses (not the same steps)")
  elif losses.tobytes() != ref_losses.tobytes():
    step = np.flatnonzero(losses.view(np.uint8) != ref_losses.view(np.uint8))[0] // losses.itemsize
    found.append(f"training losses (first at step {step + 1})")
  leaves, treedef = jax.tree.flatten(result.params)
  ref_leaves, ref_treedef = jax.tree.flatten(reference.params)
  if treedef != ref_treedef:
    found.append("param tree structure")
  else:
    differ = sum(
      a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes()
      for a, b in zip(leaves, ref_leaves, strict=True)
    )
    if differ:
      found.append(f"final params ({differ} of {len(leaves)} leaves)")
  # Python floats from the same float32 compare exactly; NaN never equals.
  if result.val_loss != reference.val_loss:
    found.append(f"validation loss ({result.val_loss!r} vs {reference.val_loss!r})")
  return found


def check(
  results: list[Result], tolerance: float, min_gap: float, gaps: bool = True
) -> tuple[bool, list[str]]:
  """An OK or FAIL line per claim, and whether all hold.

  ``bf16+mpx remainder`` must be bitwise identical to ``bf16+mpx``, at any
  size. With ``gaps`` (not for the smoke size, too small to mean anything),
  every mpx mode must also end within ``tolerance`` of the FP32 validation
  loss, and ``bf16 no masters`` more than ``min_gap`` above it.
  """
  by_mode = {r.mode: r for r in results}
  found = differences(by_mode[REMAINDER], by_mode["bf16+mpx"])
  ok = not found
  lines = []
  if ok:
    lines.append(
      f"OK: {REMAINDER} is bitwise identical to bf16+mpx (losses at all "
      f"{by_mode[REMAINDER].losses.size} steps, final params, validation loss)"
    )
  else:
    lines.append(f"FAIL: {REMAINDER} differs from bf16+mpx: {'; '.join(found)}")
  if not gaps:
    return ok, lines
  reference = by_mode["fp32"]
  for mode in MIXED:
    gap = relative_gap(by_mode[mode], reference)
    good = gap <= tolerance
    ok &= good
    lines.append(
      f"{'OK' if good else 'FAIL'}: {mode} validation loss {gap:+.2%} vs FP32 "
      f"(must be within {tolerance:.1%})"
    )
  gap = relative_gap(by_mode[NO_MASTERS], reference)
  good = gap > min_gap
  ok &= good
  lines.append(
    f"{'OK' if good else 'FAIL'}: {NO_MASTERS} validation loss {gap:+.2%} vs FP32 "
    f"(must be worse by more than {min_gap:.1%})"
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
    # Dashed: the remainder curve lies exactly on bf16+mpx's. FP32, the
    # reference the others nearly cover, is drawn black and on top.
    style = dict(color=f"C{i}", lw=1.2, ls="--" if r.mode == REMAINDER else "-")
    if i == 0:
      style = dict(color="k", lw=1.6, ls=":", zorder=10)
    ax_loss.plot(steps, loss, label=label, **style)
    ax_gap.plot(steps, 100 * (loss - reference) / reference, label=r.mode, **style)
  ax_loss.set_ylabel(f"train loss (nats/byte,\nmean of {window} steps)")
  ax_loss.set_title(title, fontsize=10)
  ax_loss.legend()
  ax_loss.grid(alpha=0.3)
  lo = min(smooth(r.losses, window)[1].min() for r in results)
  ax_loss.set_ylim(lo - 0.05, lo + 1.5)  # the interesting, late part of training
  ax_gap.axhline(0, color="k", lw=0.5)
  ax_gap.set_ylabel("train loss vs fp32 (%)")
  ax_gap.legend(fontsize=8, ncol=2)
  ax_gap.grid(alpha=0.3)
  for i, r in enumerate(results):
    if r.mode == "fp16+mpx+scale":
      steps = np.arange(1, r.scales.size + 1)
      ax_scale.step(steps, r.scales, where="post", color=f"C{i}", label="loss scale")
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
  parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
  parser.add_argument(
    "--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (0.1)"
  )
  parser.add_argument("--clip", type=float, help="clip gradients to this global norm (none)")
  parser.add_argument(
    "--fp32-norms", action="store_true", help="keep LayerNorm params in float32 in 16-bit modes"
  )
  parser.add_argument("--seed", type=int, default=0, help="init and batch seed (0)")
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("demo_results/demo.png"),
    help="where to write the plot (demo_results/demo.png)",
  )
  parser.add_argument(
    "--tolerance",
    type=float,
    default=0.02,
    help="largest relative val-loss gap of an mpx mode to FP32 (0.02)",
  )
  parser.add_argument(
    "--min-gap",
    type=float,
    default=0.02,
    help="smallest relative val-loss gap of bf16 without masters to FP32 (0.02)",
  )
  parser.add_argument("--no-check", action="store_true", help="report only; always exit 0")
  parser.add_argument(
    "--readme",
    type=pathlib.Path,
    help="write this run's table into the results block of this file (README.md)",
  )
  args = parser.parse_args(argv)
  args.smoke = args.smoke or os.environ.get("MPX_SMOKE", "") not in ("", "0")
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
  )
  return settings, args


def main(argv: list[str] | None = None) -> int:
  settings, args = parse_args(argv)
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
  )
  print(
    f"{title}\nbyte-level LM on {train_bytes.size:,} train / {valid_bytes.size:,} validation "
    f"bytes of stdlib source ({jax.default_backend()})"
  )

  results = [train(mode, settings, data, fp32_params) for mode in MODES]
  ok, checks = True, []
  if not args.no_check:
    ok, checks = check(results, args.tolerance, args.min_gap, gaps=not args.smoke)
  report = table_lines(results) + checks
  print()
  print("\n".join(report))
  plot(results, args.out, title)
  print(f"plot: {args.out}")
  seconds = time.perf_counter() - start
  print(f"wall time: {seconds:.0f} s")
  if args.readme:
    write_readme_block(args.readme, report, results, seconds, argv)
    print(f"updated the results block of {args.readme}")
  return 0 if ok else 1


README_START = "<!-- demo-results:start (written by examples/demo.py --readme README.md) -->"
README_END = "<!-- demo-results:end -->"


def write_readme_block(
  path: pathlib.Path,
  report: list[str],
  results: list[Result],
  seconds: float,
  argv: list[str] | None,
) -> None:
  """Replaces what lies between the README's two markers by this run: where
  and how long it ran, its table and checks verbatim, and the gaps in words."""
  text = path.read_text()
  if text.count(README_START) != 1 or text.count(README_END) != 1:
    raise SystemExit(f"--readme: {path} needs one {README_START!r} and one {README_END!r} line")
  head, rest = text.split(README_START)
  _, tail = rest.split(README_END)
  flags = sys.argv[1:] if argv is None else argv
  command = " ".join(["python examples/demo.py", *flags])
  by_mode = {r.mode: r for r in results}
  worst = max(abs(relative_gap(by_mode[m], results[0])) for m in MIXED)
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  block = [
    f"On a {os.cpu_count()}-core {platform.machine()} CPU (`{command}`, {seconds:.0f} s, "
    f"load average {load} at the end):",
    "",
    "```",
    *report,
    "```",
    "",
    f"Every mpx row ends within {worst:.2%} of FP32's validation loss; bf16 without "
    f"master weights ends {relative_gap(by_mode[NO_MASTERS], results[0]):+.2%} from it.",
  ]
  path.write_text(head + README_START + "\n" + "\n".join(block) + "\n" + README_END + tail)


if __name__ == "__main__":
  sys.exit(main())
