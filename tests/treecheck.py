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
