"""The accelerator's two-pass coder of 8- and 4-bit moments: the step run once
for the new moments' block maxima, then coded against them (docs/design.md,
"Compressed moments at the byte floor")."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import storage, verdict
from mpx._src import tree as tree_lib
from mpx._src.moment_codes import BlockScaledKind
from mpx._src.moments import BLOCK_SCALED_TYPES, MomentsFormat, is_compressed
from mpx._src.states import Nonnegative4bitMoment, Signed4bitMoment


def first_pass(
  moments_format: MomentsFormat,
  inner_step: Callable[..., tuple[Any, list[Any]]],
  stored: Any,
  leaves: Any,
  unscaling: verdict.Unscaling | None,
) -> tuple[jax.Array, list[jax.Array | None], jax.Array]:
  """Returns the step's verdict, the new 8- and 4-bit moments' block maxima and
  whether a leaf's update stalled (``storage.any_stalled``): the accelerator's
  first pass, whose maxima the step codes the moments it computes again
  against (:func:`compressed`).

  ``inner_step(stored, leaves)`` runs the inner rule on the masters and
  commits each leaf (``mixed_precision._Step._step_on_masters``, its old
  moments read by ``moments.decompressed(..., by_table=True)``), returning ``(stored,
  handoffs)``, the inner rule's new state as it made it. It runs here on its
  inputs behind ``lax.optimization_barrier`` (the gradients excepted:
  :func:`maxima_by_leaf` says why), which XLA does not look through, so
  that it cannot merge this computation of the new moments with the step's
  (CSE would: one new moment read by the maxima, the update and the coder
  is what XLA:GPU writes out in float32); only the maxima are kept, the rest
  is dead code. Each gradient read with
  moments (:func:`block_maxima`) is checked in their reduction, as the inner
  rule receives it (the verdict's rule, ``verdict.gradients_finite``); the
  others by ``gradients_finite``; the two agreed across the axis at once.
  """
  stored_once, params, kept = jax.lax.optimization_barrier((stored, leaves.params, leaves.stored))
  leaves_once = dataclasses.replace(leaves, params=params, stored=kept)
  new, handoffs = inner_step(stored_once, leaves_once)
  received = [
    verdict.received(g, d, unscaling)
    for g, d in zip(leaves_once.grads, leaves.received_dtypes, strict=True)
  ]
  paths = jax.tree_util.tree_flatten_with_path(
    leaves.grad_treedef.unflatten(list(range(len(received))))
  )[0]
  by_path = {
    jax.tree_util.keystr(path): received[index]
    for path, index in paths
    if tree_lib.is_floating(received[index])
  }
  scales, read_finite, read = block_maxima(moments_format, new.inner, by_path)
  others = [jax.tree_util.keystr(path) not in read for path, _ in paths]
  axis_name = None if unscaling is None else unscaling.axis_name
  alone = None if unscaling is None else dataclasses.replace(unscaling, axis_name=None)
  rest_finite = verdict.gradients_finite(
    [g for g, other in zip(leaves.grads, others, strict=True) if other],
    [d for d, other in zip(leaves.received_dtypes, others, strict=True) if other],
    alone,
  )
  # The 24-bit masters' stall check (a sample of each leaf's update) is read
  # here too, and tied to the maxima and the verdict that the step waits for:
  # read after the step, it would read params the step overwrites in place
  # (XLA copies them; the verdict orders the leaves that have no maxima).
  finite = verdict.agreed(jnp.logical_and(rest_finite, read_finite), axis_name)
  stalled = storage.any_stalled(handoffs)
  if stalled is None:
    return finite, scales, jnp.zeros((), bool)
  return jax.lax.optimization_barrier((finite, scales, stalled))


def maxima_by_leaf(
  moments_format: MomentsFormat,
  inner_step: Callable[..., tuple[Any, list[Any]]],
  stored: Any,
  leaves: Any,
) -> list[jax.Array | None]:
  """Returns the new 8- and 4-bit moments' block maxima (None for the other
  leaves of the inner state): :func:`first_pass` for ``skip="leaf"``, with no
  verdict and no stall check, and each array behind a barrier of its own, so
  that a leaf's maxima wait for its own gradient alone, not for every
  gradient (one barrier over all of them would hold the whole gradient)."""
  # Not the gradients: behind a barrier, a gradient the step computes
  # (mpx.clipped_grad's, clipped in float32) is written out whole, and XLA:GPU
  # computed every one before any leaf's update (2.25 B/param of transient
  # with 24-bit masters, 0.28 now). The other arrays' barriers keep this
  # computation of the new moments apart from the step's.
  barred = jax.tree.map(jax.lax.optimization_barrier, (stored, leaves.params, leaves.stored))
  stored, params, kept = barred
  new, _ = inner_step(stored, dataclasses.replace(leaves, params=params, stored=kept))
  # Each param's moments reduced together, as without skip="leaf" but with
  # no gradient: apart, XLA:GPU reads the old codes and the gradient once
  # for each moment whose blocks differ in size (per field: 8-bit blocks of
  # 256 beside 4-bit ones of 128).
  return block_maxima(moments_format, new.inner, {})[0]


def block_maxima(
  moments_format: MomentsFormat, new_inner: Any, grads: Mapping[str, jax.Array]
) -> tuple[list[jax.Array | None], jax.Array, set[str]]:
  """Returns the block maxima of each block-scaled leaf of ``new_inner`` (None
  for the others), whether the gradients read with them are finite, and
  which of ``grads`` were read.

  ``grads`` are the gradients as the inner rule received them, by the path
  of their leaf (``jax.tree_util.keystr``). The moments of one shape whose
  path below their field is one param's (and, where given, a gradient's of
  that shape) are reduced together, with that gradient's finiteness, in one
  variadic reduction at the smallest block size among them (a larger block's maxima
  are those of its smaller blocks): one kernel reads the old codes and the
  gradient once, where a reduction per moment would read the gradient once
  more each and leave XLA:GPU's cost model to decide whether to write the
  new moment out (docs/design.md). A moment whose blocks do not tile its
  last axis is reduced alone (:meth:`BlockScaledKind.maxima`).
  """
  flat = jax.tree_util.tree_flatten_with_path(new_inner)[0]
  values = [value for _, value in flat]
  fields = {name for name, _, _ in moments_format.fields}
  scales: list[jax.Array | None] = [None] * len(flat)
  # By the path below the field and the shape: without a gradient to check
  # against, moments of one path may still differ in shape.
  groups: dict[tuple[str, tuple[int, ...]], list[tuple[int, BlockScaledKind, int]]] = {}
  kinds = moments_format.kinds(new_inner)
  for index, (kind, (keys, value)) in enumerate(zip(kinds, flat, strict=True)):
    if not isinstance(kind, BlockScaledKind):
      continue
    # The path below the innermost of the fields on it: a moment's path below
    # ``mu`` is its param's.
    at = [i for i, key in enumerate(keys) if getattr(key, "name", None) in fields]
    below = jax.tree_util.keystr(tuple(keys[at[-1] + 1 :])) if at else None
    size = kind.block_size(value.shape)
    grad = None if below is None else grads.get(below)
    if below is None or size is None or (grad is not None and np.shape(grad) != value.shape):
      scales[index] = kind.maxima(value)
    else:
      groups.setdefault((below, np.shape(value)), []).append((index, kind, size))
  finite = []
  for (path, _), members in groups.items():
    small = min(size for _, _, size in members)
    joint = [(i, kind, size) for i, kind, size in members if size % small == 0]
    for i, kind, size in members:
      if size % small:
        scales[i] = kind.maxima(values[i])
    # One variadic reduction over the blocks of ``small`` (each operand's
    # largest element per block, at least 0), so that XLA emits one kernel
    # reading each operand's producers (a moment's old codes, its gradient) once.
    reduced = [kind.reduced(values[i]) for i, kind, _ in joint]
    operands = [x for parts in reduced for x in parts]
    if path in grads:
      grad = jnp.asarray(grads[path], jnp.float32)
      # 1 where the gradient is not finite: a max of these is 0 exactly when
      # every element is finite, whatever the max does with a NaN. A byte, not
      # a float32: the reduction writes one a block, scratch until the verdict.
      operands.append(jnp.logical_not(jnp.isfinite(grad)).astype(jnp.uint8))
    *lead, width = operands[0].shape
    blocked = tuple(x.reshape((*lead, width // small, small)) for x in operands)
    zeros = tuple(np.zeros((), x.dtype) for x in blocked)
    maxima = list(jax.lax.reduce(blocked, zeros, tree_lib.elementwise_max, (len(lead) + 1,)))
    if path in grads:
      finite.append(jax.lax.eq(jnp.max(maxima.pop()), np.uint8(0)))
    for (i, kind, size), parts in zip(joint, reduced, strict=True):
      own = [maxima.pop(0) for _ in parts]
      # A block ``size // small`` times as long: the largest of its small blocks' maxima.
      factor = size // small
      if factor > 1:
        grouped = [m.reshape((*lead, width // size, factor)) for m in own]
        own = [
          jax.lax.reduce(g, np.zeros((), g.dtype), jax.lax.max, (len(lead) + 1,)) for g in grouped
        ]
      scales[i] = kind.scales_of(tuple(own))
  all_finite = jnp.asarray(True)
  if finite:
    # Behind a barrier, as verdict._all stacks per-leaf flags: one kernel tests them.
    all_finite = jax.lax.optimization_barrier(jnp.stack(finite)).all()
  return scales, all_finite, {path for path, _ in groups if path in grads}


def kept(applied: jax.Array, new: Any, old: Any) -> Any:
  """Returns the tree ``new`` where ``applied``, else ``old``, leaf by leaf (a
  skipped step in the accelerator's program, ``verdict.run_if_finite``).

  An 8- or 4-bit moment's codes first, 4-bit ones selected as uint4 pairs:
  XLA:GPU then fuses the select into the kernel that codes the new ones
  (packed by ``moment_codes._pack_by_bitcast``) and writes them in place,
  where a select of the packed bytes is a kernel of its own that reads the
  new codes back from scratch. Then its scales, read after the codes are
  written: the scales' select writes over the donated old scales, which the
  coding kernel reads to decode the old moment, and without the order
  XLA:GPU copies the old scales first (docs/design.md, "Compressed moments at
  the byte floor")."""
  flat_new: list[Any]
  treedef: Any
  flat_new, treedef = jax.tree.flatten(new, is_leaf=is_compressed)
  flat_old = treedef.flatten_up_to(old)
  selected = []
  for n, o in zip(flat_new, flat_old, strict=True):
    if not isinstance(n, BLOCK_SCALED_TYPES):  # an array, or a bfloat16 moment's
      selected.append(jax.tree.map(functools.partial(jnp.where, applied), n, o))
      continue
    # (codes, scales): the 4-bit nonnegative code's scales are its ranges.
    (new_codes, new_scales), (old_codes, old_scales) = n, o
    if isinstance(n, Signed4bitMoment | Nonnegative4bitMoment):
      pairs = [jax.lax.bitcast_convert_type(c, jnp.uint4) for c in (new_codes, old_codes)]
      codes = jax.lax.bitcast_convert_type(jnp.where(applied, pairs[0], pairs[1]), jnp.uint8)
    else:
      codes = jnp.where(applied, new_codes, old_codes)
    # Behind a barrier, so that XLA cannot compute the codes again for the
    # zero (fused into the scales' select) instead of reading the coder's.
    codes = jax.lax.optimization_barrier(codes)
    scales = jnp.where(applied, new_scales, old_scales)
    # Zeros shaped like the scales, each read from its block's first code
    # byte: elementwise, so that it stays on the device that holds the block
    # wherever a mesh splits the moment (a scalar read from one element would
    # be reduced across devices). Zero itself (no order) for a layout whose
    # blocks do not tile the codes' last axis, or whose blocks an explicit
    # mesh splits (jax refuses to slice a sharded axis there).
    zero = jnp.zeros((), scales.dtype)
    *lead, width = codes.shape
    blocks = scales.shape[-1] if scales.ndim else 0
    if tuple(lead) == scales.shape[:-1] and blocks and not width % blocks:
      blocked = codes.reshape((*lead, blocks, width // blocks))
      sharding = getattr(jax.typeof(blocked), "sharding", None)
      spec: tuple[Any, ...] = tuple(getattr(sharding, "spec", None) or ())
      if len(spec) != blocked.ndim or spec[-1] is None:
        zero = jnp.isnan(blocked[..., 0].astype(scales.dtype)).astype(scales.dtype)
    selected.append(type(n)(codes, jax.lax.add(scales, zero)))
  return jax.tree.unflatten(treedef, selected)
