"""Checks optimizers of ``tests/optax_zoo.py``'s table, printing one line each.

``XLA_FLAGS=--xla_cpu_max_isa=AVX python tests/tools/optax_zoo_cli.py NAME ...``
(every optimizer without a NAME), as ``tests/test_optax_zoo.py`` runs it: the
flag keeps fused multiply-adds out (see ``optax_zoo``'s docstring). It prints
``CONTRACTION_OFF {json}``, then one ``RESULT {json}`` line per optimizer with
the failures found (none when it conforms) and the seconds taken.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

TESTS = pathlib.Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
  sys.path.insert(0, str(TESTS))

import optax_zoo  # noqa: E402
from lowering_forms import apply_environment  # noqa: E402


def main(names: list[str]) -> None:
  """Checks each optimizer of ``names`` and prints its result line."""
  apply_environment()  # the form the test asked for, MPX_TEST_FORM
  print("CONTRACTION_OFF", json.dumps(optax_zoo.contraction_off()), flush=True)
  for name in names:
    start = time.perf_counter()
    case = optax_zoo.CASES[name]
    failures = []
    for check in (optax_zoo.check_mixed_precision, optax_zoo.check_loss_scale):
      try:
        failures += check(case)
      except Exception as error:  # reported per optimizer, not fatal to the run
        failures.append(f"{check.__name__} raised {type(error).__name__}: {error}")
    seconds = round(time.perf_counter() - start, 2)
    result = {"name": name, "failures": failures, "seconds": seconds}
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:] or sorted(optax_zoo.CASES))
