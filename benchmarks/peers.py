"""Loading the peer libraries the benchmarks compare against.

jmp and flax are ordinary imports (the ``bench`` extra). mixed-precision-for-JAX
(PyPI ``mixed-precision-for-jax``) is not: it also imports as ``mpx`` and its
modules import each other absolutely (``import mpx._cast``), so it cannot be
installed beside this project's ``mpx``. :func:`load_mixed_precision_for_jax`
installs it (without dependencies: they are in the ``bench`` extra) into
``benchmarks/.vendor/`` and imports it in-process by swapping the ``mpx``
entries of ``sys.modules`` and ``sys.path`` for the duration of the import,
then restores ours. Its functions keep working afterwards: they reach their
siblings through module objects bound at import time.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import types

MPFJ_DIST = "mixed-precision-for-jax"
MPFJ_VERSION = "0.1.8"
VENDOR = pathlib.Path(__file__).resolve().parent / ".vendor"


def optional_import(name: str) -> tuple[types.ModuleType | None, str]:
  """``(module, "")``, or ``(None, why)`` when it is not installed."""
  try:
    return importlib.import_module(name), ""
  except ImportError as error:
    return None, f"{name} not installed ({error.name}); pip install -e '.[bench]'"


def _vendor_dir(version: str) -> pathlib.Path:
  return VENDOR / f"{MPFJ_DIST}-{version}"


def install_mixed_precision_for_jax(version: str = MPFJ_VERSION) -> pathlib.Path:
  """pip-installs the package, without dependencies, into a private folder."""
  target = _vendor_dir(version)
  if (target / "mpx" / "__init__.py").exists():
    return target
  target.mkdir(parents=True, exist_ok=True)
  subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "--quiet",
      "--disable-pip-version-check",
      "--no-deps",
      "--target",
      str(target),
      f"{MPFJ_DIST}=={version}",
    ],
    check=True,
  )
  return target


def _is_mpx_module(name: str) -> bool:
  return name == "mpx" or name.startswith("mpx.")


def load_mixed_precision_for_jax(
  install: bool, version: str = MPFJ_VERSION
) -> tuple[types.ModuleType | None, str]:
  """Imports mixed-precision-for-JAX under another name, leaving ours as ``mpx``.

  Args:
    install: pip-install it into ``benchmarks/.vendor`` if it is not there yet.
    version: the release to use.

  Returns:
    ``(module, "")``, or ``(None, why)`` if it is not available.
  """
  target = _vendor_dir(version)
  if not (target / "mpx" / "__init__.py").exists():
    if not install:
      return None, f"{MPFJ_DIST} not vendored (run without --smoke, or --install-peers)"
    try:
      install_mixed_precision_for_jax(version)
    except (subprocess.CalledProcessError, OSError) as error:
      return None, f"pip could not install {MPFJ_DIST}=={version}: {error}"
  for dependency in ("equinox", "jaxtyping"):
    module, why = optional_import(dependency)
    if module is None:
      return None, why
  import mpx as ours  # noqa: F401 - imported first, so it is the one restored

  saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_mpx_module(name)}
  sys.path.insert(0, str(target))
  try:
    theirs = importlib.import_module("mpx")
  except ImportError as error:
    return None, f"{MPFJ_DIST} failed to import: {error}"
  finally:
    for name in [n for n in sys.modules if _is_mpx_module(n)]:
      del sys.modules[name]
    sys.path.remove(str(target))
    sys.modules.update(saved)
  origin = pathlib.Path(theirs.__file__).resolve()
  if target.resolve() not in origin.parents:
    return None, f"imported the wrong mpx from {origin}"
  assert sys.modules["mpx"] is saved["mpx"]
  return theirs, ""
