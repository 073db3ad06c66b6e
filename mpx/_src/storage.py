"""Where the full-precision weights live: a storage kind per param leaf, picked
by the ``masters=`` mode (docs/design.md, "The storage kinds")."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import rounding
from mpx._src import tree as tree_lib
from mpx._src.states import (
  MixedPrecision24bitState,
  MixedPrecisionRemainderState,
  MixedPrecisionState,
  MixedPrecisionStochasticState,
)

# What a kind's init takes a master from: the leaf itself, or its
# full-precision source under mpx.init_from_full_precision.
Sources = Callable[[Any], Any]
_FLOAT32 = np.dtype(np.float32)
_INT16 = np.dtype(np.int16)
_INT8 = np.dtype(np.int8)


class Committed(NamedTuple):
  """What a kind's ``commit`` returns for one leaf."""

  stored: Any  # what the state stores for the leaf after the step
  handoff: Any  # what param_update reads after the skip (by kind: None,
  # the new master as a Landed, the new param's bits, or the inner rule's update)


class Landed(NamedTuple):
  """What ``Remainder.commit`` hands ``param_update``: the new master, and
  (``Master24bit`` only; else None) whether the update was too small for the
  leaf's largest masters (see ``Master24bit``)."""

  master: jax.Array
  stalled: jax.Array | None  # bool scalar


class StorageKind(Protocol):
  """What one parameter leaf stores, and how a step moves it (the table above)."""

  @property
  def master_dtype(self) -> Any:
    """Returns the dtype the inner rule sees the leaf in; None: the param's own."""

  def init(self, param: Any, sources: Sources, index: int, seed: int) -> Any:
    """Returns what the state stores for ``param`` (the ``index``-th leaf)."""

  def stored_like(self, param: Any) -> Any:
    """Returns the shape and dtype of what ``init`` stores for ``param``."""

  def view(self, stored: Any, param: Any) -> Any:
    """Returns the master: what the inner rule sees for this leaf."""

  def commit(self, master: Any, update: Any, stored: Any, param: Any, step: Any) -> Committed:
    """Returns what the state stores after the inner rule's ``update`` of
    ``master``, and what ``param_update`` reads."""

  def param_update(self, stored: Any, handoff: Any, param: Any, applied: jax.Array) -> Any:
    """Returns the update that lands ``param`` on its new master's rounding
    (zero where not ``applied``)."""

  def sync(self, stored: Any, param: Any) -> Any:
    """Returns ``stored`` restarted wherever ``param`` was edited outside the
    optimizer."""


@dataclasses.dataclass(frozen=True)
class NoMaster:
  """A leaf at the master dtype or wider, or not floating: the inner rule
  updates the param itself, and the state holds ``optax.MaskedNode()``."""

  master_dtype: Any = None  # the inner rule sees the param (and its gradient) as it is

  def init(self, param: Any, sources: Sources, index: int, seed: int) -> Any:
    del param, sources, index, seed
    return optax.MaskedNode()

  def stored_like(self, param: Any) -> Any:
    del param
    return optax.MaskedNode()

  def view(self, stored: Any, param: Any) -> Any:
    del stored
    return param

  def commit(self, master: Any, update: Any, stored: Any, param: Any, step: Any) -> Committed:
    del master, param, step
    return Committed(stored, update)  # the update leaves the cond as it is (zero if skipped)

  def param_update(self, stored: Any, handoff: Any, param: Any, applied: jax.Array) -> Any:
    del stored, param, applied
    return handoff

  def sync(self, stored: Any, param: Any) -> Any:
    del param
    return stored  # no master, so nothing to restart after an edit


