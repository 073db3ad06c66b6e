"""Holds one measured row of a benchmark table as a frozen dataclass.

Every ratio a table shows is derived from the medians a row stores (``ratios``,
``paired_rounds``), so a row never carries the same figure twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepRow:
  """Stores what one optimizer-step variant measured on one tree.

  ``ratios`` maps each variant this one is compared with (the baseline, its
  hand step, its check-then-apply step, the full-master step, the roofline
  probe) to the median over rounds of this variant's time over that one's.
  ``paired_rounds`` are the per-round ratios to ``paired_with``, the variant
  timed just before and after it in every round.
  """

  kind: str
  n: int
  ms: float
  min_bytes: int
  baseline: str
  ratios: dict[str, float]
  reference: str | None = None
  check_then_apply: str | None = None
  full: str | None = None
  paired_with: str | None = None
  paired_rounds: tuple[float, ...] = ()
  roof: str | None = None
  roof_bytes: float = 0.0
  state_bpp: float | None = None
  temp_bpp: float | None = None
  accessed_bpp: float | None = None
  fresh_bpp: float | None = None
  host_syncs: int | str | None = None  # a count, or why it was not checked
  compiles: int | None = None
  traces: int | None = None
  first_call_s: float | None = None
  times_ms: tuple[float, ...] = ()
  skipped_steps: int | None = None

  def ratio_to(self, name: str | None) -> float | None:
    """Returns the median ratio of this variant's time to ``name``'s, if timed."""
    return None if name is None else self.ratios.get(name)

  def paired_to(self, name: str | None) -> float | None:
    """Returns the paired ratio to ``name`` if it is what this variant was timed next to."""
    if name is None or name != self.paired_with or not self.paired_rounds:
      return None
    return statistics.median(self.paired_rounds)

  @property
  def x_base(self) -> float:
    return self.ratios[self.baseline]

  @property
  def x_hand(self) -> float | None:
    return self.ratio_to(self.reference)

  @property
  def x_cond(self) -> float | None:
    return self.ratio_to(self.check_then_apply)

  @property
  def x_full(self) -> float | None:
    return self.ratio_to(self.full)

  @property
  def x_hand_paired(self) -> float | None:
    return self.paired_to(self.reference)

  @property
  def x_cond_paired(self) -> float | None:
    return self.paired_to(self.check_then_apply)

  @property
  def x_full_paired(self) -> float | None:
    return self.paired_to(self.full)

  @property
  def gbps(self) -> float:
    """Returns the least bytes the variant must move over its median step time, in GB/s."""
    return self.min_bytes * self.n / (self.ms / 1e3) / 1e9

  @property
  def floor_x(self) -> float:
    """Returns the step time over the roofline probe's time for ``min_bytes`` per param."""
    if self.roof is None:
      return math.nan
    return self.ratios[self.roof] * self.roof_bytes / (self.min_bytes * self.n)

  @property
  def roof_pct(self) -> float:
    return 100 / self.floor_x

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> StepRow:
    data = dict(data)
    for key in ("paired_rounds", "times_ms"):
      data[key] = tuple(data.get(key, ()))
    return cls(**data)


@dataclasses.dataclass(frozen=True)
class TrainRow:
  """Stores what one mode of the whole training step measured."""

  param_dtype: str
  ms: float
  x_base: float
  state_bpp: float
  peak_bytes: int
  compile_s: float
  baseline_compile_s: float
  host_syncs: int | str | None = None
  compiles: int | None = None
  traces: int | None = None
  skipped: int | None = None
  skipped_total: int | None = None

  @property
  def compile_x(self) -> float:
    return self.compile_s / self.baseline_compile_s


def _encode(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return dataclasses.asdict(value)
  return str(value)


def dump(results: dict[str, Any], path: str | pathlib.Path) -> None:
  """Writes ``results`` (rows as plain dicts) to a JSON file."""
  pathlib.Path(path).write_text(json.dumps(results, indent=1, default=_encode))


def load(path: str | pathlib.Path) -> dict[str, Any]:
  """Reads results :func:`dump` wrote, the rows as :class:`StepRow` and :class:`TrainRow`."""
  results = json.loads(pathlib.Path(path).read_text())
  sizes = list(results.get("optimizer", {}).get("sizes", []))
  for allocator in results.get("allocators", []):
    sizes += allocator.get("sizes", [])
  for size in sizes:
    size["rows"] = {name: StepRow.from_json(row) for name, row in size["rows"].items()}
  if "train" in results:
    train = results["train"]["rows"]
    results["train"]["rows"] = {mode: TrainRow(**row) for mode, row in train.items()}
  return results
