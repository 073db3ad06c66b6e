"""Where the inner rule's moments live: as it made them, in bfloat16, or in 8 bits.

The second kind of storage of ``mixed_precision`` (the first, the masters, is
:mod:`mpx._src.storage`). The inner rule always runs in float32 on float32
moments; a *moment kind* per leaf of its state says how the leaf is stored
between steps: ``decompress`` before the rule runs and ``compress`` after it,
both inside the skip ``lax.cond``, so a skipped step writes no stored byte.

Which leaves: those under a field named in ``fields`` (``mu``, ``nu`` and
``trace`` by default: Adam's, Lion's, momentum's moments) of any optax state
inside the inner rule, floating, with at least :data:`MIN_SIZE` elements.
Counts, injected hyperparameters, small leaves and everything else stay as
the inner rule made them. Under ``"8bit"`` each field is signed (a first
moment) or non-negative (a second moment, whose code never turns a positive
value into zero): ``nu`` and ``nu_max`` are non-negative, other names signed
(but for the optax states in :data:`KNOWN_SIGNS`, such as SM3's), unless the
user maps names to kinds. A leaf whose last axis is shorter than
:data:`MIN_ROW_8BIT` is stored in bfloat16 instead: its blocks (one per row)
would cost more in scales than 8 bits save.

The codes themselves are :mod:`mpx._src.moment_codes`. Compression rounds
stochastically: the bits come from ``seed``, the leaf's position in the inner
state and the count of applied steps (the counter the stochastic masters
use), so a slow average such as Adam's ``nu`` (``b2 = 0.999``: each step
moves it by 0.1%, below a bfloat16 half-ulp) is unbiased instead of stuck.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import moment_codes, rounding
from mpx._src import tree as tree_lib
from mpx._src.states import (
  COMPRESSED_MOMENTS,
  Bfloat16Moment,
  Nonnegative8bitMoment,
  Signed8bitMoment,
)

FORMATS = ("full", "bfloat16", "8bit")
DEFAULT_FIELDS = ("mu", "nu", "trace")
# The fields a sequence of names takes as second moments (everything else
# named is signed); a mapping names each field's kind.
NONNEGATIVE_FIELDS = ("nu", "nu_max")
# optax states whose fields break that naming rule: SM3 keeps its
# accumulators of squares in ``mu`` and its momentum in ``nu``.
KNOWN_SIGNS = {("ScaleBySM3State", "mu"): "nonnegative", ("ScaleBySM3State", "nu"): "signed"}
SIGNS = ("signed", "nonnegative")
# Below this many elements a leaf is not worth a code (and a block scale).
MIN_SIZE = 4096
# Under "8bit", a last axis shorter than this is stored in bfloat16: a block
# per row of fewer than 16 elements costs 1.25 bytes an element or more.
MIN_ROW_8BIT = 16
# Moment keys are drawn apart from the masters' keys (rounding.leaf_key on
# the param index) by salting the seed.
_SEED_SALT = 0x5BD1E995
_STORED_8BIT = {"signed": Signed8bitMoment, "nonnegative": Nonnegative8bitMoment}


@dataclasses.dataclass(frozen=True)
class FullMoment:
  """A leaf of the inner state kept as the inner rule made it."""

  compressed = False

  def stored_like(self, leaf: Any) -> Any:
    return leaf

  def decompress(self, stored: Any) -> Any:
    return stored

  def compress(self, value: Any, step: jax.Array) -> Any:
    del step
    return value


FULL = FullMoment()


@dataclasses.dataclass(frozen=True)
class Bfloat16MomentKind:
  """A float32 leaf stored as bfloat16 (2 bytes per element), rounded
  stochastically with the leaf's ``key``."""

  key: int
  compressed = True

  def stored_like(self, leaf: Any) -> Any:
    like: Any = jax.ShapeDtypeStruct(np.shape(leaf), jnp.bfloat16)
    return Bfloat16Moment(like)

  def decompress(self, stored: Bfloat16Moment) -> jax.Array:
    return moment_codes.decode_bfloat16(stored.values)

  def compress(self, value: jax.Array, step: jax.Array) -> Bfloat16Moment:
    key = jnp.uint32(self.key)
    return Bfloat16Moment(moment_codes.encode_bfloat16(value, key, step, stochastic=True))


