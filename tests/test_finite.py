"""all_finite: every inf and NaN found, wherever it sits, in every form the
check takes; finite values never refused, even where their sum overflows."""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax_versions
import numpy as np
import pytest
from hypothesis import given, settings
from lowering_forms import forced

import mpx
from mpx._src import verdict as finite_lib

SHAPES = [(7,), (16 * 1024,), (16 * 1024 + 5,), (3, 16 * 1024 + 1), (1 << 19,), ((1 << 19) + 17,)]
DTYPES = [jnp.float16, jnp.float32, jnp.bfloat16]


def form(single_cpu=True):
  """Sets the tests' switch to the one-CPU or the several-device form."""
  return forced("one-cpu" if single_cpu else "several-devices")


def traced(tree, single_cpu=True):
  # A fresh function: jax caches a trace by the function traced, so a jit of
  # mpx.all_finite itself would keep the form of its first trace.
  with form(single_cpu):
    return jax.jit(lambda tree: mpx.all_finite(tree)).lower(tree).compile()


def positions(size):
  width = finite_lib._FOLD_WIDTH
  block = size // width
  inner = block // width
  found = {0, 1, size - 1, size - 2, width * block, width * block - 1}
  found |= {i * block for i in range(width)} | {i * block - 1 for i in range(1, width)}
  found |= {i * inner for i in range(0, width * width, 37)}
  found |= {width * inner - 1, width * inner, width * inner + 3}
  return sorted(p for p in found if 0 <= p < size)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_position_is_found_in_the_single_cpu_forms(shape, dtype):
  # float16 leaves are folded in blocks (tails apart); bfloat16 and float32
  # are summed. An inf or NaN at any block boundary must be found.
  clean = jnp.ones(shape, dtype)
  check = traced({"x": clean, "y": jnp.ones(3)})
  assert bool(check({"x": clean, "y": jnp.ones(3)}))
  size = math.prod(shape)
  y = jnp.ones(3)
  for position in positions(size):
    for bad in (np.inf, -np.inf, np.nan):
      # Built on the host: an eager scatter a case would cost more than the check.
      x = np.ones(size, dtype)
      x[position] = bad
      assert not bool(check({"x": x.reshape(shape), "y": y})), (position, bad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_finite_values_whose_sum_overflows_are_finite(dtype):
  # The fast form is a sum, which overflows here; the exact fallback (taken
  # only then) must still say finite, and still find a real inf or NaN.
  big = jnp.full((4096,), jnp.finfo(dtype).max, dtype)
  mixed = big.at[::2].set(-jnp.finfo(dtype).max)  # +max -max ...: partial sums overflow both ways
  check = traced({"a": big, "b": jnp.ones(3, dtype)})
  assert bool(check({"a": big, "b": jnp.ones(3, dtype)}))
  assert bool(check({"a": mixed, "b": jnp.ones(3, dtype)}))
  for bad in (np.inf, -np.inf, np.nan):
    assert not bool(check({"a": big.at[17].set(bad), "b": jnp.ones(3, dtype)}))
    assert not bool(check({"a": big, "b": jnp.ones(3, dtype).at[1].set(bad)}))


def test_each_dtype_takes_its_form_on_a_single_cpu_device():
  # Structure, not speed: bfloat16/float32 leaves are summed (read once by a
  # library kernel, no scratch) and float16 leaves folded in blocks.
  def jaxpr(x):
    with form():
      return str(jax.make_jaxpr(lambda x: mpx.all_finite(x))(x))

  big = 1 << 16
  assert "reduce_sum" in jaxpr(jnp.ones(big, jnp.bfloat16))
  assert "reduce_sum" in jaxpr(jnp.ones(big, jnp.float32))
  assert "slice" in jaxpr(jnp.ones(big, jnp.float16))
  assert "reduce_sum" not in jaxpr(jnp.ones(big, jnp.float16))


# A figure of XLA's cost model as the newest jax compiles it: a release's
# check, for -m slow.
@jax_versions.requires_jax("0.10.2", "older XLA:CPU's figure: docs/design.md")
@pytest.mark.slow
@pytest.mark.xla_cost
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_single_cpu_check_needs_almost_no_scratch(dtype):
  n = 1 << 20
  compiled = traced({"w": jnp.ones((n // 1024, 1024), dtype), "b": jnp.ones(1024, dtype)})
  assert compiled.memory_analysis().temp_size_in_bytes <= 0.1 * n


# 15 examples: each compiles the check for its leaf's size in both forms.
@settings(max_examples=15, deadline=None)
@given(
  dtype=st.sampled_from(DTYPES),
  size=st.integers(1, 3000),
  magnitude=st.sampled_from([1e-3, 1.0, 1e4, 1e30, float("inf")]),
  bad=st.one_of(st.none(), st.sampled_from([np.inf, -np.inf, np.nan])),
  data=st.data(),
)
@pytest.mark.slow
def test_agrees_with_numpy_in_both_forms(dtype, size, magnitude, bad, data):
  # numpy's isfinite is the independent reference; magnitude inf means the
  # largest finite value of the dtype, so sums overflow.
  top = float(jnp.finfo(dtype).max) if magnitude == float("inf") else magnitude
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  values = np.clip(rng.standard_normal(size) * top, -top, top).astype(np.float32)
  if bad is not None:
    values[data.draw(st.integers(0, size - 1))] = bad
  leaf = jnp.asarray(values).astype(dtype)
  want = bool(np.isfinite(np.asarray(leaf, np.float32)).all())
  for single_cpu in (True, False):
    assert bool(traced({"w": leaf}, single_cpu)({"w": leaf})) == want