@dataclasses.dataclass(frozen=True)
class Copy:
  """A ``master_dtype`` copy; the param is its rounding to nearest (ties to
  even), saturating at the param dtype's largest finite value."""

  master_dtype: Any

  def init(self, param: Any, sources: Sources, index: int, seed: int) -> jax.Array:
    del index, seed
    return jnp.asarray(sources(param)).astype(self.master_dtype)

  def stored_like(self, param: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(param), self.master_dtype)

  def view(self, stored: jax.Array, param: Any) -> jax.Array:
    del param
    return stored

  def commit(self, master: jax.Array, update: Any, stored: Any, param: Any, step: Any) -> Committed:
    del stored, param, step
    # The new master is state. lax where the dtypes agree, since ``+`` on
    # tracers traces as a nested jit at every leaf.
    if getattr(update, "dtype", None) == master.dtype == self.master_dtype:
      return Committed(jax.lax.add(master, update), None)
    return Committed((master + update).astype(self.master_dtype), None)

  def rounded(self, master: jax.Array, param: jax.Array) -> jax.Array:
    """Returns the param ``master`` rounds to, in the param's dtype."""
    return tree_lib.saturating_cast(master, param.dtype)

  def param_update(self, stored: Any, handoff: Any, param: Any, applied: jax.Array) -> jax.Array:
    del handoff
    param = jnp.asarray(param)
    target = tree_lib.round_as(tree_lib.saturate(stored, param.dtype), param.dtype)
    # No op bound where a dtype already is: every op traced per leaf is paid
    # for again in compile time.
    dtype = self.master_dtype
    target, param = (x if x.dtype == dtype else x.astype(dtype) for x in (target, param))
    # Computed after the cond, the update fuses into optax.apply_updates.
    delta = jax.lax.sub(target, param)
    return jax.lax.select(applied, delta, jax.lax.full_like(delta, 0))

  def sync(self, stored: jax.Array, param: Any) -> jax.Array:
    """Keeps each master whose rounding is still the param; restarts the
    others from the param (edited outside the optimizer)."""
    param = jnp.asarray(param)
    kept = rounding.same_bits(self.rounded(stored, param), param)
    return jnp.where(kept, stored, param.astype(stored.dtype))


@dataclasses.dataclass(frozen=True)
class CopyTiesAway(Copy):
  """A float32 copy under a bfloat16 param, which is its rounding to nearest
  with ties away from zero (what a 16-bit remainder can encode), saturating.
  It commits and lands as ``Remainder`` does, without storing the remainder."""

  master_dtype: Any = _FLOAT32

  def init(self, param: Any, sources: Sources, index: int, seed: int) -> jax.Array:
    del index, seed
    return rounding.canonical(jnp.asarray(sources(param)).astype(jnp.float32))

  def commit(self, master: jax.Array, update: Any, stored: Any, param: Any, step: Any) -> Committed:
    """Returns the new master ``Remainder.commit`` lands (the remainder it
    computes is unread, so jit drops it) as what the state stores."""
    del stored
    return Committed(Remainder().commit(master, update, None, param, step).handoff.master, None)

  def rounded(self, master: jax.Array, param: jax.Array) -> jax.Array:
    del param
    return rounding.round_ties_away(rounding.canonical(master))

  def param_update(self, stored: Any, handoff: Any, param: Any, applied: jax.Array) -> jax.Array:
    """Lands ``param`` on ``rounded`` as ``Remainder.param_update`` does: the
    step's stored master is the one ``Remainder.commit`` hands it."""
    del handoff
    return Remainder().param_update(None, Landed(stored, None), param, applied)


