"""Where the inner rule's moments live: as it made them, in bfloat16, 8 or 4 bits.

:class:`MomentsFormat` (one ``moments=`` setting) picks a moment kind
(moment_codes.py) per leaf of the inner state (docs/moment_codes.md);
:func:`compressed` and :func:`decompressed` store and read a whole inner
state. The accelerator codes 8- and 4-bit moments in two passes (two_pass.py).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import adapters, moment_codes, rounding, validation
from mpx._src import tree as tree_lib
from mpx._src.moment_codes import (
  SIGNS,
  UNCOMPRESSED,
  Bfloat16Compressed,
  BlockScaledKind,
  EightBitCompressed,
  FourBitCompressed,
  MomentKind,
  Sign,
)
from mpx._src.states import (
  COMPRESSED_MOMENTS,
  Bfloat16Moment,
  Nonnegative4bitMoment,
  Nonnegative8bitMoment,
  Signed4bitMoment,
  Signed8bitMoment,
)

FORMATS = ("full", "bfloat16", "8bit", "4bit")
DEFAULT_FIELDS = ("mu", "nu", "trace")
# The fields a sequence of names takes as second moments (everything else
# named is signed); a mapping names each field's sign.
NONNEGATIVE_FIELDS = ("nu", "nu_max")
# Below this many elements a leaf is not worth a code (and a block scale).
MIN_SIZE = 4096
# Under "8bit", a last axis shorter than this is stored in bfloat16: a block
# per row this short costs more in scales than 8 bits save.
MIN_ROW_8BIT = 16
# Moment keys are drawn apart from the masters' keys (rounding.leaf_key on
# the param index) by salting the seed.
_SEED_SALT = 0x5BD1E995


@dataclasses.dataclass(frozen=True)
class MomentsFormat:
  """Records one ``moments=`` setting: as written, the fields it compresses
  (each with its format and sign) and the seed of its random bits; picks the
  moment kind of each leaf of an inner state (:meth:`kinds`)."""

  name: str  # the setting as the user would write it: "'8bit'", "{'mu': '8bit'}"
  fields: tuple[tuple[str, str, Sign], ...]  # (field, format, sign)
  seed: int
  # Whether the user named each field's sign (a mapping): then it overrides
  # the signs mpx knows of optax's states.
  signs_named: bool = False
  # Whether any leaf may be stored other than as the inner rule made it: with
  # "full" the step stores the inner state as it is and never asks this module.
  compresses: bool = True
  # Whether any field is coded in 8 or 4 bits against block scales: then the
  # accelerator's step codes in two passes (first_pass).
  block_scaled: bool = False

  def kinds(self, inner_state: Any) -> list[MomentKind]:
    """Returns the moment kind of each leaf of ``inner_state`` (a state as the
    inner rule makes it, or its abstract shapes), in flattening order: a leaf
    under a field this setting compresses, float32 with at least
    :data:`MIN_SIZE` elements, in its field's format; every other leaf as it is."""
    leaves = jax.tree.leaves(inner_state)
    if not self.compresses:
      return [UNCOMPRESSED] * len(leaves)
    per_field = {field: (code, sign) for field, code, sign in self.fields}
    kinds: list[MomentKind] = []
    owners = _owners(inner_state, per_field)
    for index, (owner, leaf) in enumerate(zip(owners, leaves, strict=True)):
      code, sign = per_field[owner[1]] if owner is not None else ("full", "signed")
      if (
        owner is None
        or code == "full"
        or not tree_lib.is_floating(leaf)
        or tree_lib.leaf_dtype(leaf) != jnp.float32
        or int(np.prod(np.shape(leaf))) < MIN_SIZE
      ):
        kinds.append(UNCOMPRESSED)
        continue
      state_name, field = owner
      key = int(rounding.leaf_key(self.seed ^ _SEED_SALT, index))
      shape = np.shape(leaf)
      # A row too short for a code's block scales to pay is stored in bfloat16.
      shortest = MIN_ROW_8BIT if code == "8bit" else moment_codes.MIN_ROW_4BIT
      if not self.signs_named:
        sign = adapters.KNOWN_SIGNS.get((state_name, field), sign)
      if code == "bfloat16" or not shape or shape[-1] < shortest:
        kinds.append(Bfloat16Compressed(key))
      elif code == "8bit":
        kinds.append(EightBitCompressed(key, sign))
      else:
        kinds.append(FourBitCompressed(key, sign))
    return kinds

  def check_fields(self, inner_state: Any) -> None:
    """Refuses a field named by the user that no state of the inner rule has,
    and a field this setting would compress that its rule needs exact
    (``inner_state`` as the inner rule's ``init`` makes it)."""
    if not self.compresses:
      return
    field_names = tuple(name for name, _, _ in self.fields)
    found = {
      getattr(key, "name", None)
      for path, _ in jax.tree_util.tree_flatten_with_path(inner_state)[0]
      for key in path
    }
    missing = [field for field in field_names if field not in found]
    if missing and field_names != DEFAULT_FIELDS:
      fields = sorted(name for name in found if isinstance(name, str))
      raise ValueError(
        f"mixed_precision: moment fields {missing} match no field of the inner rule's "
        f"state, whose fields are {fields}. Name fields of its state (e.g. Adan's "
        "'m', 'v', 'n'), or leave moment_fields at its default ('mu', 'nu', 'trace')."
      )
    codes = {field: code for field, code, _ in self.fields}
    owners = _owners(inner_state, codes)
    for owner, kind in zip(owners, self.kinds(inner_state), strict=True):
      if kind.compressed and owner is not None:
        state_name, field = owner
        validation.check_field_compressible(state_name, field, codes[field])


