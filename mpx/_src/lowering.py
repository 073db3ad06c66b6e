"""Temporary: by_platform lives in tree.py."""

from mpx._src.tree import by_platform  # noqa: F401