@dataclasses.dataclass(frozen=True)
class Remainder:
  """The low 16 bits of a float32 master under a bfloat16 param (an int16):
  ``view`` joins them to the param into the master ``CopyTiesAway`` would
  hold. ``Master24bit`` stores the top 8 of them instead (an int8)."""

  master_dtype: Any = _FLOAT32
  stored_dtype: Any = _INT16  # int8: Master24bit's

  def init(self, param: Any, sources: Sources, index: int, seed: int) -> jax.Array:
    del index, seed
    master = rounding.canonical(jnp.asarray(sources(param)).astype(jnp.float32))
    return rounding.split(master)[1]

  def stored_like(self, param: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(param), self.stored_dtype)

  def view(self, stored: jax.Array, param: Any) -> jax.Array:
    """Returns the float32 master ``(param_bits << 16) + low``: ``low`` the
    stored int16 remainder, or the int8 correction shifted left by 8. Exact
    for every pair ``commit`` stores; a zero param under a negative ``low``
    (``rounding.wraps``, which it computes inline) joins as zero."""
    param = jnp.asarray(param)
    magnitude = jax.lax.bitwise_and(
      jax.lax.bitcast_convert_type(param, jnp.uint16).astype(rounding.U32), np.uint32(0x7FFF)
    )
    wraps = jax.lax.bitwise_and(
      jax.lax.eq(magnitude, np.uint32(0)), jax.lax.lt(stored, jnp.zeros_like(stored))
    )
    low = jax.lax.select(wraps, jnp.zeros_like(stored), stored)
    if self.stored_dtype == _INT8:  # the correction: the remainder's top 8 bits
      low = jax.lax.shift_left(low.astype(jnp.int32), np.int32(8))
    high = jax.lax.shift_left(
      jax.lax.bitcast_convert_type(param, jnp.uint16).astype(rounding.U32), np.uint32(16)
    )
    return rounding.from_bits(jax.lax.add(high, low.astype(jnp.int32).astype(rounding.U32)))

  def commit(self, master: jax.Array, update: Any, stored: Any, param: Any, step: Any) -> Committed:
    """Returns the new master's remainder (or correction) to store, and the
    new master (a ``Landed``) for ``param_update``.

    The sum ``master + update`` (a 24-bit master: rounded to 24 bits) is
    clipped to ``rounding.canonical``'s range and, where ``optax.apply_updates``
    cannot land the param on its ties-away rounding (a target more than 2**16
    times smaller than the param: the float32 update itself rounds), moved to
    where the param lands: the param is always exactly the rounding of its
    master, as a remainder needs. A 24-bit master's ``Landed`` also says
    whether the leaf's update stalled (see ``Master24bit``).
    """
    del stored, step
    # lax where the dtypes agree, since ``+`` on tracers traces as a nested
    # jit at every leaf.
    if getattr(update, "dtype", None) == master.dtype == jnp.float32:
      new = jax.lax.add(master, update)
    else:
      new = (master + update).astype(jnp.float32)
    is_24bit = self.stored_dtype == _INT8
    if is_24bit:
      new = rounding.round_to_24bit(new)
    new = jax.lax.clamp(-rounding.LIMIT, new, rounding.LIMIT)  # rounding.canonical
    rounded = rounding.round_ties_away_f32(new)
    # Where apply_updates lands the param (rounding.landing_f32).
    param32 = jax.lax.convert_element_type(param, jnp.float32)
    landed = tree_lib.round_as(jax.lax.add(param32, jax.lax.sub(rounded, param32)), jnp.bfloat16)
    exact = jax.lax.eq(rounding.to_bits(landed), rounding.to_bits(rounded))
    new = jax.lax.select(exact, new, landed)
    stalled = None
    if is_24bit:
      # Sampled: counting every element cost 4 B/param more per step on the
      # H100 compile (XLA:GPU does not fuse a reduction of AdamW's update into
      # the step at every size, and a fused one of the master copies params).
      # One variadic reduction of both samples, which XLA:GPU fuses with the
      # strided slices.
      samples = tuple(
        jnp.abs(jax.lax.slice(x, (0,) * x.ndim, x.shape, stall_strides(x.shape))).astype(
          jnp.float32
        )
        for x in (update, master)
      )
      largest_update, largest_master = jax.lax.reduce(
        samples,
        (np.float32(0), np.float32(0)),
        tree_lib.elementwise_max,
        tuple(range(samples[0].ndim)),
      )
      spacing = rounding.spacing_24bit(largest_master)
      stalled = jnp.logical_and(largest_update > 0, largest_update < spacing)
    low = rounding.remainder(new)
    if is_24bit:
      low = jax.lax.shift_right_arithmetic(low, np.int16(8)).astype(jnp.int8)
    # The new master leaves the cond: the param after it is its rounding.
    return Committed(low, Landed(new, stalled))

  def param_update(self, stored: Any, handoff: Landed, param: Any, applied: jax.Array) -> jax.Array:
    """Returns the update that lands ``param`` on the ties-away rounding of
    ``handoff``'s master, computed in float32 (sparing the update a round trip
    through bfloat16), zero where not ``applied``. Computed after the cond, it
    fuses into ``optax.apply_updates``."""
    del stored
    target = rounding.round_ties_away_f32(handoff.master)
    delta = jax.lax.sub(target, jnp.asarray(param).astype(jnp.float32))
    return jax.lax.select(applied, delta, jax.lax.full_like(delta, 0))

  def sync(self, stored: jax.Array, param: Any) -> jax.Array:
    """Restarts the remainders an edit broke: a param set to zero under a
    negative remainder (see ``view``); any other edit the master follows."""
    wraps = rounding.wraps(jnp.asarray(param), stored)
    return jnp.where(wraps, jnp.zeros_like(stored), stored)