def _owners(tree: Any, fields: Collection[str]) -> list[tuple[str, str] | None]:
  """Returns, per leaf of ``tree`` in flattening order, ``(state class name,
  field)`` of the innermost NamedTuple field along its path that is one of
  ``fields``, or None: a walk down the tree, one level at a time, since a
  key path does not name the classes it passes through."""
  owners: list[tuple[str, str] | None] = []
  pending: list[tuple[Any, tuple[str, str] | None]] = [(tree, None)]
  while pending:
    node, owner = pending.pop()
    # Flattened one level: every node below this one is a leaf here.
    below = functools.partial(operator.is_not, node)
    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=below)[0]
    if len(children) == 1 and children[0][1] is node:  # a leaf
      owners.append(owner)
      continue
    for path, child in reversed(children):  # popped first to last
      key = path[0]
      named = isinstance(key, jax.tree_util.GetAttrKey) and key.name in fields
      pending.append((child, (type(node).__name__, key.name) if named else owner))
  return owners


def check_format(moments: Any, fields: Any, seed: int, dtype: Any) -> MomentsFormat:
  """Returns the validated ``moments=`` and ``moment_fields=`` settings.

  ``moments`` is one format for every field of ``moment_fields``, or a mapping
  of field names to formats (its keys then are the fields; ``moment_fields``
  may still name their signs). A mapping is any object ``dict()`` reads as
  one (a ``Mapping``, or a config object with ``keys()`` such as
  ``ml_collections.ConfigDict``)."""
  moments, fields = as_dict(moments), as_dict(fields)
  per_field = isinstance(moments, dict)
  codes = list(moments.values()) if per_field else [moments]
  if not codes or any(not isinstance(c, str) or c not in FORMATS for c in codes):
    raise ValueError(
      f"mixed_precision: moments must be one of {', '.join(map(repr, FORMATS))}, or a "
      "mapping of field names to them (e.g. {'mu': '8bit', 'nu': '4bit'}), got "
      f"{_described(moments)}."
    )
  compresses = any(c != "full" for c in codes)
  if compresses and jnp.dtype(dtype) != jnp.float32:
    raise ValueError(
      f"mixed_precision: moments={moments!r} compresses a float32 inner state; dtype is "
      f"{jnp.dtype(dtype)}. Use float32 masters, or moments='full'."
    )
  if per_field:
    named = dict(_field_signs(fields)) if isinstance(fields, Mapping) else {}
    rule = dict(_field_signs(tuple(n for n in moments if isinstance(n, str))))
    per_field_signs = tuple(
      (name, code, named.get(name, rule[name])) for name, code in moments.items()
    )
  else:
    per_field_signs = tuple((name, moments, sign) for name, sign in _field_signs(fields))
  block_scaled = any(c in ("8bit", "4bit") for c in codes)
  return MomentsFormat(
    repr(moments), per_field_signs, seed, isinstance(fields, Mapping), compresses, block_scaled
  )


