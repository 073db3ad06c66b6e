"""Draws the two figures of docs/concepts.md into docs/_static/.

1. ``lost_bf16_updates.png``: a weight w = 1.0 under 600 SGD steps of
   ``lr * grad = 1e-3`` in float32, in plain bfloat16, and in bfloat16 with
   ``mpx.mixed_precision``.
2. ``loss_scale_trace.png``: the dynamic loss scale of a short float16 run
   with ``growth_interval=10``, with natural overflows and a few injected bad
   batches.

Run from the repository root (needs matplotlib, from the ``examples`` extra):

    python docs/_scripts/concepts_plots.py

It takes a few seconds on a CPU.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import mpx

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STATIC = pathlib.Path(__file__).resolve().parent.parent / "_static"
COLORS = {
  "fp32": "#9a9a9a",
  "bf16": "#d62728",
  "mpx": "#1f77b4",
  "master": "#0b3d66",
  "loss": "#333333",
}


def sgd_trajectory(tx: optax.GradientTransformation, w0: jax.Array, steps: int):
  """Params (and masters, if any) after each of ``steps`` steps with grad 1."""

  def body(carry, _):
    params, state = carry
    grads = jnp.ones_like(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    # Emitted in their own dtypes: a cast to float32 inside the loop may be
    # fused with the update and skip the rounding to bfloat16 (XLA's
    # excess-precision optimisation), which would hide what is stored.
    return (params, state), (params, mpx.master_params(state, params))

  _, (params, masters) = jax.lax.scan(body, (w0, tx.init(w0)), None, length=steps)
  start = np.asarray(w0, np.float32)[None]
  as_f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
  return np.concatenate([start, as_f32(params)]), np.concatenate([start, as_f32(masters)])


def plot_lost_updates(path: pathlib.Path, steps: int = 600, lr: float = 1e-3) -> None:
  fp32, _ = sgd_trajectory(optax.sgd(lr), jnp.float32(1.0), steps)
  bf16, _ = sgd_trajectory(optax.sgd(lr), jnp.bfloat16(1.0), steps)
  mixed, masters = sgd_trajectory(mpx.mixed_precision(optax.sgd(lr)), jnp.bfloat16(1.0), steps)
  assert np.all(bf16 == 1.0), "plain bf16 should never move"
  assert np.max(np.abs(masters - fp32)) < 1e-6, "the masters should follow float32"
  t = np.arange(steps + 1)

  fig, (full, zoom) = plt.subplots(
    1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1.35, 1]}, constrained_layout=True
  )
  for ax, n in ((full, steps), (zoom, 40)):
    ax.plot(t[: n + 1], bf16[: n + 1], color=COLORS["bf16"], lw=2.2, label="plain bfloat16 (optax)")
    ax.plot(t[: n + 1], fp32[: n + 1], color=COLORS["fp32"], lw=6, alpha=0.6, label="float32")
    ax.step(
      t[: n + 1],
      mixed[: n + 1],
      where="post",
      color=COLORS["mpx"],
      lw=1.6,
      label="bfloat16 param, mpx.mixed_precision",
    )
    ax.plot(
      t[: n + 1],
      masters[: n + 1],
      color=COLORS["master"],
      lw=1.2,
      ls=(0, (2, 2)),
      label="its float32 master",
    )
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  full.set_ylabel("weight w")
  full.set_title(f"w = 1.0, {steps} SGD steps of lr·g = {lr:g}")
  full.legend(loc="lower left", frameon=True)
  zoom.set_title("the first 40 steps")
  zoom.text(
    39,
    0.9995,
    "grey lines: the bfloat16 numbers,\n2⁻⁸ ≈ 0.0039 apart below 1.0",
    ha="right",
    va="top",
    fontsize=9,
    color="#555555",
  )
  zoom.set_ylim(0.955, 1.006)
  for level in 1.0 - np.arange(0, 12) * 2.0**-8:  # the bfloat16 numbers in view
    zoom.axhline(level, color="grey", lw=0.5, alpha=0.5, zorder=0)
  full.annotate(
    "every update is below half an ulp of 1.0:\nrounded away, w stays at 1.0",
    xy=(steps * 0.55, 1.0),
    xytext=(steps * 0.38, 0.86),
    color=COLORS["bf16"],
    arrowprops={"arrowstyle": "->", "color": COLORS["bf16"]},
  )
  fig.savefig(path, dpi=150)
  plt.close(fig)


def loss_scale_run(steps: int = 160, inject_at: tuple[int, ...] = (80, 81, 82)):
  """A float16 linear regression with noisy batches; returns per-step records."""
  n_in, batch = 16, 64
  true_w = jnp.linspace(-1.0, 1.0, n_in)
  tx = mpx.loss_scale(mpx.mixed_precision(optax.adam(1e-2)), growth_interval=10)
  params = {"w": jnp.zeros(n_in, jnp.float16)}
  opt_state = tx.init(params)

  def loss_fn(params, x, y):
    pred = x.astype(jnp.float16) @ params["w"]
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  @jax.jit
  def step(params, opt_state, key, poison):
    kx, kn = jax.random.split(key)
    x = 4.0 * jax.random.normal(kx, (batch, n_in))
    y = x @ true_w + jax.random.normal(kn, (batch,))
    used = jnp.where(poison, x.at[0, 0].set(jnp.inf), x)  # a bad batch
    grads = jax.grad(lambda p: mpx.scale_loss(loss_fn(p, used, y), opt_state))(params)
    scale = opt_state.loss_scale  # the scale this step's loss was multiplied by
    loss = loss_fn(params, x, y)  # on the clean batch, before the update
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, scale, opt_state.last_step_finite, loss

  records = []
  for i in range(steps):
    params, opt_state, scale, finite, loss = step(
      params, opt_state, jax.random.key(i), jnp.asarray(i in inject_at)
    )
    records.append((i, float(scale), bool(finite), i in inject_at, float(loss)))
  return records, int(opt_state.skipped_steps)


def plot_loss_scale(path: pathlib.Path) -> None:
  records, skipped = loss_scale_run()
  t = np.array([r[0] for r in records])
  scale = np.array([r[1] for r in records])
  finite = np.array([r[2] for r in records])
  injected = np.array([r[3] for r in records])
  loss = np.array([r[4] for r in records])
  assert skipped == int((~finite).sum())

  fig, (top, bottom) = plt.subplots(
    2,
    1,
    figsize=(10, 5.6),
    sharex=True,
    gridspec_kw={"height_ratios": [2, 1]},
    constrained_layout=True,
  )
  top.step(t, scale, where="post", color=COLORS["mpx"], lw=1.8, label="loss scale used at the step")
  overflow = ~finite & ~injected
  top.scatter(
    t[overflow],
    scale[overflow],
    marker="x",
    s=60,
    color=COLORS["bf16"],
    zorder=3,
    label="overflow: step skipped, scale halved",
  )
  top.scatter(
    t[injected],
    scale[injected],
    marker="v",
    s=60,
    color="#ff7f0e",
    zorder=3,
    label="injected bad batch (inf): skipped, halved",
  )
  top.set_yscale("log", base=2)
  top.set_ylabel("loss scale")
  top.set_title(f"float16 run, loss_scale(growth_interval=10): {skipped} of {len(t)} steps skipped")
  top.legend(loc="lower right", frameon=True)
  top.grid(alpha=0.3, which="both")
  bottom.plot(t, loss, color=COLORS["loss"], lw=1.2)
  bottom.scatter(t[~finite], loss[~finite], marker="x", s=25, color=COLORS["bf16"], zorder=3)
  bottom.set_yscale("log")
  bottom.set_ylabel("training loss")
  bottom.set_xlabel("step")
  bottom.grid(alpha=0.3, which="both")
  fig.savefig(path, dpi=150)
  plt.close(fig)


def main() -> None:
  STATIC.mkdir(exist_ok=True)
  plot_lost_updates(STATIC / "lost_bf16_updates.png")
  plot_loss_scale(STATIC / "loss_scale_trace.png")
  print(f"wrote {STATIC / 'lost_bf16_updates.png'} and {STATIC / 'loss_scale_trace.png'}")


if __name__ == "__main__":
  main()
