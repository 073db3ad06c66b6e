"""The tests' switch between lowered forms (tests/lowering_forms.py): a
function mpx jits once for a whole process runs, after a switch, the program
of the form switched to, never one traced in the form before."""

import collections
import importlib
import pkgutil
from typing import Any

import jax
import jax.numpy as jnp
import lowering_forms
import optax
import pytest
from lowering_forms import forced

import mpx
import mpx._src
from mpx._src import moment_codes as mc
from mpx._src import tree

m4_compress = mc.FourBitCompressed.compress


def _spied(
  monkeypatch: pytest.MonkeyPatch,
) -> tuple[collections.Counter, list[tuple[Any, ...]], Any]:
  """Counts the traces of the two ways to pack 4-bit codes (the CPU's by
  shifts, the accelerators' by a bitcast) and records every eager call of
  ``tree.jitted_when_eager``'s one jit, which it returns."""
  traced: collections.Counter = collections.Counter()

  def counting(name: str) -> Any:
    real = getattr(mc, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
      traced[name] += 1
      return real(*args, **kwargs)

    return spy

  for name in ("_pack", "_pack_by_bitcast"):
    monkeypatch.setattr(mc, name, counting(name))
  calls: list[tuple[Any, ...]] = []
  jitted = tree._jitted

  def recorded(*args: Any) -> Any:
    calls.append(args)
    return jitted(*args)

  monkeypatch.setattr(tree, "_jitted", recorded)
  return traced, calls, jitted


def test_the_switch_evicts_every_jit_mpx_keeps_at_module_level():
  # A jitted function of mpx's own outlives every form: the switch evicts
  # each one's traces (the steps a test jits are its own: CONTRIBUTING.md).
  kept = [
    value
    for module in pkgutil.iter_modules(mpx._src.__path__, "mpx._src.")
    for value in vars(importlib.import_module(module.name)).values()
    if callable(getattr(value, "clear_cache", None))
    and hasattr(value, "lower")
    and getattr(value, "__module__", "").startswith("mpx.")
  ]
  assert {id(f) for f in kept} == {id(f) for f in lowering_forms.OUTLIVE_A_FORM}, kept


@pytest.mark.parametrize("forms", [("gpu", "one-cpu", "gpu"), ("one-cpu", "gpu", "one-cpu")])
def test_an_eager_init_traces_again_in_each_form(monkeypatch, forms):
  # 4-bit moments are coded at init, eagerly in one jit cached by the coder
  # and the shapes: a trace kept from the form before would pack as it did.
  traced, calls, jitted = _spied(monkeypatch)
  params = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.adam(1e-3), moments="4bit")
  for form in forms:
    traced.clear()
    calls.clear()
    with forced(form):
      tx.init(params)
      # The programs the one jit runs now for the coder's arguments.
      texts = [jitted.lower(*call).as_text() for call in calls if call[0] is m4_compress]
    assert texts, "init coded no moments through jitted_when_eager"
    # Traced again: by shifts on XLA:CPU, by a bitcast alone on a GPU.
    assert traced["_pack" if form == "one-cpu" else "_pack_by_bitcast"] > 0, (form, traced)
    assert (traced["_pack"] > 0) == (form == "one-cpu"), (form, traced)
    # Packed by an OR-reduction of shifted codes on XLA:CPU (older jax lowers a
    # CPU program with the accelerator's branch beside it, so that one is no sign).
    ored = ["applies stablehlo.or" in text for text in texts]
    assert all(ored) if form == "one-cpu" else not any(ored), form


def test_a_switch_to_the_form_in_force_keeps_every_trace(monkeypatch):
  traced, _, _ = _spied(monkeypatch)
  params = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.adam(1e-3), moments="4bit")
  with forced("gpu"):
    tx.init(params)
    traced.clear()
    with forced("gpu"):
      tx.init(params)
  assert not traced, traced


def test_a_step_jitted_in_each_form_skips_as_that_form_does():
  # The GPU form skips by a select, the CPU's by a lax.cond.
  params = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  for form in ("gpu", "one-cpu", "gpu"):
    tx = mpx.mixed_precision(optax.adam(1e-3))
    with forced(form):
      text = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
    assert ("cond[" in text) == (form == "one-cpu"), form