def as_dict(setting: Any) -> Any:
  """Returns ``setting`` as a dict if it is a mapping (a ``Mapping``, or an
  object with ``keys()`` and item access, as ``dict()`` reads it), else as it is."""
  if isinstance(setting, Mapping) or (
    not isinstance(setting, str | bytes) and callable(getattr(setting, "keys", None))
  ):
    return dict(setting)
  return setting


def _described(value: Any) -> str:
  """Returns ``repr(value)``, with its type named where that is not a builtin."""
  module = type(value).__module__
  if module == "builtins":
    return repr(value)
  return f"{value!r} (a {module}.{type(value).__qualname__})"


def _field_signs(fields: Any) -> tuple[tuple[str, Sign], ...]:
  """Returns ``moment_fields`` as ``(name, sign)`` pairs: a mapping names each
  sign; in a sequence, :data:`NONNEGATIVE_FIELDS` are second moments."""
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
      f"{_described(fields)}."
    )
  return tuple((f, "nonnegative" if f in NONNEGATIVE_FIELDS else "signed") for f in fields)


def is_compressed(x: Any) -> bool:
  """Tells whether ``x`` is a stored compressed moment (one node for one leaf)."""
  return isinstance(x, COMPRESSED_MOMENTS)


# The kind that decompresses each stored type (a key matters only to compress).
KIND_OF_STORED: dict[type, MomentKind] = {
  Bfloat16Moment: Bfloat16Compressed(0),
  Signed8bitMoment: EightBitCompressed(0, "signed"),
  Nonnegative8bitMoment: EightBitCompressed(0, "nonnegative"),
  Signed4bitMoment: FourBitCompressed(0, "signed"),
  Nonnegative4bitMoment: FourBitCompressed(0, "nonnegative"),
}


# The stored types of block-scaled moments (8 and 4 bits).
BLOCK_SCALED_TYPES = (
  Signed8bitMoment,
  Nonnegative8bitMoment,
  Signed4bitMoment,
  Nonnegative4bitMoment,
)


def param_shape_of(stored: Any) -> tuple[int, ...]:
  """Returns the shape of the param a compressed moment stands for, as its
  parts tell it: its codes' or values' shape; a 4-bit moment's last axis
  doubled (two codes a byte; an odd length's last element is in its scales)."""
  shape = tuple(np.shape(stored[0]))
  if isinstance(stored, Signed4bitMoment | Nonnegative4bitMoment) and shape:
    shape = (*shape[:-1], 2 * shape[-1])
  return shape


def decompressed(stored_inner: Any, by_table: bool = False) -> Any:
  """Returns ``stored_inner`` with every compressed moment decompressed to
  float32; ``by_table``: 8- and 4-bit codes by a table lookup, bitwise the
  same values, for the accelerator's first pass, which writes no codes
  (``two_pass.first_pass``; docs/design.md, "Compiler workarounds")."""
  flat, treedef = jax.tree.flatten(stored_inner, is_leaf=is_compressed)
  values = []
  for x in flat:
    kind = KIND_OF_STORED.get(type(x))
    if kind is None:
      values.append(x)
    elif hasattr(x[0], "replace_boxed"):  # parts in flax linen boxes: the value boxed like them
      values.append(x[0].replace_boxed(kind.decompress(type(x)(*(tree_lib.unboxed(p) for p in x)))))
    elif by_table and isinstance(kind, BlockScaledKind):
      values.append(kind.decompress(x, by_table=True))
    else:
      values.append(kind.decompress(x))
  return jax.tree.unflatten(treedef, values)


