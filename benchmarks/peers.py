"""The peers' optimizer steps: optax alone, jmp, flax, mixed-precision-for-JAX.

Each ``build_*(p32, grads)`` returns ``(step, state, grads)``, or a string
saying why the peer is unavailable.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks.trees import F16, F32, SCALE, adam, copy_tree

MPFJ_DIST = "mixed-precision-for-jax"
MPFJ_VERSION = "0.1.8"
VENDOR = pathlib.Path(__file__).resolve().parent / ".vendor"
_MPFJ: dict[str, Any] = {}  # "module", or "why" it could not be loaded


def build_fp32(p32, g):
  """Builds plain ``optax.adam`` on float32 params: the baseline."""
  tx = adam()

  def step(state, grads):
    params, opt = state
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  return step, (copy_tree(p32), tx.init(p32)), g.f32


def build_apply_if_finite(p32, g):
  """Builds ``optax.apply_if_finite(adam)`` on hand-kept float32 masters.

  It has no loss scale, so the gradients are unscaled by hand with a static
  one. A skipped step returns zero updates, so the masters and fp16 params stay
  as they were without any select.
  """
  tx = optax.apply_if_finite(adam(), max_consecutive_errors=5)

  def step(state, grads):
    _, masters, opt = state
    grads = jax.tree.map(lambda g: g.astype(F32) * (1.0 / SCALE), grads)
    updates, opt = tx.update(grads, opt, masters)
    masters = optax.apply_updates(masters, updates)
    return jax.tree.map(lambda m: m.astype(F16), masters), masters, opt

  return step, (copy_tree(p32, F16), copy_tree(p32), tx.init(p32)), g.f16


def build_jmp(p32, g):
  """Builds jmp's README recipe on float32 masters cast to fp16 for compute.

  ``DynamicLossScale``, ``all_finite`` and ``select_tree`` over masters and state.
  """
  jmp, why = optional_import("jmp")
  if jmp is None:
    return why
  tx = adam()
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")

  def step(state, grads):
    _, masters, opt, loss_scale = state
    grads = policy.cast_to_param(grads)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    updates, new_opt = tx.update(grads, opt, masters)
    new_masters = optax.apply_updates(masters, updates)
    masters, opt = jmp.select_tree(grads_finite, (new_masters, new_opt), (masters, opt))
    return policy.cast_to_compute(masters), masters, opt, loss_scale

  state = (
    copy_tree(p32, F16),
    copy_tree(p32),
    tx.init(p32),
    jmp.DynamicLossScale(jnp.asarray(SCALE, F32)),
  )
  return step, state, g.f16


def build_flax(p32, g):
  """Builds flax ``DynamicScale`` as its docs and ImageNet example use it.

  The part of ``DynamicScale.value_and_grad`` after the backward pass, line for
  line, then ``TrainState.apply_gradients`` and ``jnp.where(is_fin, new, old)``
  over params and optimizer state; the fp16 params are the float32 ones cast.
  """
  try:
    from flax.training import train_state
    from flax.training.dynamic_scale import DynamicScale
  except ImportError as error:
    return f"flax not installed ({error.name})"
  tx = adam()

  def step(state, grads):
    _, ts, ds = state
    grads = jax.tree.map(lambda g: jnp.asarray(g, F32) / ds.scale, grads)
    finite = jnp.array(True)
    for g in jax.tree.leaves(grads):
      finite &= jnp.all(jax.lax.is_finite(g))
    grow = ds.fin_steps == ds.growth_interval
    fin_scale = jnp.where(
      grow & finite, jnp.minimum(ds.scale * ds.growth_factor, jnp.finfo(F32).max), ds.scale
    )
    inf_scale = jnp.maximum(ds.scale * ds.backoff_factor, ds.minimum_scale)
    ds = ds.replace(
      fin_steps=jnp.where(grow | ~finite, 0, ds.fin_steps + 1),
      scale=jnp.where(finite, fin_scale, inf_scale),
    )
    new_ts = ts.apply_gradients(grads=grads)
    select = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    ts = new_ts.replace(
      opt_state=select(new_ts.opt_state, ts.opt_state), params=select(new_ts.params, ts.params)
    )
    return jax.tree.map(lambda p: p.astype(F16), ts.params), ts, ds

  ts = train_state.TrainState.create(apply_fn=None, params=copy_tree(p32), tx=tx)
  ds = DynamicScale(scale=jnp.asarray(SCALE, F32), fin_steps=jnp.zeros((), jnp.int32))
  return step, (copy_tree(p32, F16), ts, ds), g.f16


def build_mpfj(p32, g):
  """Builds mixed-precision-for-JAX's step on the float32 model.

  The tail of its ``filter_value_and_grad`` (``all_finite``,
  ``DynamicLossScaling.adjust``, ``unscale``), then its ``optimizer_update``
  (``select_tree`` over model and state), cast with ``cast_to_half_precision``.
  Needs :func:`load_peers` first.
  """
  mpfj = _MPFJ.get("module")
  if mpfj is None:
    return _MPFJ.get("why", "mixed-precision-for-JAX not loaded")
  tx = adam()

  def step(state, grads):
    _, model, opt, scaling = state
    grads_finite = mpfj.all_finite(grads)
    scaling = scaling.adjust(grads_finite)
    grads = scaling.unscale(grads)
    model, opt = mpfj.optimizer_update(model, tx, opt, grads, grads_finite)
    return mpfj.cast_to_half_precision(model), model, opt, scaling

  scaling = mpfj.DynamicLossScaling(
    loss_scaling=jnp.asarray(SCALE, F32), min_loss_scaling=jnp.asarray(1.0, F32)
  )
  return step, (copy_tree(p32, F16), copy_tree(p32), tx.init(p32), scaling), g.f16


# --- Loading the peers ---------------------------------------------------------------


def load_peers(install: bool) -> None:
  """Loads mixed-precision-for-JAX for :func:`build_mpfj` (installing it if asked)."""
  if "module" in _MPFJ or "why" in _MPFJ:
    return
  module, why = load_mixed_precision_for_jax(install)
  if module is not None:
    _MPFJ["module"] = module
  else:
    _MPFJ["why"] = why


def optional_import(name: str) -> tuple[types.ModuleType | None, str]:
  """Imports ``name``: ``(module, "")``, or ``(None, why)`` when it is not installed."""
  try:
    return importlib.import_module(name), ""
  except ImportError as error:
    return None, f"{name} not installed ({error.name}); pip install -e '.[bench]'"


def _vendor_dir(version: str) -> pathlib.Path:
  return VENDOR / f"{MPFJ_DIST}-{version}"


def install_mixed_precision_for_jax(version: str = MPFJ_VERSION) -> pathlib.Path:
  """Pip-installs the package, without dependencies, into a private folder."""
  target = _vendor_dir(version)
  if (target / "mpx" / "__init__.py").exists():
    return target
  target.mkdir(parents=True, exist_ok=True)
  subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "--quiet",
      "--disable-pip-version-check",
      "--no-deps",
      "--target",
      str(target),
      f"{MPFJ_DIST}=={version}",
    ],
    check=True,
  )
  return target


def _is_mpx_module(name: str) -> bool:
  return name == "mpx" or name.startswith("mpx.")


def load_mixed_precision_for_jax(
  install: bool, version: str = MPFJ_VERSION
) -> tuple[types.ModuleType | None, str]:
  """Imports mixed-precision-for-JAX under another name, leaving ours as ``mpx``.

  It also imports as ``mpx``, so its ``sys.modules`` entries are swapped with
  ours for the duration of the import; its functions keep working afterwards
  through the module objects they bound at import time.

  Args:
    install: pip-install it into ``benchmarks/.vendor`` if it is not there yet.
    version: the release to use.

  Returns:
    ``(module, "")``, or ``(None, why)`` if it is not available.
  """
  target = _vendor_dir(version)
  if not (target / "mpx" / "__init__.py").exists():
    if not install:
      return None, f"{MPFJ_DIST} not vendored (run without --smoke, or --install-peers)"
    try:
      install_mixed_precision_for_jax(version)
    except (subprocess.CalledProcessError, OSError) as error:
      return None, f"pip could not install {MPFJ_DIST}=={version}: {error}"
  for dependency in ("equinox", "jaxtyping"):
    module, why = optional_import(dependency)
    if module is None:
      return None, why
  import mpx as ours  # noqa: F401 - imported first, so it is the one restored

  saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_mpx_module(name)}
  sys.path.insert(0, str(target))
  try:
    theirs = importlib.import_module("mpx")
  except ImportError as error:
    return None, f"{MPFJ_DIST} failed to import: {error}"
  finally:
    for name in [n for n in sys.modules if _is_mpx_module(n)]:
      del sys.modules[name]
    sys.path.remove(str(target))
    sys.modules.update(saved)
  origin = pathlib.Path(theirs.__file__).resolve()
  if target.resolve() not in origin.parents:
    return None, f"imported the wrong mpx from {origin}"
  assert sys.modules["mpx"] is saved["mpx"]
  return theirs, ""
