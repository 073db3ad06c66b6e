"""Every optimizer of the optax zoo with 8-bit moments: which of its state's
leaves are compressed, in which code, and that each stays near the moment
plain float32 optax keeps, fed the same gradients.

A moment coded with the wrong sign's code is caught here: the non-negative
code stores a negative value as zero (SM3 keeps its momentum in ``nu``; its
error would be about 1, not a few per cent). The cases are
``tests/optax_zoo.py``'s, on one (64, 128) bf16 leaf (8192 elements: large
enough to compress); those that need extra arguments, per-example gradients
or lookahead params are covered by the bitwise zoo with full moments.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax_zoo as zoo
import pytest

import mpx
from mpx._src.states import COMPRESSED_MOMENTS

SHAPE = (64, 128)
STEPS = 30
# Which leaves each rule's state compresses by default, and in which code.
S, N = "Signed8bitMoment", "Nonnegative8bitMoment"
ADAM = {"[0].mu['w']": S, "[0].nu['w']": N}
EXPECTED = {
  "optax.adabelief": ADAM,
  "optax.adam": ADAM,
  "optax.adamax": ADAM,
  "optax.adamaxw": ADAM,
  "optax.adamw": ADAM,
  "optax.amsgrad": ADAM,
  "optax.contrib.acprop": ADAM,
  "optax.contrib.ademamix": {"[0].nu['w']": N},
  "optax.contrib.adopt": ADAM,
  "optax.contrib.mechanize": {
    ".base_optimizer_state[0].mu['w']": S,
    ".base_optimizer_state[0].nu['w']": N,
  },
  "optax.contrib.muon": {".inner_states['muon'].inner_state[0].mu['w']": S},
  "optax.contrib.schedule_free_adamw": {".base_optimizer_state[0].nu['w']": N},
  "optax.lamb": ADAM,
  "optax.lars": {"[3].trace['w']": S},
  "optax.lion": {"[0].mu['w']": S},
  "optax.nadam": ADAM,
  "optax.nadamw": ADAM,
  "optax.novograd": {"[0].mu['w']": S},  # its nu is one norm per leaf
  "optax.optimistic_adam": ADAM,
  "optax.optimistic_adam_v2": ADAM,
  "optax.radam": ADAM,
  "optax.rmsprop": {"[2].trace['w']": S},  # centered: only its momentum, when asked
  "optax.sgd": {"[0].trace['w']": S},
  "optax.sm3": {"[0].nu['w']": S},  # momentum, named nu; its mu is per axis
  "optax.yogi": ADAM,
}
CASES = sorted(
  name
  for name, case in zoo.CASES.items()
  if not (case.lookahead or case.per_example or case.extra_args)
  and name != "optax.selective_transform"  # its mask names the zoo's own leaves
)
# The cosine of a 4-bit moment with the full run's after 30 steps, at least.
MIN_COSINE_4BIT = 0.6
# Centered RMSprop (optax.scale_by_stddev) needs nu - mu**2 >= 0, which no code's
# rounding keeps: its mu and nu are refused in every compressed format.
REFUSED = {"optax.rmsprop"}
# The quick tier's 8-bit rules: rmsprop (the refusal;
# test_centered_rmsprop_compresses_only_its_momentum_when_asked runs its trace
# beside the moments) and sm3 (a momentum named nu: the signed code where the
# name suggests the other); its 4-bit rule is adamw. -m slow runs every rule
# in both codes, muon's moments nested in another rule's state among them.
QUICK = {"optax.rmsprop", "optax.sm3"}
REFUSAL = r"ScaleByRStdDevState\.\w+ \(optax.rmsprop\(centered=True\)\) cannot be stored in "


def run(name, moments):
  tx = mpx.mixed_precision(zoo.CASES[name].build(zoo._plain), moments=moments)
  params = {"w": jax.random.normal(jax.random.key(0), SHAPE).astype(jnp.bfloat16)}
  row_scales = jnp.logspace(-2, 0, SHAPE[0])[:, None]

  @jax.jit
  def train(params):
    def body(carry, key):
      params, state = carry
      grads = {"w": (row_scales * jax.random.normal(key, SHAPE)).astype(jnp.bfloat16)}
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    carry = (params, tx.init(params))
    return jax.lax.scan(body, carry, jax.random.split(jax.random.key(1), STEPS))[0][1]

  return train(params)


def compressed_kinds(state):
  """Returns ``{path: stored type name}`` of every compressed moment in ``state``."""
  stored = jax.tree_util.tree_flatten_with_path(
    state.inner_state, is_leaf=lambda x: isinstance(x, COMPRESSED_MOMENTS)
  )[0]
  return {
    jax.tree_util.keystr(path): type(node).__name__
    for path, node in stored
    if isinstance(node, COMPRESSED_MOMENTS)
  }


@pytest.mark.parametrize("name", sorted(QUICK))
def test_8bit_moments_of_a_zoo_rule(name):
  if name in REFUSED:
    with pytest.raises(ValueError, match=REFUSAL + "8bit"):
      run(name, "8bit")
    return
  check_8bit_moments(name, run(name, "full"), run(name, "8bit"))


def test_4bit_moments_of_adamw():
  check_4bit_moments("optax.adamw", run("optax.adamw", "full"), run("optax.adamw", "4bit"))


# One full run a rule for both codes (three compilations, not four).
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", CASES)
def test_8bit_and_4bit_moments_of_every_zoo_rule(name):
  if name in REFUSED:
    for moments in ("8bit", "4bit"):
      with pytest.raises(ValueError, match=REFUSAL + moments):
        run(name, moments)
    return
  full = run(name, "full")
  check_8bit_moments(name, full, run(name, "8bit"))
  check_4bit_moments(name, full, run(name, "4bit"))


def check_8bit_moments(name, full, compressed):
  """The moments a compressed run keeps are the full run's, give or take the
  codes' error (both runs' gradients ignore the params, so they see the same
  stream): at most 15% relative per block (row of 128) after 30 steps."""
  kinds = compressed_kinds(compressed)
  assert kinds == EXPECTED.get(name, {})
  want = dict(jax.tree_util.tree_leaves_with_path(mpx.inner_state(full)))
  got = dict(jax.tree_util.tree_leaves_with_path(mpx.inner_state(compressed)))
  for path in kinds:
    (key,) = [k for k in want if jax.tree_util.keystr(k) == path]
    w, g = np.asarray(want[key]), np.asarray(got[key])
    error = np.linalg.norm(g - w, axis=-1) / np.linalg.norm(w, axis=-1)
    assert error.max() < 0.15, (path, error.max())


def check_4bit_moments(name, full, compressed):
  """The 8-bit contract at 4 bits: the same leaves compressed, each by its
  sign, and each moment pointing where the full run's does (a cosine of at
  least MIN_COSINE_4BIT), with no positive second moment at 0."""
  kinds = compressed_kinds(compressed)
  expected = {p: k.replace("8bit", "4bit") for p, k in EXPECTED.get(name, {}).items()}
  assert kinds == expected
  want = dict(jax.tree_util.tree_leaves_with_path(mpx.inner_state(full)))
  got = dict(jax.tree_util.tree_leaves_with_path(mpx.inner_state(compressed)))
  for path, kind in kinds.items():
    (key,) = [k for k in want if jax.tree_util.keystr(k) == path]
    w, g = np.asarray(want[key]).ravel(), np.asarray(got[key]).ravel()
    # Stochastic rounding to 8 levels is noisy element by element (a row's
    # relative error up to 1.3 after 30 steps), but the moment points where
    # the full run's does: a zeroed, flipped or misplaced moment would not.
    cosine = float(w @ g / (np.linalg.norm(w) * np.linalg.norm(g)))
    assert cosine > MIN_COSINE_4BIT, (path, cosine)
    if kind.startswith("Nonnegative"):
      assert np.all(g[w > 0] > 0), path


@pytest.mark.parametrize("moments", [pytest.param("bfloat16", marks=pytest.mark.slow), "4bit"])
def test_centered_rmsprop_refuses_every_code_for_its_moments(moments):
  with pytest.raises(ValueError, match=REFUSAL + moments + r".*moments=\{'trace': '8bit'\}"):
    run("optax.rmsprop", moments)


def test_centered_rmsprop_compresses_only_its_momentum_when_asked():
  # The refusal's fix: its trace (beside the moments, after them in the
  # chain) in 8 bits, near the full run's; mu and nu stay float32.
  check_8bit_moments(
    "optax.rmsprop", run("optax.rmsprop", "full"), run("optax.rmsprop", {"trace": "8bit"})
  )


@pytest.mark.slow
def test_centered_rmsprop_turns_nan_once_its_moments_are_rounded():
  # Why the refusal: fed a steady gradient (1 plus 1% noise), optax's own
  # centered RMSprop stays finite in float32, and turns its params NaN once
  # its mu and nu are rounded to bfloat16 after every step (nu - mu**2 < 0).
  tx = optax.rmsprop(1e-3, centered=True)
  grads = 1 + 0.01 * jax.random.normal(jax.random.key(0), (60, 64, 256))

  def rounded(state):
    (stddev, *rest) = state
    to_bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    return (stddev._replace(mu=to_bf16(stddev.mu), nu=to_bf16(stddev.nu)), *rest)

  @jax.jit
  def final_params(round_moments):
    def body(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      state = jax.lax.cond(round_moments, rounded, lambda s: s, state)
      return (optax.apply_updates(params, updates), state), None

    params = jnp.zeros((64, 256))
    return jax.lax.scan(body, (params, tx.init(params)), grads)[0][0]

  assert np.all(np.isfinite(final_params(False)))
  assert not np.all(np.isfinite(final_params(True)))
