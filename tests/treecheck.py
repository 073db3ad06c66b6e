"""Assertion helpers shared by the tests."""

import jax
import numpy as np


def tree_equal(a, b) -> bool:
  """Bitwise equality of two trees (NaN == NaN), structure and dtypes included."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(
    np.asarray(x).dtype == np.asarray(y).dtype
    and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def round_to_bfloat16(x):
  """The bfloat16 nearest each float32 value, ties away from zero: mpx's rule
  for bf16 params under float32 masters, computed independently on the bits
  with numpy (for finite values within the bfloat16 range)."""
  import ml_dtypes

  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  return ((bits + 0x8000) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)


def round_like_params(x, param_dtype):
  """``x`` (float32) rounded as mpx rounds a master to a param of ``param_dtype``."""
  if np.dtype(param_dtype) == np.dtype(jax.numpy.bfloat16):
    return round_to_bfloat16(x)
  return np.asarray(x, np.float32).astype(param_dtype)


def _is_mp_state(x) -> bool:
  import mpx

  return isinstance(
    x,
    (mpx.MixedPrecisionState, mpx.MixedPrecisionRemainderState, mpx.MixedPrecisionStochasticState),
  )


def mp_states(tree) -> list:
  """The ``mixed_precision`` states in ``tree``, in tree order."""
  return [x for x in jax.tree.leaves(tree, is_leaf=_is_mp_state) if _is_mp_state(x)]


def without_skip_counts(tree):
  """``tree`` with the ``nonfinite_steps`` of every ``mixed_precision`` state
  zeroed: what a run that never met the skipped steps would hold."""

  def uncount(x):
    return x._replace(nonfinite_steps=np.zeros((), np.int32)) if _is_mp_state(x) else x

  return jax.tree.map(uncount, tree, is_leaf=_is_mp_state)


def skip_recorded(after, before) -> bool:
  """Whether ``after`` is ``before`` with one skipped step recorded: every
  ``mixed_precision`` state in it counted one more non-finite step, and
  every other leaf (masters, inner states, random-bit counters) is bitwise
  unchanged. A LossScaleState's own counters are checked by the caller."""
  counted = mp_states(after), mp_states(before)
  if len(counted[0]) != len(counted[1]) or not all(
    int(a.nonfinite_steps) == int(b.nonfinite_steps) + 1 for a, b in zip(*counted, strict=True)
  ):
    return False
  return tree_equal(without_skip_counts(after), without_skip_counts(before))