@dataclasses.dataclass(frozen=True)
class EightBitMomentKind:
  """A float32 leaf stored as one uint8 code per element and a float32 scale
  per block along its last axis, rounded stochastically with the leaf's
  ``key``; ``sign`` picks the code (``"signed"`` or ``"nonnegative"``)."""

  key: int
  sign: moment_codes.Kind
  compressed = True

  def stored_like(self, leaf: Any) -> Any:
    shape = tuple(np.shape(leaf))
    _, blocks = moment_codes.block_layout(shape)
    codes: Any = jax.ShapeDtypeStruct(shape, jnp.uint8)
    scales: Any = jax.ShapeDtypeStruct((*shape[:-1], blocks) if shape else (1,), jnp.float32)
    return _STORED_8BIT[self.sign](codes, scales)

  def decompress(self, stored: Any) -> jax.Array:
    codes, scales = (jnp.asarray(part) for part in stored)
    return moment_codes.decode(moment_codes.QuantizedMoment(codes, scales), self.sign)

  def compress(self, value: jax.Array, step: jax.Array) -> Any:
    key = jnp.uint32(self.key)
    coded = moment_codes.encode(value, self.sign, key, step, stochastic=True)
    return _STORED_8BIT[self.sign](*coded)


@dataclasses.dataclass(frozen=True)
class MomentsFormat:
  """One ``moments=`` setting: the format, the fields it compresses (each
  with its sign, ``"signed"`` or ``"nonnegative"``) and the seed of its
  random bits."""

  name: str
  fields: tuple[tuple[str, str], ...]
  seed: int
  # Whether the user named each field's sign (a mapping): then it overrides
  # the signs mpx knows of optax's states.
  signs_named: bool = False

  @property
  def field_names(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.fields)

  def kinds(self, inner_state: Any) -> list[Any]:
    """The moment kind of each leaf of ``inner_state`` (a state as the inner
    rule makes it, or its abstract shapes), in flattening order."""
    if self.name == "full":
      return [FULL] * len(jax.tree.leaves(inner_state))
    owners = _owners(inner_state, self.field_names)
    leaves = jax.tree.leaves(inner_state)
    return [
      self._kind(index, owner, leaf)
      for index, (owner, leaf) in enumerate(zip(owners, leaves, strict=True))
    ]

  def _kind(self, index: int, owner: tuple[str, str] | None, leaf: Any) -> Any:
    if owner is None or not _compressible(leaf):
      return FULL
    key = int(rounding.leaf_key(self.seed ^ _SEED_SALT, index))
    shape = np.shape(leaf)
    if self.name == "bfloat16" or not shape or shape[-1] < MIN_ROW_8BIT:
      return Bfloat16MomentKind(key)
    state_name, field = owner
    sign = dict(self.fields)[field]
    if not self.signs_named:
      sign = KNOWN_SIGNS.get((state_name, field), sign)
    return EightBitMomentKind(key, "nonnegative" if sign == "nonnegative" else "signed")

  def check_fields_exist(self, inner_state: Any) -> None:
    """Refuses a field named by the user that no state of the inner rule has."""
    if self.name == "full" or self.field_names == DEFAULT_FIELDS:
      return
    found = {
      getattr(key, "name", None)
      for path, _ in jax.tree_util.tree_flatten_with_path(inner_state)[0]
      for key in path
    }
    missing = [field for field in self.field_names if field not in found]
    if missing:
      fields = sorted(name for name in found if isinstance(name, str))
      raise ValueError(
        f"mixed_precision: moment_fields {missing} match no field of the inner rule's "
        f"state, whose fields are {fields}. Name fields of its state (e.g. Adan's "
        "'m', 'v', 'n'), or leave moment_fields at its default ('mu', 'nu', 'trace')."
      )


