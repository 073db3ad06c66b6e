"""Where the full-precision weights live: ``mixed_precision``'s three modes.

For every parameter leaf, a *storage kind* says what the optimizer state
holds, what the inner rule and ``mpx.master_params`` see (the master view), what a step writes back
inside the skip ``lax.cond``, and which update moves the parameter after it.
``mixed_precision`` runs the same five steps whatever the kinds; this module
holds everything that differs.

=============  =========================================  ===================
kind           state per parameter                         parameter
=============  =========================================  ===================
``Copy``       a ``dtype`` copy (4 bytes for float32)      nearest, ties even
``Bfloat16``   a float32 copy (4 bytes)                    nearest, ties away
``Remainder``  the low 16 bits of the float32 master (2)   nearest, ties away
``Stochastic`` nothing (a 4-byte key per leaf)             rounded at random
``NoMaster``   nothing: the param is its own master        (updated in place)
=============  =========================================  ===================

``masters="full"`` uses ``Bfloat16`` for bfloat16 params under float32 masters
and ``Copy`` for every other narrow leaf (float16, fp8, or float64 masters);
``"remainder"`` and ``"stochastic"`` apply to bfloat16 params under float32
masters only. ``Bfloat16`` and ``Remainder`` round and land identically (see
:mod:`mpx._src.rounding`), so a run may switch between them bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpx._src import rounding
from mpx._src import tree as tree_lib

MODES = ("full", "remainder", "stochastic")


class MixedPrecisionRemainderState(NamedTuple):
  """State of :func:`mpx.mixed_precision` with ``masters="remainder"``.

  Attributes:
    master_remainders: the parameter tree with, at every bfloat16 leaf, the
      int16 that completes it to its float32 master (``join(param,
      remainder)`` in :mod:`mpx._src.rounding`), and ``optax.MaskedNode()``
      at every other leaf. Use :func:`mpx.master_params` for the masters.
    inner_state: the wrapped rule's state, built on the float32 master view.
  """

  master_remainders: optax.Params
  inner_state: optax.OptState


class MixedPrecisionStochasticState(NamedTuple):
  """State of :func:`mpx.mixed_precision` with ``masters="stochastic"``.

  Attributes:
    rounding_keys: the parameter tree with a uint32 scalar at every bfloat16
      leaf (its stream of random bits, from ``seed`` and the leaf's position)
      and ``optax.MaskedNode()`` at every other leaf.
    rounding_count: int32, the number of applied steps: the counter of the
      random bits. A skipped step does not advance it.
    inner_state: the wrapped rule's state, built on the params in float32.
  """

  rounding_keys: optax.Params
  rounding_count: jax.Array
  inner_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class NoMaster:
  """A leaf at ``dtype`` or wider, or not floating: updated in place, with
  ``optax.MaskedNode()`` where a master would be."""


@dataclasses.dataclass(frozen=True)
class Copy:
  """A ``dtype`` master copy; the param is its rounding to nearest (ties to
  even), saturating at the param dtype's largest finite value."""

  # Whether the new param leaves the skip cond (it cannot be derived from
  # what is stored after it).
  emits_param: ClassVar[bool] = False

  def store(self, param: Any, source: Any, dtype: Any) -> jax.Array:
    del param
    return jnp.asarray(source).astype(dtype)

  def view(self, stored: jax.Array, param: Any) -> jax.Array:
    del param
    return stored

  def commit(self, master: jax.Array, stored: Any, param: Any, bits: Any) -> tuple[Any, Any]:
    del stored, param, bits
    return master, None

  def target(self, stored: jax.Array, out: Any, param: jax.Array) -> jax.Array:
    del out
    return tree_lib.saturating_cast(stored, param.dtype)


@dataclasses.dataclass(frozen=True)
class Bfloat16(Copy):
  """A float32 master under a bfloat16 param, rounded ties away from zero.

  Where ``optax.apply_updates`` cannot land the param on that rounding (a
  target more than 2**16 times smaller than the param: the update rounds in
  float32), the master is moved to where the param lands, so the param is
  always exactly the rounding of its master, as a remainder requires.
  """

  def store(self, param: Any, source: Any, dtype: Any) -> jax.Array:
    del param, dtype
    return rounding.canonical(jnp.asarray(source).astype(jnp.float32))

  def commit(self, master: jax.Array, stored: Any, param: Any, bits: Any) -> tuple[Any, Any]:
    del stored, bits
    master, _ = _land(master, param)
    return master, None

  def target(self, stored: jax.Array, out: Any, param: jax.Array) -> jax.Array:
    del out, param
    return rounding.round_ties_away(stored)


@dataclasses.dataclass(frozen=True)
class Remainder:
  """The low 16 bits of a float32 master under a bfloat16 param (int16)."""

  emits_param: ClassVar[bool] = True

  def store(self, param: Any, source: Any, dtype: Any) -> jax.Array:
    del param, dtype
    _, remainder = rounding.split(rounding.canonical(jnp.asarray(source).astype(jnp.float32)))
    return remainder

  def view(self, stored: jax.Array, param: jax.Array) -> jax.Array:
    return rounding.join(param, stored)

  def commit(self, master: jax.Array, stored: Any, param: Any, bits: Any) -> tuple[Any, Any]:
    del stored, bits
    master, _ = _land(master, param)
    _, remainder = rounding.split(master)
    return remainder, master  # the new master leaves the cond: it is not state

  def target(self, stored: Any, out: jax.Array, param: Any) -> jax.Array:
    del stored, param
    return rounding.round_ties_away(out)


@dataclasses.dataclass(frozen=True)
class Stochastic:
  """No master: the bfloat16 param, updated in float32 and rounded at random.
  What is stored is the leaf's uint32 key of random bits."""

  emits_param: ClassVar[bool] = True

  def view(self, stored: Any, param: jax.Array) -> jax.Array:
    del stored
    return param.astype(jnp.float32)

  def commit(self, value: jax.Array, stored: Any, param: Any, bits: Any) -> tuple[Any, Any]:
    # The landing of the rounded value: what optax.apply_updates will produce.
    return stored, rounding.landing(param, rounding.stochastic_round(value, bits))

  def target(self, stored: Any, out: jax.Array, param: Any) -> jax.Array:
    del stored, param
    return out


def _land(master: jax.Array, param: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(master, new_param)``: the canonical master and its ties-away rounding,
  both moved to where ``optax.apply_updates`` lands ``param`` if that is not
  the rounding (see ``rounding.landing``)."""
  master = rounding.canonical(master)
  target = rounding.round_ties_away(master)
  landed = rounding.landing(param, target)
  exact = rounding.same_bits(landed, target)
  return jax.lax.select(exact, master, landed.astype(jnp.float32)), landed


def kind_for(mode: str, param: Any, dtype: Any, path: str) -> Any:
  """The storage kind of one param leaf, or a ValueError naming the leaf."""
  if not tree_lib.is_floating(param) or tree_lib.float_bits(param) >= jnp.finfo(dtype).bits:
    return NoMaster()
  is_bf16 = tree_lib.leaf_dtype(param) == jnp.bfloat16 and jnp.dtype(dtype) == jnp.float32
  if mode == "full":
    return Bfloat16() if is_bf16 else Copy()
  if not is_bf16:
    raise ValueError(
      f"mixed_precision(masters={mode!r}): param {path!r} is "
      f"{tree_lib.leaf_dtype(param)}, but this mode works on bfloat16 params under "
      "float32 masters (bfloat16 is the top half of float32). Keep such leaves "
      'under masters="full", e.g. with optax.partition.'
    )
  return Remainder() if mode == "remainder" else Stochastic()


def rounded_update(
  kind: Any, stored: Any, out: Any, param: Any, applied: jax.Array, dtype: Any
) -> jax.Array:
  """After the cond: the update that moves ``param`` onto its new rounding,
  zero on a skipped step. It fuses into ``optax.apply_updates``."""
  param = jnp.asarray(param)
  target = kind.target(stored, out, param)
  delta = jax.lax.sub(target.astype(dtype), param.astype(dtype))
  return jax.lax.select(applied, delta, jax.lax.full_like(delta, 0))
