"""Bandwidth probes and the finite checks alone, timed beside the optimizer steps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import mpx
from benchmarks.common import Case
from benchmarks.hand_written import leafwise_all_isfinite, leafwise_sum_times_zero
from benchmarks.trees import F32, Grads, copy_tree


@dataclasses.dataclass(frozen=True)
class Probe:
  """A timed case that is not an optimizer: a bandwidth reference or a check.

  Attributes:
    case: the case (its state is donated like the variants').
    group: "roofline" or "check".
    bytes_per_param: bytes it must move per element or parameter.
  """

  case: Case
  group: str
  bytes_per_param: int


ROOF_ELEMENTS = 2**25
ROOF_COPY = "copy x+1 (f32)"
ROOF_AXPY = "axpy y+a*x (f32)"
CHECK_COPY = "fp16 grads x+1 (reference)"
MPX_CHECK = "mpx.all_finite (this checkout)"
CHECKS = {
  MPX_CHECK: mpx.all_finite,
  "isfinite(sum(x*0)) per leaf": leafwise_sum_times_zero,
  "all(isfinite(x)) per leaf (jmp, optax)": leafwise_all_isfinite,
}


def probes(n: int, grads: Grads, checks: bool = True) -> list[Probe]:
  """Builds the bandwidth probes and, with ``checks``, the finite checks alone.

  Bandwidth: ``x + 1`` (8 bytes an element) and ``y + a * x`` (12) in place on
  ``min(n, 2**25)`` float32 elements; checks: each of :data:`CHECKS` on the fp16
  gradients, and ``x + 1`` in place on a copy of them (4 bytes a parameter).
  """
  n = min(n, ROOF_ELEMENTS)
  x = jnp.full((n,), 1.0, F32)
  out = [
    Probe(Case(ROOF_COPY, lambda s: s + 1.0, jnp.zeros((n,), F32), ()), "roofline", 8),
    Probe(Case(ROOF_AXPY, lambda s, x: s + 1e-3 * x, jnp.zeros((n,), F32), (x,)), "roofline", 12),
  ]
  if not checks:
    return out
  out.append(
    Probe(
      Case(CHECK_COPY, lambda s: jax.tree.map(lambda v: v + 1, s), copy_tree(grads.f16), ()),
      "check",
      4,
    )
  )
  for name, check in CHECKS.items():
    fn = lambda s, g, check=check: s & check(g)  # noqa: E731
    out.append(Probe(Case(name, fn, jnp.asarray(True), (grads.f16,)), "check", 2))
  return out
