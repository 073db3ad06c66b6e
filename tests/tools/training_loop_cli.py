"""Runs the resume test's fresh process on ``tests/training_loop.py``'s scenario.

``python tests/tools/training_loop_cli.py resume MODE CKPT_ROOT OUT_FILE K...``
(``tests/test_resume.py``): for the resume mode ``MODE`` (a key of
``training_loop.RESUME_MODES``) restore each checkpoint ``CKPT_ROOT/step_K``
(the state before step K), train from step K to the end and pickle the restored
states and the trajectories to ``OUT_FILE``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
  sys.path.insert(0, str(TESTS))

import jax  # noqa: E402
import training_loop as tl  # noqa: E402
from lowering_forms import apply_environment  # noqa: E402


def resume(mode: str, ckpt_root: str, out_file: str, steps: list[int]) -> None:
  """Restores each checkpoint of ``steps``, trains on to the end and pickles both."""
  import orbax.checkpoint as ocp

  checkpointer = ocp.StandardCheckpointer()
  template = tl.resume_template(mode)
  results = {}
  for k in steps:
    restored = checkpointer.restore(os.path.join(ckpt_root, f"step_{k}"), template)
    params, state = restored["params"], restored["opt_state"]
    trajectory = tl.resume_train(params, state, k, tl.RESUME_STEPS, mode)
    results[k] = jax.device_get({"restored": restored, "trajectory": trajectory})
  with open(out_file, "wb") as f:
    pickle.dump(results, f)


def main(argv: list[str] | None = None) -> int:
  """Parses the command line and runs the command."""
  apply_environment()  # the form the test asked for, MPX_TEST_FORM
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  resume_parser = commands.add_parser("resume", help="restore checkpoints and train to the end")
  resume_parser.add_argument("mode", choices=sorted(tl.RESUME_MODES))
  resume_parser.add_argument("ckpt_root")
  resume_parser.add_argument("out_file")
  resume_parser.add_argument("steps", nargs="*", type=int)
  args = parser.parse_args(argv)
  resume(args.mode, args.ckpt_root, args.out_file, args.steps)
  return 0


if __name__ == "__main__":
  sys.exit(main())
