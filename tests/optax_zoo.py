"""Every optimizer in ``optax`` and ``optax.contrib`` under mpx, checked bitwise.

Run by ``tests/test_optax_zoo.py`` as ``XLA_FLAGS=--xla_cpu_max_isa=AVX
python tests/tools/optax_zoo_cli.py NAME ...``: XLA:CPU otherwise contracts
``a * b + c`` into a fused multiply-add where it sees fit, differently in the
mpx step and the plain optax step, and the same optimizer then differs in its
last bit. The flag keeps FMA instructions out; the worker checks that it took
(``contraction_off``) before it checks anything else.

For each optimizer it prints one ``RESULT {json}`` line with the failures it
found (none when the optimizer conforms):

* ``mpx.mixed_precision(rule)``, three jitted steps on bfloat16 params (and a
  float32 leaf, which has no master): the masters are bitwise the params of
  ``rule`` run in float32 on the master view and fed the same gradients (and
  extra arguments); each bfloat16 param is its master rounded to nearest,
  ties away from zero (computed here in numpy, on the bits); the float32 leaf
  is bitwise the reference's.
* ``mpx.loss_scale(mpx.mixed_precision(injected rule))``: scaled gradients
  give the same masters; a step with an inf gradient changes no param and no
  bit of the state below the scale, and backs the scale off; ``mpx.adjust``
  then halves the learning rate, the next step matches the reference with the
  halved rate, and the jitted step compiled once.

Importing this module builds the case table and does nothing else; the
completeness test (``discover``) compares it with what optax exports.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import optax.contrib

import mpx

LEARNING_RATE = 1e-2
LOSS_SCALE = 2.0**10
MODULES = {"optax": optax, "optax.contrib": optax.contrib}


def discover() -> set[str]:
  """Names of every public function of ``optax`` and ``optax.contrib`` that
  takes a learning rate or an optimizer: the optimizers, the line searches and
  rate scalings, and the optimizer wrappers (lookahead, SAM, mechanize...)."""
  found = set()
  for module_name, module in MODULES.items():
    for name in dir(module):
      obj = getattr(module, name)
      if name.startswith("_") or inspect.isclass(obj) or not callable(obj):
        continue
      try:
        parameters = inspect.signature(obj).parameters
      except (TypeError, ValueError):
        continue
      if any("learning_rate" in p or "optimizer" in p for p in parameters):
        found.add(f"{module_name}.{name}")
  return found


Injector = Callable[..., optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Case:
  """How to build one optimizer, and what its ``update`` needs.

  Attributes:
    build: ``build(make)`` returns the rule, calling ``make(factory,
      **kwargs)`` for the part with the learning rate: ``make`` either calls
      ``factory`` or injects its learning rate with ``optax.inject_hyperparams``.
    extra_args: extra keyword arguments of ``update``: ``"value"`` (the loss),
      ``"grad"`` (the gradients again), ``"value_fn"`` (the loss function),
      ``"obj_fn"`` (Sophia's loss function).
    per_example: whether the gradients carry a leading batch axis (DP-SGD).
    rate_name: the injected hyperparameter ``mpx.adjust`` changes.
    lookahead: whether the params are ``optax.LookaheadParams`` (fast and
      slow weights), whose gradients are the fast weights' alone.
  """

  build: Callable[[Injector], optax.GradientTransformation]
  extra_args: tuple[str, ...] = ()
  per_example: bool = False
  rate_name: str = "learning_rate"
  lookahead: bool = False


def _rule(factory: Callable[..., Any], **kwargs: Any) -> Callable[[Injector], Any]:
  return lambda make: make(factory, learning_rate=LEARNING_RATE, **kwargs)


_LINE_SEARCH = ("value", "grad", "value_fn")
_C = optax.contrib

# Optimizers that need nothing but a learning rate.
_PLAIN = {
  optax: (
    "adabelief",
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "adamaxw",
    "adamw",
    "adan",
    "amsgrad",
    "fromage",
    "lamb",
    "lars",
    "lion",
    "nadam",
    "nadamw",
    "novograd",
    "optimistic_adam",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "radam",
    "rprop",
    "scale_by_learning_rate",
    "scale_by_rprop",
    "sign_sgd",
    "signum",
    "yogi",
  ),
  optax.contrib: (
    "acprop",
    "ademamix",
    "adopt",
    "cocob",
    "dadapt_adamw",
    "dog",
    "dowg",
    "madgrad",
    "muon",
    "prodigy",
    "scale_by_madgrad",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "simplified_ademamix",
  ),
}

CASES: dict[str, Case] = {
  **{
    f"{module.__name__}.{name}": Case(_rule(getattr(module, name)))
    for module, names in _PLAIN.items()
    for name in names
  },
  # Factored second moments on the (4, 3) matrix.
  "optax.adafactor": Case(_rule(optax.adafactor, min_dim_size_to_factor=2)),
  "optax.lbfgs": Case(_rule(optax.lbfgs), extra_args=_LINE_SEARCH),
  "optax.noisy_sgd": Case(_rule(optax.noisy_sgd, key=jax.random.key(0))),
  "optax.polyak_sgd": Case(
    lambda make: make(optax.polyak_sgd, max_learning_rate=LEARNING_RATE),
    extra_args=("value",),
    rate_name="max_learning_rate",
  ),
  "optax.rmsprop": Case(_rule(optax.rmsprop, centered=True, momentum=0.9)),
  "optax.scale_by_backtracking_linesearch": Case(
    lambda make: optax.chain(
      optax.sgd(1.0),
      make(
        optax.scale_by_backtracking_linesearch,
        max_backtracking_steps=5,
        max_learning_rate=LEARNING_RATE,
      ),
    ),
    extra_args=_LINE_SEARCH,
    rate_name="max_learning_rate",
  ),
  "optax.scale_by_polyak": Case(
    lambda make: make(optax.scale_by_polyak, max_learning_rate=LEARNING_RATE),
    extra_args=("value",),
    rate_name="max_learning_rate",
  ),
  "optax.scale_by_zoom_linesearch": Case(
    lambda make: optax.chain(
      optax.sgd(1.0),
      make(optax.scale_by_zoom_linesearch, max_linesearch_steps=5, max_learning_rate=LEARNING_RATE),
    ),
    extra_args=_LINE_SEARCH,
    rate_name="max_learning_rate",
  ),
  "optax.sgd": Case(_rule(optax.sgd, momentum=0.9, nesterov=True)),
  "optax.sm3": Case(_rule(optax.sm3, momentum=0.9)),
  # Optimizer wrappers: the learning rate injected is the wrapped rule's.
  "optax.lookahead": Case(
    lambda make: optax.lookahead(
      make(optax.sgd, learning_rate=LEARNING_RATE), sync_period=2, slow_step_size=0.5
    ),
    lookahead=True,
  ),
  "optax.selective_transform": Case(
    lambda make: optax.selective_transform(
      make(optax.adam, learning_rate=LEARNING_RATE), freeze_mask={"w": False, "b": True, "s": False}
    )
  ),
  "optax.contrib.dpsgd": Case(
    _rule(_C.dpsgd, l2_norm_clip=1.0, noise_multiplier=0.1, seed=0), per_example=True
  ),
  "optax.contrib.galore": Case(_rule(_C.galore, rank=2, update_proj_gap=2)),
  "optax.contrib.mechanize": Case(
    lambda make: _C.mechanize(make(optax.adam, learning_rate=LEARNING_RATE))
  ),
  "optax.contrib.momo": Case(_rule(_C.momo), extra_args=("value",)),
  "optax.contrib.momo_adam": Case(_rule(_C.momo_adam), extra_args=("value",)),
  "optax.contrib.sam": Case(
    lambda make: _C.sam(make(optax.sgd, learning_rate=LEARNING_RATE), optax.sgd(0.05))
  ),
  "optax.contrib.scale_by_galore": Case(
    lambda make: _C.scale_by_galore(
      rank=2, update_proj_gap=2, base_optimizer=make(optax.adam, learning_rate=LEARNING_RATE)
    )
  ),
  "optax.contrib.schedule_free": Case(
    lambda make: make(_C.schedule_free, base_optimizer=optax.sgd(1.0), learning_rate=LEARNING_RATE)
  ),
  "optax.contrib.sophia": Case(_rule(_C.sophia, update_interval=2), extra_args=("obj_fn",)),
}

# Discovered names that are not optimizers mpx can run, with the reason.
EXCLUDED: dict[str, str] = {}


def _plain(factory: Callable[..., Any], **kwargs: Any) -> optax.GradientTransformation:
  return factory(**kwargs)


def _injected(factory: Callable[..., Any], **kwargs: Any) -> optax.GradientTransformation:
  # Only the learning rate is injected: every other argument (callables
  # included, which inject_hyperparams would take for schedules) stays static.
  names = inspect.signature(factory).parameters
  static = tuple(name for name in names if "learning_rate" not in name)
  return optax.inject_hyperparams(factory, static_args=static)(**kwargs)


# --- the problem: a quadratic bowl, bfloat16 params and one float32 leaf ----


def _initial_params(case: Case | None = None) -> Any:
  params = _initial_dict()
  return optax.LookaheadParams.init_synced(params) if case and case.lookahead else params


def _differentiated(params: Any) -> Any:
  """The part of ``params`` the gradients are taken of."""
  return params.fast if isinstance(params, optax.LookaheadParams) else params


def _initial_dict() -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(1), 3)
  return {
    "w": jax.random.normal(keys[0], (4, 3)).astype(jnp.bfloat16),
    "b": jax.random.normal(keys[1], (3,)).astype(jnp.bfloat16),
    "s": jax.random.normal(keys[2], (2,), jnp.float32),  # no master: already float32
  }


_TARGET = jax.tree.map(
  lambda p: jnp.linspace(-1.0, 1.0, p.size, dtype=jnp.float32).reshape(p.shape),
  _initial_dict(),
)


def loss(params: Any) -> jax.Array:
  """A float32 quadratic bowl, whatever the params' dtype."""
  terms = jax.tree.map(lambda p, t: jnp.sum((p.astype(jnp.float32) - t) ** 2), params, _TARGET)
  return 0.5 * sum(jax.tree.leaves(terms))


def _gradients(reference_params: Any, params: Any, step: int, case: Case) -> Any:
  """Float32 gradients at the reference's params plus a step-dependent ripple
  (so that successive steps differ in direction), rounded to the dtype of each
  of ``params`` (the low-precision run's): both runs are fed these."""
  grads = jax.grad(loss)(_differentiated(reference_params))
  key = jax.random.fold_in(jax.random.key(2), step)
  grads = jax.tree.map(lambda g: g + 0.1 * jax.random.normal(key, g.shape), grads)
  if case.per_example:
    grads = jax.tree.map(lambda g: g * jnp.arange(1.0, 4.0).reshape((3,) + (1,) * g.ndim), grads)
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, _differentiated(params))