@dataclasses.dataclass(frozen=True)
class Master24bit(Remainder):
  """The top 8 bits of a bfloat16 param's remainder (an int8): a 24-bit master
  (float32 with its low 8 bits zero, 15 bits of mantissa), to which each step's
  float32 result is rounded to nearest, ties away. Its view, commit, param
  update and ``sync`` are the remainder's (a zero param under a negative
  correction restarts at 0).

  An update smaller than half the spacing of 24-bit values is lost, so
  ``commit`` also reports whether the leaf's largest update falls below the
  spacing at its largest master: a learning rate too small for the largest
  weights (the state's ``stalled_steps``).
  """

  stored_dtype: Any = _INT8

  def init(self, param: Any, sources: Sources, index: int, seed: int) -> jax.Array:
    del index, seed
    master = rounding.canonical(jnp.asarray(sources(param)).astype(jnp.float32))
    return rounding.nearest_correction(master)


# The most elements of a leaf the stall check of ``Master24bit`` reads.
STALL_SAMPLE = 4096


def stall_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Returns the strides, one a dimension, of the stall check's sample of a
  leaf of ``shape``: spread evenly over every dimension, aiming at a 256th of
  the leaf's elements, at least 256 (a smaller leaf whole) and at most
  ``STALL_SAMPLE``. Where XLA:GPU writes the sample out (the update's, the
  master's), it costs at most 2 x 4 bytes / 256 = 0.03 bytes a param.

  The counts along the dimensions grow in turn by the smallest factor that
  keeps each count a divisor of its dimension: then a dimension split
  evenly over the devices (ZeRO-1 on a power-of-two mesh axis) holds its
  share of the sample on each device, and the check moves no data between
  them. A leaf whose dimensions have no small factors (a prime length) is
  sampled with uneven strides instead, where that alone reaches a quarter of
  the aim.

  Example:
    >>> stall_strides((1024, 512))  # 64 rows x 32 columns: 2048, a 256th
    (16, 16)
    >>> stall_strides((100,))  # under 256 elements: the whole leaf
    (1,)
  """
  target = min(math.prod(shape), STALL_SAMPLE, max(256, math.prod(shape) // 256))
  counts = [1] * len(shape)
  # First by the smallest factor of what each dimension has left; then, where
  # that fell short of a quarter of the aim, by doubling (uneven strides).
  # A sample of strides n // count reads ceil(n / (n // count)) elements
  # along a dimension of n.
  for by_factors in (True, False):
    sampled = math.prod(-(-n // (n // c)) for n, c in zip(shape, counts, strict=True))
    grown = by_factors or sampled < target // 4
    while grown:
      grown = False
      for d, n in enumerate(shape):
        left = n // counts[d]
        factor = 2
        if by_factors:  # the smallest factor above 1 (`left` itself if prime)
          factor = next((f for f in range(2, math.isqrt(left) + 1) if left % f == 0), left)
        larger = [*counts[:d], counts[d] * factor, *counts[d + 1 :]]
        sampled = math.prod(-(-n // (n // c)) for n, c in zip(shape, larger, strict=True))
        if counts[d] < larger[d] <= n and sampled <= target:
          counts[d], grown = larger[d], True
  return tuple(n // c for n, c in zip(shape, counts, strict=True))


def any_stalled(handoffs: list[Any]) -> jax.Array | None:
  """Returns whether any leaf's update stalled this step (a ``Landed``
  handoff says), or None where no leaf's kind checks."""
  flags = [h.stalled for h in handoffs if isinstance(h, Landed) and h.stalled is not None]
  if not flags:
    return None
  return functools.reduce(jnp.logical_or, flags, jnp.zeros((), bool))


