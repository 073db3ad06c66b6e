"""Validation shared by the transformations."""

from __future__ import annotations

from typing import Any


def check_transformation(inner: Any, name: str = "inner") -> None:
  """Raises a TypeError unless ``inner`` looks like an optax transformation."""
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
      f"{name} must be an optax GradientTransformation (with init and update), "
      f"got {type(inner).__name__}. Did you pass the factory instead of calling "
      "it, e.g. optax.adam instead of optax.adam(1e-3)?"
    )
