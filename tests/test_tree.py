"""Tree helpers: finite checks, selection, casting of floating leaves only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpx


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_all_finite_detects_any_nonfinite_element(bad, dtype, jit):
  check = jax.jit(mpx.all_finite) if jit else mpx.all_finite
  big = jnp.finfo(dtype).max  # finite extremes must not read as overflow
  tree = {"a": jnp.full((3, 4), big, dtype), "b": [jnp.zeros(5, dtype)]}
  assert bool(check(tree))
  tree["b"][0] = tree["b"][0].at[3].set(bad)
  assert not bool(check(tree))


def test_all_finite_ignores_integers_and_handles_empty_trees():
  assert bool(mpx.all_finite({"step": jnp.int32(2**31 - 1), "flag": jnp.bool_(False)}))
  assert bool(mpx.all_finite({}))
  assert bool(mpx.all_finite(None))


def test_all_finite_is_jittable_and_stays_on_device():
  tree = {"w": jnp.ones(4)}
  with jax.transfer_guard("disallow"):
    result = jax.jit(mpx.all_finite)(tree)
  assert result.dtype == jnp.bool_ and result.shape == ()


def test_select_tree_returns_chosen_leaves_bitwise():
  a = {"w": jnp.array([1.0, jnp.nan]), "n": jnp.int32(1)}
  b = {"w": jnp.array([3.0, 4.0]), "n": jnp.int32(2)}
  chosen = jax.jit(mpx.select_tree)(jnp.array(False), a, b)
  np.testing.assert_array_equal(chosen["w"], b["w"])
  assert int(chosen["n"]) == 2
  chosen = mpx.select_tree(True, a, b)
  assert np.isnan(chosen["w"][1]) and int(chosen["n"]) == 1


def test_select_tree_rejects_mismatched_trees():
  with pytest.raises(ValueError, match="structure"):
    mpx.select_tree(True, {"a": jnp.ones(2)}, {"b": jnp.ones(2)})
  with pytest.raises(ValueError, match="'a'.*float32\\[2\\] vs bfloat16\\[2\\]"):
    mpx.select_tree(True, {"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)})
  with pytest.raises(ValueError, match="scalar"):
    mpx.select_tree(jnp.array([True, False]), jnp.ones(2), jnp.ones(2))


def test_cast_tree_casts_only_floating_leaves():
  key = jax.random.key(0)
  tree = {
    "w": jnp.ones(3),
    "h": np.ones(2, np.float64),
    "count": jnp.int32(7),
    "mask": jnp.array([True]),
    "key": key,
  }
  cast = mpx.cast_tree(tree, jnp.bfloat16)
  assert cast["w"].dtype == jnp.bfloat16 and cast["h"].dtype == jnp.bfloat16
  assert cast["count"].dtype == jnp.int32 and int(cast["count"]) == 7
  assert cast["mask"].dtype == jnp.bool_
  assert cast["key"] is key


def test_cast_tree_where_predicate_keeps_chosen_leaves():
  params = {"dense": {"kernel": jnp.ones(2)}, "layer_norm": {"scale": jnp.ones(2)}}
  cast = mpx.cast_tree(params, jnp.float16, where=lambda path, x: "norm" not in path)
  assert cast["dense"]["kernel"].dtype == jnp.float16
  assert cast["layer_norm"]["scale"].dtype == jnp.float32
  seen = []
  mpx.cast_tree(params, jnp.float16, where=lambda path, x: seen.append(path) or True)
  assert sorted(seen) == ["dense/kernel", "layer_norm/scale"]


def test_cast_tree_where_mask_tree_like_optax_masked():
  params = {"a": jnp.ones(2), "b": {"c": jnp.ones(2), "d": jnp.ones(2)}}
  cast = mpx.cast_tree(params, jnp.bfloat16, where={"a": False, "b": True})
  assert cast["a"].dtype == jnp.float32
  assert cast["b"]["c"].dtype == cast["b"]["d"].dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", [jnp.int32, "int8", bool, "not-a-dtype"])
def test_cast_tree_rejects_non_floating_dtype(bad):
  with pytest.raises(ValueError, match="dtype must be a floating dtype"):
    mpx.cast_tree({"w": jnp.ones(2)}, bad)


def test_all_finite_checks_host_values_without_narrowing_them():
  # Made a jax array without x64, 1e300 would become inf.
  assert bool(mpx.all_finite({"a": np.array([1e300]), "b": 1e300, "c": np.float64(-1e300)}))
  assert not bool(mpx.all_finite({"a": np.array([1.0, np.nan]), "b": jnp.ones(2)}))
  assert not bool(mpx.all_finite({"a": np.inf, "b": jnp.ones(2)}))