def compressed(
  moments_format: MomentsFormat,
  new_inner: Any,
  applied_steps: jax.Array | rounding.StackedCount,
  others: list[Any] | None = None,
  scales: list[jax.Array | None] | None = None,
  previous: Any = None,
) -> Any:
  """Returns the stored form of the inner rule's new state: a leaf with an
  entry in ``scales`` (the accelerator's second pass, against the block
  maxima ``two_pass.first_pass`` returns) coded against it, every other leaf
  in one pass. ``others`` are the step's other outputs, which every in-place
  write of a moment follows on XLA:CPU (:func:`_written_after`; None: at
  init, nothing to follow). Eagerly (an init outside ``jit``) each leaf is
  coded in one jitted call (``tree.jitted_when_eager``), the leaf's key an
  argument rather than a constant, so that one compile serves every leaf of
  a shape. ``previous``: the stored inner state the new one replaces (None:
  none), which 4-bit codes read (:meth:`FourBitCompressed.compress`)."""
  flat, treedef = jax.tree.flatten(new_inner)
  kinds: list[Any] = moments_format.kinds(new_inner)
  against = [None] * len(flat) if scales is None else scales
  uncompressed = [v for v, kind in zip(flat, kinds, strict=True) if not kind.compressed]
  step = applied_steps
  if others is not None and len(uncompressed) < len(flat):
    step = tree_lib.by_platform(
      cpu=functools.partial(_written_after, applied_steps, others + uncompressed),
      accelerator=functools.partial(jax.tree.map, jnp.asarray, applied_steps),
      # An element of a sharded output would be all-gathered.
      cpu_needs_one_device=True,
    )
  olds = [None] * len(flat)
  if previous is not None:
    olds = jax.tree.leaves(previous, is_leaf=is_compressed)
  stored = []
  for kind, value, scale, old in zip(kinds, flat, against, olds, strict=True):
    if not kind.compressed:  # stored as the inner rule made it
      stored.append(value)
      continue
    if old is not None and isinstance(kind, FourBitCompressed):
      stored.append(kind.compress(value, step, scales=scale, previous=old))
      continue
    if scale is not None:
      stored.append(kind.compress(value, step, scales=scale))
      continue
    keyless, key = dataclasses.replace(kind, key=0), jnp.uint32(kind.key)
    stored.append(tree_lib.jitted_when_eager(type(kind).compress, keyless, value, step, key))
  return jax.tree.unflatten(treedef, stored)


def _written_after(
  applied_steps: jax.Array | rounding.StackedCount, others: list[Any]
) -> jax.Array | rounding.StackedCount:
  """Returns ``applied_steps`` plus zero, read from one element of each of the
  step's other outputs.

  The moments' step, it orders each compressed moment's in-place write after
  the kernels that read the old moment, which XLA:CPU would otherwise meet
  with a copy (docs/design.md, "Compiler workarounds").
  """
  firsts = [jnp.ravel(x)[:1].astype(jnp.float32) for x in others if np.size(x) >= MIN_SIZE]
  if not firsts:
    zero = jnp.zeros((), jnp.int32)
  else:
    # A reduction, computed once: a scalar made of elementwise ops alone XLA
    # would fuse into every element of every compressed moment.
    zero = jnp.sum(jnp.isnan(jnp.concatenate(firsts)).astype(jnp.int32))
  if isinstance(applied_steps, rounding.StackedCount):
    return applied_steps._replace(steps=applied_steps.steps + zero)
  return applied_steps + zero