def initialized(kind: Any, param: Any, sources: Sources, index: int, seed: int) -> Any:
  """Returns ``kind.init(param, sources, index, seed)``; eagerly, a master made
  from the leaf's source (``Copy``, ``Remainder`` and their subclasses, which
  read neither index nor seed) in one jitted call (``tree.jitted_when_eager``)."""
  if isinstance(kind, Copy | Remainder):
    return tree_lib.jitted_when_eager(_init_from, kind, sources(param))
  return kind.init(param, sources, index, seed)


def _init_from(kind: Copy | Remainder, source: Any) -> Any:
  return kind.init(source, lambda leaf: leaf, 0, 0)


def viewed(kind: Any, stored: Any, param: Any) -> Any:
  """Returns ``kind.view(stored, param)``, the leaf's float32 master; eagerly
  (``init``, ``mpx.master_params``) in one jitted call (``tree.jitted_when_eager``)."""
  return tree_lib.jitted_when_eager(type(kind).view, kind, stored, param)


@dataclasses.dataclass(frozen=True)
class Stochastic:
  """No master: the bfloat16 param is updated in float32 and rounded up or
  down at random. The state holds the leaf's uint32 key; its random bits come
  from the key, the element's position and the count of applied steps."""

  master_dtype: Any = _FLOAT32

  def init(self, param: Any, sources: Sources, index: int, seed: int) -> jax.Array:
    del param, sources  # keeps no master, so takes no full-precision source
    return jnp.asarray(rounding.leaf_key(seed, index))

  def stored_like(self, param: Any) -> jax.ShapeDtypeStruct:
    del param
    return jax.ShapeDtypeStruct((), jnp.uint32)

  def view(self, stored: Any, param: Any) -> jax.Array:
    del stored
    return jnp.asarray(param).astype(jnp.float32)

  def commit(
    self, master: jax.Array, update: Any, stored: Any, param: Any, step: jax.Array
  ) -> Committed:
    bits = rounding.random_bits(stored, step, np.shape(param))
    # lax where the dtypes agree, since ``+`` on tracers traces as a nested
    # jit at every leaf.
    if getattr(update, "dtype", None) == master.dtype == jnp.float32:
      value = jax.lax.add(master, update)
    else:
      value = (master + update).astype(jnp.float32)
    value = rounding.stochastic_round(value, bits)
    # The new param leaves the cond, as optax.apply_updates will land it, as
    # bits: a skipped step's select zeroes it, and a bfloat16 zero of the
    # param's shape is one XLA merges with the zero a scanned model's
    # backward pass starts its gradient from, then materializes for both.
    landed = rounding.landing(param, value)
    return Committed(stored, jax.lax.bitcast_convert_type(landed, jnp.uint16))

  def param_update(
    self, stored: Any, handoff: jax.Array, param: Any, applied: jax.Array
  ) -> jax.Array:
    del stored
    # Computed after the cond, the update fuses into optax.apply_updates.
    landed = jax.lax.bitcast_convert_type(handoff, jnp.bfloat16).astype(jnp.float32)
    delta = jax.lax.sub(landed, jnp.asarray(param).astype(jnp.float32))
    return jax.lax.select(applied, delta, jax.lax.full_like(delta, 0))

  def sync(self, stored: Any, param: Any) -> Any:
    del param
    return stored  # no master, so nothing to restart after an edit


