"""The test harness on every supported jax: newer APIs spelled for the floor.

CI runs the quick tests at the floors (.ci/floors.txt) and at the newest
releases; a test that needs a newer jax or flax is skipped with
``requires_jax``/``requires_flax``, whose reason names the version.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest

from mpx._src import compat


def requires_jax(version: str, why: str) -> pytest.MarkDecorator:
  return pytest.mark.skipif(
    not compat.jax_at_least(version), reason=f"needs jax >= {version}: {why}"
  )


def below_jax(version: str, why: str) -> pytest.MarkDecorator:
  """For the tests of what mpx says on a jax older than ``version``."""
  return pytest.mark.skipif(compat.jax_at_least(version), reason=f"jax < {version} only: {why}")


def flax_version() -> tuple[int, ...]:
  import flax

  return compat._version(flax.__version__)


def requires_flax(version: str, why: str) -> pytest.MarkDecorator:
  try:
    ok = flax_version() >= compat._version(version)
  except ImportError:
    ok = False
  return pytest.mark.skipif(not ok, reason=f"needs flax >= {version}: {why}")


def shard_map(
  f: Callable[..., Any] | None = None, *, mesh: Any, in_specs: Any, out_specs: Any, **kw: Any
) -> Any:
  """``jax.shard_map`` (jax 0.6.1); before, ``jax.experimental.shard_map``
  with ``check_rep`` for ``check_vma``."""
  if f is None:
    return functools.partial(shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)
  from jax.experimental.shard_map import shard_map as old

  if "check_vma" in kw:
    kw["check_rep"] = kw.pop("check_vma")
  return old(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def varying(x: Any, axis: str) -> Any:
  """``x`` typed as varying over ``axis`` inside ``shard_map``: ``jax.lax.pcast``
  (jax 0.8.2), ``jax.lax.pvary`` before."""
  pcast = getattr(jax.lax, "pcast", None)
  return pcast(x, axis, to="varying") if pcast else jax.lax.pvary(x, axis)


@contextlib.contextmanager
def enable_x64() -> Iterator[None]:
  """``jax.enable_x64(True)`` (jax 0.8.0); ``jax.experimental.enable_x64`` before."""
  if hasattr(jax, "enable_x64"):
    with jax.enable_x64(True):
      yield
  else:
    from jax.experimental import enable_x64 as old

    with old():
      yield


def set_mesh(mesh: Any) -> Any:
  """``jax.set_mesh`` (jax 0.7.1); ``jax.sharding.use_mesh`` before."""
  return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)


def unregister_event_duration_listener(listener: Callable[..., Any]) -> None:
  """``jax.monitoring.unregister_event_duration_listener`` (jax 0.8.1)."""
  public = getattr(jax.monitoring, "unregister_event_duration_listener", None)
  if public is not None:
    public(listener)
  else:
    from jax._src import monitoring

    monitoring._unregister_event_duration_listener_by_callback(listener)


def type_promotion_error() -> type[Exception]:
  """``jax.dtypes.TypePromotionError`` (public from jax 0.10.1)."""
  public = getattr(jax.dtypes, "TypePromotionError", None)
  if public is not None:
    return public
  from jax._src import dtypes

  return dtypes.TypePromotionError


def distributed_initialize(**kwargs: Any) -> None:
  """``jax.distributed.initialize`` with the keywords this jax knows
  (``heartbeat_timeout_seconds``: 0.7.0; ``shutdown_timeout_seconds``: 0.8.1)."""
  known = inspect.signature(jax.distributed.initialize).parameters
  jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in known})