def _compressible(leaf: Any) -> bool:
  return (
    tree_lib.is_floating(leaf)
    and tree_lib.leaf_dtype(leaf) == jnp.float32
    and int(np.prod(np.shape(leaf))) >= MIN_SIZE
  )


def _owners(tree: Any, fields: Sequence[str]) -> list[tuple[str, str] | None]:
  """Per leaf of ``tree``, in flattening order: ``(state class name, field)``
  of the innermost NamedTuple field along its path that is one of
  ``fields``, or None."""
  out: list[tuple[str, str] | None] = []

  def walk(node: Any, owner: tuple[str, str] | None) -> None:
    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    if len(children) == 1 and children[0][1] is node:  # a leaf
      out.append(owner)
      return
    for path, child in children:
      key, inner = path[0], owner
      if isinstance(key, jax.tree_util.GetAttrKey) and key.name in fields:
        inner = (type(node).__name__, key.name)
      walk(child, inner)

  walk(tree, None)
  return out


def check_format(moments: Any, fields: Any, seed: int, dtype: Any) -> MomentsFormat:
  """The validated ``moments=`` and ``moment_fields=`` settings."""
  if moments not in FORMATS:
    raise ValueError(
      f"mixed_precision: moments must be one of {', '.join(map(repr, FORMATS))}, got {moments!r}."
    )
  if moments != "full" and jnp.dtype(dtype) != jnp.float32:
    raise ValueError(
      f"mixed_precision: moments={moments!r} compresses a float32 inner state; dtype is "
      f"{jnp.dtype(dtype)}. Use float32 masters, or moments='full'."
    )
  return MomentsFormat(moments, _field_signs(fields), seed, isinstance(fields, Mapping))


def _field_signs(fields: Any) -> tuple[tuple[str, str], ...]:
  """``moment_fields`` as ``(name, sign)`` pairs: a mapping names each sign;
  in a sequence, :data:`NONNEGATIVE_FIELDS` are second moments."""
  if isinstance(fields, Mapping):
    pairs = tuple(fields.items())
    bad = [(name, sign) for name, sign in pairs if not isinstance(name, str) or sign not in SIGNS]
    if bad:
      raise ValueError(
        "mixed_precision: moment_fields maps each field name to 'signed' (a first "
        "moment, e.g. {'mu': 'signed'}) or 'nonnegative' (a second moment, never "
        f"decoded to zero, e.g. {{'nu': 'nonnegative'}}); got {bad}."
      )
    return pairs
  if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
    raise ValueError(
      "mixed_precision: moment_fields must be a sequence of field names, e.g. "
      "('mu', 'nu'), or a mapping of names to 'signed' or 'nonnegative', got "
      f"{fields!r}."
    )
  return tuple((f, "nonnegative" if f in NONNEGATIVE_FIELDS else "signed") for f in fields)


def flatten_stored(stored_inner: Any) -> tuple[list[Any], Any]:
  """A stored inner state's leaves with each compressed moment as one leaf."""
  return jax.tree.flatten(stored_inner, is_leaf=is_compressed)


def is_compressed(x: Any) -> bool:
  """Whether ``x`` is a stored compressed moment (one node for one leaf)."""
  return isinstance(x, COMPRESSED_MOMENTS)


# The kind that decompresses each stored form (a key matters only to compress).
_KIND_OF_STORED: dict[type, Bfloat16MomentKind | EightBitMomentKind] = {
  Bfloat16Moment: Bfloat16MomentKind(0),
  Signed8bitMoment: EightBitMomentKind(0, "signed"),
  Nonnegative8bitMoment: EightBitMomentKind(0, "nonnegative"),
}


def decompressed(stored_inner: Any) -> Any:
  """``stored_inner`` with every compressed moment decompressed to float32."""

  def leaf(x: Any) -> Any:
    kind = _KIND_OF_STORED.get(type(x))
    return x if kind is None else kind.decompress(x)

  return jax.tree.map(leaf, stored_inner, is_leaf=is_compressed)
