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
