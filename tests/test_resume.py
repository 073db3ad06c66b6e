"""Bitwise resume: an orbax checkpoint restored in a fresh process continues
exactly as the uninterrupted run.

The run (``training_loop.resume_*``) trains the fp16 MLP under
``loss_scale(mixed_precision(chain(clip, inject_hyperparams(adamw), schedule)))``
with every loss-scale setting away from its default (initial scale, both
factors, interval, floor, cap, hysteresis), poisons chosen steps so that the
run skips single steps, sits inside an overflow streak, backs off to the floor
and overflows there, and grows to the cap and tries to grow past it, and sets
the learning rate with ``mpx.adjust`` at step 20.

The test saves ``{"params", "opt_state"}`` with orbax's ``StandardCheckpointer``
before a step from each of those situations (and every tenth step with
``MPX_LONG=1``).
A fresh Python process (``python tests/tools/training_loop_cli.py resume ...``) rebuilds
the transformation from its constructor arguments, restores each checkpoint
into the abstract tree of ``tx.init`` (``jax.eval_shape``), and trains to the
end. Every restored value must equal the saved one (dtype included), and every
step after it must be bitwise the uninterrupted run's.

The same runs in every storage mode of ``tl.RESUME_MODES``: full masters
(fp16), remainder and stochastic masters (bf16), and, on the MLP widened so
that a kernel's moments are compressed, remainder masters with 8-bit moments
and stochastic masters with bfloat16 moments. There the restored state must
hold the moments as saved: ``Signed8bitMoment`` and ``Nonnegative8bitMoment``
(uint8 codes, float32 block scales) or ``Bfloat16Moment``, bitwise; and the
compression's random bits, keyed on the restored count of applied steps,
continue the uninterrupted run's.

jmp's floor is lost by a ``jit`` or a ``tree_map`` because it is neither a leaf
nor metadata. In mpx every setting lives in the transformation and every
counter in the state, so nothing is lost: the uninterrupted run follows an
independent model of the rule with these settings, and the resumed runs match
it bit for bit, floor, cap, hysteresis and adjusted learning rate included.
"""

import os
import pathlib
import pickle
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
import training_loop as tl
from treecheck import tree_equal

import mpx

# Minutes in all: behind the marker; CI runs them with `pytest -m slow`.
pytestmark = pytest.mark.slow

ocp = pytest.importorskip("orbax.checkpoint")
HERE = pathlib.Path(__file__).resolve().parent


def checkpoint_steps(states, injected):
  """A state before step k for each situation worth resuming from."""
  config, n = tl.RESUME_CONFIG, len(injected)

  def first(name, pred):
    found = [k for k in range(n) if pred(k, states[k])]
    assert found, name  # the plan must produce the situation
    return found[0]

  situations = {
    "before the first step": 0,
    "right after a skipped step": first("skip", lambda k, s: not s.last_step_finite),
    "in an overflow streak, before the overflow that backs off": first(
      "streak", lambda k, s: s.overflow_streak == config.hysteresis - 1 > 0 and injected[k]
    ),
    "one step before growth": first(
      "growth", lambda k, s: s.growth_tracker == config.growth_interval - 1 and not injected[k]
    ),
    "at the cap, before trying to grow past it": first(
      "cap",
      lambda k, s: (
        s.loss_scale == config.max_scale
        and s.growth_tracker == config.growth_interval - 1
        and not injected[k]
      ),
    ),
    "at the floor, before another overflow": first(
      "floor", lambda k, s: s.loss_scale == config.min_scale and injected[k]
    ),
    "before the step that adjusts the learning rate": tl.ADJUST_STEP,
    "after it": tl.ADJUST_STEP + 1,
    "before the last step": n - 1,
  }
  every_tenth = set(range(0, n, 10)) if tl.LONG else set()
  return sorted(set(situations.values()) | every_tenth)


@pytest.mark.parametrize("mode", list(tl.RESUME_MODES))
def test_restored_in_a_fresh_process_the_run_continues_bitwise(tmp_path, mode):
  params = tl.resume_params(mode)
  state = tl.resume_tx(mode).init(params)
  trajectory = [(params, state), *tl.resume_train(params, state, 0, tl.RESUME_STEPS, mode)]
  injected = tl.resume_plan()["kind"] != tl.NONE
  states = [s for _, s in trajectory]

  # The uninterrupted run obeys every non-default setting.
  config = tl.RESUME_CONFIG
  expected = [config.init_scale, *tl.reference_scales(~injected, config)]
  assert [float(s.loss_scale) for s in states] == expected
  assert int(states[-1].skipped_steps) == injected.sum()
  assert all(tl.all_finite_np(p) for p, _ in trajectory)
  lr = [float(optax.tree.get(s, "learning_rate")) for s in states]
  assert lr[tl.ADJUST_STEP] == np.float32(3e-2) and lr[-1] == np.float32(tl.ADJUSTED_LR)
  # The moments are stored compressed (in the modes that say so), not full.
  moments = tl.RESUME_MODES[mode].moments
  assert tl.compressed_nodes(state.inner_state.inner_state) == tl.COMPRESSED[moments]

  steps = checkpoint_steps(states, injected)
  checkpointer = ocp.StandardCheckpointer()
  for k in steps:
    params, state = trajectory[k]
    checkpointer.save(tmp_path / f"step_{k}", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()

  out = tmp_path / "resumed.pkl"
  command = [sys.executable, str(HERE / "tools" / "training_loop_cli.py"), "resume", mode]
  command += [str(tmp_path), str(out)]
  result = subprocess.run(
    [*command, *map(str, steps)],
    env=dict(os.environ),
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  with open(out, "rb") as f:
    resumed = pickle.load(f)

  assert sorted(resumed) == steps
  for k in steps:
    params, state = trajectory[k]
    restored = resumed[k]["restored"]
    # Every value, its dtype and the state's NamedTuple types survive.
    assert tree_equal(restored, {"params": params, "opt_state": state}), k
    assert isinstance(restored["opt_state"], mpx.LossScaleState)
    assert type(restored["opt_state"].inner_state) is type(state.inner_state)  # the mode's state
    # Compressed moments come back as their NamedTuples, codes and scales
    # (uint8 and float32) or bfloat16 values, bitwise (tree_equal above).
    stored = restored["opt_state"].inner_state.inner_state
    assert tl.compressed_nodes(stored) == tl.COMPRESSED[moments], k
    assert restored["opt_state"].last_step_finite.dtype == np.bool_
    # And the fresh process continues exactly as the uninterrupted run.
    assert len(resumed[k]["trajectory"]) == tl.RESUME_STEPS - k
    assert tree_equal(resumed[k]["trajectory"], jax.device_get(trajectory[k + 1 :])), k