def _to_f32(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _extra(case: Case, master_view: Any, grads: Any, scale: float = 1.0) -> dict[str, Any]:
  """The extra arguments ``case`` needs; ``value`` and ``grad`` multiplied by
  ``scale`` as a scaled loss would give them (exact: a power of two)."""
  extra: dict[str, Any] = {}
  if "value" in case.extra_args:
    extra["value"] = loss(_differentiated(master_view)) * scale
  if "grad" in case.extra_args:
    extra["grad"] = _scaled(grads, scale)
  return extra


def _scaled(grads: Any, scale: float) -> Any:
  """``grads`` times a power of two, in their dtype: exact."""
  return jax.tree.map(lambda g: (g.astype(jnp.float32) * scale).astype(g.dtype), grads)


def _static_extra(case: Case) -> dict[str, Any]:
  extra: dict[str, Any] = {}
  if "value_fn" in case.extra_args:
    extra["value_fn"] = loss
  if "obj_fn" in case.extra_args:
    extra["obj_fn"] = loss
  return extra


def _step_fn(tx: optax.GradientTransformation, case: Case) -> Any:
  static = _static_extra(case)

  @jax.jit
  def step(grads, state, params, extra):
    updates, state = tx.update(grads, state, params, **extra, **static)
    return optax.apply_updates(params, updates), state, updates

  return step


# --- the checks ---------------------------------------------------------------


def _bits(x: Any) -> np.ndarray:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.asarray(x)
  return x.view(f"uint{8 * x.dtype.itemsize}")


def _round_bf16_ties_away(master: np.ndarray) -> np.ndarray:
  """float32 -> bfloat16 to nearest, ties away from zero, on the bits: adding
  half of the dropped 16 bits carries into the kept half exactly when the
  dropped part is at least half an ulp of the magnitude."""
  bits = np.asarray(master, np.float32).view(np.uint32).astype(np.uint64)
  top = ((bits + 0x8000) >> 16).astype(np.uint16)
  return top.view(ml_dtypes.bfloat16)


def _differences(what: str, got: Any, want: Any) -> list[str]:
  """One message per leaf whose bits differ."""
  found = []
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree.leaves(want)
  if len(got_leaves) != len(want_leaves):
    return [f"{what}: {len(got_leaves)} leaves, expected {len(want_leaves)}"]
  for (path, g), w in zip(got_leaves, want_leaves, strict=True):
    if g.dtype != w.dtype or g.shape != w.shape or not np.array_equal(_bits(g), _bits(w)):
      where = jax.tree_util.keystr(path)
      found.append(
        f"{what}{where}: got {g.dtype}{g.shape} bits {_bits(g).ravel()[:3]}, "
        f"want {_bits(w).ravel()[:3]}"
      )
  return found


def _check_params(label: str, state: Any, params: Any, reference_params: Any) -> list[str]:
  """Masters bitwise the reference; bf16 params their rounding; other leaves
  bitwise the reference."""
  masters = mpx.master_params(state, params)
  failures = _differences(f"{label} masters", masters, reference_params)
  rounded = jax.tree.map(
    lambda p, m: _round_bf16_ties_away(np.asarray(m)) if p.dtype == jnp.bfloat16 else m,
    params,
    reference_params,
  )
  return failures + _differences(f"{label} params", params, rounded)


def _start(tx: Any, reference: Any, case: Case) -> tuple[Any, ...]:
  """Both runs from the same params: ``tx`` on the bfloat16 ones and
  ``reference`` on them in float32; each run's params, state and jitted step."""
  params = _initial_params(case)
  reference_params = _to_f32(params)
  return (
    params,
    tx.init(params),
    _step_fn(tx, case),
    reference_params,
    reference.init(reference_params),
    _step_fn(reference, case),
  )


def check_mixed_precision(case: Case) -> list[str]:
  """Three steps of ``mixed_precision(rule)`` against ``rule`` in float32."""
  tx = mpx.mixed_precision(case.build(_plain))
  reference = case.build(_plain)
  params, state, step, reference_params, reference_state, reference_step = _start(
    tx, reference, case
  )
  failures: list[str] = []
  for k in range(3):
    grads = _gradients(reference_params, params, k, case)
    extra = _extra(case, reference_params, grads)
    params, state, _ = step(grads, state, params, extra)
    reference_params, reference_state, _ = reference_step(
      _to_f32(grads), reference_state, reference_params, _to_f32(extra)
    )
    failures += _check_params(f"mixed_precision step {k}", state, params, reference_params)
  return failures


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _set_rate(state: Any, name: str, value: float) -> Any:
  """The reference's injected rate set by hand (not with ``mpx.adjust``)."""

  def set_in(node: Any) -> Any:
    if isinstance(node, _INJECTED):
      return node._replace(hyperparams={**node.hyperparams, name: jnp.float32(value)})
    return node

  is_injected = lambda node: isinstance(node, _INJECTED)  # noqa: E731
  return jax.tree.map(set_in, state, is_leaf=is_injected)


def check_loss_scale(case: Case) -> list[str]:
  """``loss_scale(mixed_precision(injected rule))``: scaled steps, a skipped
  step, ``mpx.adjust``, against the injected rule in float32."""
  tx = mpx.loss_scale(
    mpx.mixed_precision(case.build(_injected)), init_scale=LOSS_SCALE, growth_interval=1000
  )
  reference = case.build(_injected)
  params, state, step, reference_params, reference_state, reference_step = _start(
    tx, reference, case
  )
  failures: list[str] = []
  for k, kind in enumerate(["finite", "inf", "finite", "adjust", "finite"]):
    if kind == "adjust":
      state = mpx.adjust(state, **{case.rate_name: LEARNING_RATE / 2})
      reference_state = _set_rate(reference_state, case.rate_name, LEARNING_RATE / 2)
      continue
    scale = float(mpx.get_loss_scale(state))
    grads = _gradients(reference_params, params, k, case)
    extra = _extra(case, reference_params, grads, scale)
    scaled = _scaled(grads, scale)
    if kind == "inf":
      scaled["w"] = scaled["w"].at[(0,) * scaled["w"].ndim].set(jnp.inf)
      before = (params, state.inner_state)
      params, state, updates = step(scaled, state, params, extra)
      failures += _differences("skipped step params", params, before[0])
      # Bitwise the state before, with the skip counted.
      counted = before[1]._replace(nonfinite_steps=before[1].nonfinite_steps + 1)
      failures += _differences("skipped step state", state.inner_state, counted)
      zeros = jax.tree.map(jnp.zeros_like, updates)
      failures += _differences("skipped step updates", updates, zeros)
      if bool(state.last_step_finite) or float(state.loss_scale) != scale / 2:
        failures.append(f"skipped step: scale {float(state.loss_scale)}, want {scale / 2}")
      continue
    params, state, _ = step(scaled, state, params, extra)
    reference_extra = _to_f32(_extra(case, reference_params, grads))
    reference_params, reference_state, _ = reference_step(
      _to_f32(grads), reference_state, reference_params, reference_extra
    )
    failures += _check_params(f"loss_scale step {k}", state, params, reference_params)
  compilations = step._cache_size()
  if compilations != 1:
    failures.append(f"loss_scale step compiled {compilations} times (adjust must not recompile)")
  return failures


def contraction_off() -> bool:
  """Whether XLA keeps ``x * y - z`` unfused: with a fused multiply-add the
  rounding error of ``x * y`` survives the subtraction."""
  x = np.float32(1 + 2**-12)
  product = np.float32(x * x)
  residual = jax.jit(lambda a, b, c: a * b - c)(
    jnp.full(64, x), jnp.full(64, x), jnp.full(64, product)
  )
  return bool(np.all(np.asarray(residual) == 0))