@dataclasses.dataclass(frozen=True)
class Mode:
  """One ``masters=`` mode: its state type, the field of that state holding
  what is stored per leaf, and the kind it gives a bfloat16 param under
  float32 masters and (``"full"`` only) every other narrow param."""

  name: str
  state_type: type
  stored_field: str
  bfloat16_kind: StorageKind
  takes_other_narrow_params: bool
  # Whether its state counts the steps on which a leaf's update stalled
  # (``stalled_steps``, the 24-bit mode's).
  counts_stalls: bool = False

  def kind_for(self, param: Any, dtype: Any, path: tuple[Any, ...] | str) -> StorageKind:
    """Returns the kind of one param leaf under ``dtype`` masters, or a ValueError
    naming the leaf: ``path``, its key path (rendered for the error alone) or
    a name."""
    param_dtype = tree_lib.leaf_dtype(param)
    if not tree_lib.is_floating(param) or jnp.finfo(param_dtype).bits >= jnp.finfo(dtype).bits:
      return NoMaster()
    if param_dtype == jnp.bfloat16 and jnp.dtype(dtype) == jnp.float32:
      return self.bfloat16_kind
    if self.takes_other_narrow_params:
      return Copy(np.dtype(dtype))
    name = path if isinstance(path, str) else tree_lib.path_text(path)
    raise ValueError(
      f"mixed_precision(masters={self.name!r}): param {name!r} is "
      f"{param_dtype}, but this mode works on bfloat16 params under "
      "float32 masters (bfloat16 is the top half of float32). Keep such leaves "
      'under masters="full", e.g. with optax.partition.'
    )

  def kind_of_stored(self, stored: Any, param: Any) -> StorageKind:
    """Returns the kind of a leaf from what a state holds for it (no ``dtype`` at
    hand): a floating stored leaf is a master of its own dtype; any other
    stored leaf implies float32 masters."""
    if tree_lib.is_masked_node(stored):
      return NoMaster()
    stored_dtype = tree_lib.leaf_dtype(stored)
    dtype = stored_dtype if jnp.issubdtype(stored_dtype, jnp.floating) else jnp.float32
    return self.kind_for(param, dtype, "<stored>")

  def stored(self, state: Any) -> Any:
    """Returns the param-shaped tree of what ``state`` stores per leaf."""
    return getattr(state, self.stored_field)

  def state(
    self, stored: Any, applied: Any, nonfinite: Any, inner_state: Any, stalled: Any = None
  ) -> Any:
    """Returns the mode's state; ``stalled`` (the ``stalled_steps`` count, zero
    if None) only where the mode counts them."""
    if not self.counts_stalls:
      return self.state_type(stored, applied, nonfinite, inner_state)
    stalled = jnp.zeros((), jnp.int32) if stalled is None else stalled
    return self.state_type(stored, applied, nonfinite, stalled, inner_state)

  def stalled_steps(
    self, state: Any, handoffs: list[Any], first_stalled: jax.Array | None, applied: jax.Array
  ) -> jax.Array:
    """Returns ``state``'s ``stalled_steps`` plus one if a leaf's update stalled
    on this applied step (in a mode that ``counts_stalls``). ``first_stalled``:
    the same flag from the accelerator's first pass (None without one), which
    the step's own (zero on a skipped step) stands for on XLA:CPU."""
    stalled = any_stalled(handoffs)
    if stalled is None:
      stalled = jnp.zeros((), bool)
    if first_stalled is not None:
      stalled = tree_lib.by_platform(
        cpu=functools.partial(jnp.asarray, stalled),
        accelerator=functools.partial(jnp.logical_and, first_stalled, applied),
      )
    return state.stalled_steps + stalled.astype(jnp.int32)

  def map_stored(self, fn: Callable[[StorageKind, Any, Any], Any], state: Any, params: Any) -> Any:
    """Returns the tree of ``fn(kind, stored, param)`` over ``state``'s leaves
    and ``params``; raises ValueError where the trees differ."""
    return jax.tree.map(
      lambda stored, param: fn(self.kind_of_stored(stored, param), stored, param),
      self.stored(state),
      params,
      is_leaf=tree_lib.is_masked_node,
    )


MODES = {
  "full": Mode("full", MixedPrecisionState, "master_params", CopyTiesAway(), True),
  "remainder": Mode(
    "remainder", MixedPrecisionRemainderState, "master_remainders", Remainder(), False
  ),
  "24bit": Mode(
    "24bit",
    MixedPrecision24bitState,
    "master_corrections",
    Master24bit(),
    False,
    counts_stalls=True,
  ),
  "stochastic": Mode(
    "stochastic", MixedPrecisionStochasticState, "rounding_keys", Stochastic(), False
  ),
}
MODE_OF_STATE = {mode.state_type: mode for mode in MODES.values()}
