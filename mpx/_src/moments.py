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
the inner rule made them.

Compression rounds stochastically: the bits come from ``seed``, the leaf's
position in the inner state and the count of applied steps (the counter the
stochastic masters use), so a slow average such as Adam's ``nu`` (``b2 =
0.999``: each step moves it by 0.1%, below a bfloat16 half-ulp) is unbiased
instead of stuck.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import rounding
from mpx._src import tree as tree_lib
from mpx._src.states import COMPRESSED_MOMENTS, Bfloat16Moment

FORMATS = ("full", "bfloat16")
DEFAULT_FIELDS = ("mu", "nu", "trace")
# Below this many elements a leaf is not worth a code (and a block scale).
MIN_SIZE = 4096
# Moment keys are drawn apart from the masters' keys (rounding.leaf_key on
# the param index) by salting the seed.
_SEED_SALT = 0x5BD1E995


@dataclasses.dataclass(frozen=True)
class FullMoment:
  """A leaf of the inner state kept as the inner rule made it."""

  def stored_like(self, leaf: Any) -> Any:
    return leaf

  def decompress(self, stored: Any) -> Any:
    return stored

  def compress(self, value: Any, stored: Any, step: jax.Array) -> Any:
    del stored, step
    return value


FULL = FullMoment()


@dataclasses.dataclass(frozen=True)
class Bfloat16MomentKind:
  """A float32 leaf stored as bfloat16 (2 bytes per element), rounded
  stochastically with the leaf's ``key``."""

  key: int

  def stored_like(self, leaf: Any) -> Any:
    like: Any = jax.ShapeDtypeStruct(np.shape(leaf), jnp.bfloat16)
    return Bfloat16Moment(like)

  def decompress(self, stored: Bfloat16Moment) -> jax.Array:
    return jax.lax.convert_element_type(stored.values, jnp.float32)

  def compress(self, value: jax.Array, stored: Any, step: jax.Array) -> Bfloat16Moment:
    del stored
    bits = rounding.random_bits(jnp.uint32(self.key), step, np.shape(value))
    return Bfloat16Moment(rounding.stochastic_round(value, bits))


@dataclasses.dataclass(frozen=True)
class MomentsFormat:
  """One ``moments=`` setting: the format, the fields it compresses and the
  seed of its random bits."""

  name: str
  fields: tuple[str, ...]
  seed: int

  def kinds(self, inner_state: Any) -> list[Any]:
    """The moment kind of each leaf of ``inner_state`` (a state as the inner
    rule makes it, or its abstract shapes), in flattening order."""
    flat = jax.tree_util.tree_flatten_with_path(inner_state)[0]
    return [self._kind(index, path, leaf) for index, (path, leaf) in enumerate(flat)]

  def _kind(self, index: int, path: tuple[Any, ...], leaf: Any) -> Any:
    if self.name == "full" or not self.compresses(path, leaf):
      return FULL
    key = int(rounding.leaf_key(self.seed ^ _SEED_SALT, index))
    return Bfloat16MomentKind(key)

  def compresses(self, path: tuple[Any, ...], leaf: Any) -> bool:
    """Whether a leaf at ``path`` is a moment this format compresses."""
    return (
      _field_of(path, self.fields) is not None
      and tree_lib.is_floating(leaf)
      and tree_lib.leaf_dtype(leaf) == jnp.float32
      and int(np.prod(np.shape(leaf))) >= MIN_SIZE
    )

  def check_fields_exist(self, inner_state: Any) -> None:
    """Refuses a field named by the user that no state of the inner rule has."""
    if self.name == "full" or self.fields == DEFAULT_FIELDS:
      return
    found = {
      getattr(key, "name", None)
      for path, _ in jax.tree_util.tree_flatten_with_path(inner_state)[0]
      for key in path
    }
    missing = [field for field in self.fields if field not in found]
    if missing:
      fields = sorted(name for name in found if isinstance(name, str))
      raise ValueError(
        f"mixed_precision: moment_fields {missing} match no field of the inner rule's "
        f"state, whose fields are {fields}. Name fields of its state (e.g. Adan's "
        "'m', 'v', 'n'), or leave moment_fields at its default ('mu', 'nu', 'trace')."
      )


def _field_of(path: tuple[Any, ...], fields: Sequence[str]) -> str | None:
  """The innermost NamedTuple field along ``path`` that is one of ``fields``."""
  for key in reversed(path):
    name = getattr(key, "name", None)
    if isinstance(key, jax.tree_util.GetAttrKey) and name in fields:
      return name
  return None


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
  if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
    raise ValueError(
      "mixed_precision: moment_fields must be a sequence of field names, e.g. "
      f"('mu', 'nu'), got {fields!r}."
    )
  return MomentsFormat(moments, tuple(fields), seed)


def flatten_stored(stored_inner: Any) -> tuple[list[Any], Any]:
  """A stored inner state's leaves with each compressed moment as one leaf."""
  return jax.tree.flatten(stored_inner, is_leaf=_is_compressed)


def _is_compressed(x: Any) -> bool:
  return isinstance(x, COMPRESSED_MOMENTS)


def decompressed(stored_inner: Any) -> Any:
  """``stored_inner`` with every compressed moment decompressed to float32."""

  def leaf(x: Any) -> Any:
    if isinstance(x, Bfloat16Moment):
      return jax.lax.convert_element_type(jnp.asarray(x.values), jnp.float32)
    return x

  return jax.tree.map(leaf, stored_inner, is_leaf=_is_compressed)
