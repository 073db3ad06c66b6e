"""Scanned layers, each updated in its backward scan iteration (docs/howto.md)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from mpx._src import rounding, sharding, state_search, validation, verdict
from mpx._src.states import LossScaleState, ScanLayersState

# The floating type of each width that carries a non-floating leaf's bits out
# of the backward pass: a cotangent must be floating, of its primal's dtype.
# Only moved (sliced, written), never computed with, so every bit survives.
_CARRIERS = {1: jnp.float8_e4m3fn, 2: jnp.float16, 4: jnp.float32, 8: jnp.float64}


def scan_layers(block: Callable[[Any, Any], Any], tx: optax.GradientTransformation) -> ScanLayers:
  """Returns layers that run ``block`` under ``lax.scan`` and update themselves
  by ``tx`` in the backward pass, a layer at a time.

  Under ``lax.scan`` the backward scan emits the stacked gradient whole, and
  an optimizer step after it holds all of it. Here the backward scan's
  iteration ``i`` computes layer ``i``'s gradient, runs ``tx`` on that layer
  (its own slice of a stacked state) and writes the new layer over the old:
  the step holds one layer's gradient at a time. Differentiate the loss with
  respect to the :class:`mpx.ScanLayersState` that :meth:`ScanLayers.init`
  made: what ``jax.grad`` returns for it is the state after the update, not
  a gradient.

  With an elementwise rule each layer takes the update the stacked step
  gives it, bit for bit in its params (``mpx.mixed_precision`` draws the
  stacked leaves' random bits for the layer). Each layer's verdict is its
  own: ``tx``'s skip covers that layer's gradients, and each layer's state
  counts its own steps and skips. ``mpx.loss_scale`` is refused, since a
  loss scale must judge the whole step. Each block's forward pass runs again
  in the backward pass, as under ``jax.checkpoint``. docs/howto.md, "Update
  scanned layers in the backward pass", says what else to know: the layers
  must reach the loss through this call alone, once.

  Args:
    block: ``block(layer_params, carry) -> carry``, one layer; the carry
      keeps its structure and dtypes.
    tx: the rule each layer is updated by, e.g. ``mpx.mixed_precision(...)``.

  Returns:
    A :class:`ScanLayers`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpx
    >>> block = lambda w, x: jnp.tanh(x @ w)
    >>> stack = mpx.scan_layers(block, optax.sgd(0.1))
    >>> layers = stack.init(jnp.ones((3, 4, 4)) / 4)  # 3 layers
    >>> loss = lambda layers, x: jnp.sum(stack(layers, x))
    >>> new = jax.grad(loss)(layers, jnp.ones((2, 4)))  # the updated layers
    >>> new.params.shape, bool((new.params < layers.params).all())
    ((3, 4, 4), True)
  """
  return ScanLayers(block, optax.with_extra_args_support(tx))


@dataclasses.dataclass(frozen=True)
class ScanLayers:
  """Layers that :func:`scan_layers` made: call it on an :class:`mpx.ScanLayersState`
  and a carry to run the layers."""

  block: Callable[[Any, Any], Any]
  tx: optax.GradientTransformation

  def init(self, params: Any) -> ScanLayersState:
    """Returns the layers' state: ``params`` (each leaf stacked along a leading
    axis of one entry a layer) and ``tx``'s state for each layer, stacked."""
    _layer_count(params)
    _refuse_loss_scale(self._layer_state_like(params))
    return ScanLayersState(params, _carried(jax.vmap(self.tx.init)(params)))

  def __call__(self, layers: ScanLayersState, carry: Any) -> Any:
    """Returns ``carry`` after every layer, the first layer first."""
    if not isinstance(layers, ScanLayersState):
      raise TypeError(f"scan_layers: expected the ScanLayersState of init, got {type(layers)}")
    _layer_count(layers.params)
    _refuse_mapped_axes(carry)
    return _run(self, layers, carry)

  def inner_state(self, layers: ScanLayersState) -> Any:
    """Returns ``tx``'s stacked state as ``tx`` holds it: the non-floating
    leaves that ``layers.inner_state`` carries as floating bits restored."""
    return _restored(layers.inner_state, self._layer_state_like(layers.params))

  def zero1_shardings(self, params: Any, mesh: Any, axis: str | None = "data") -> ScanLayersState:
    """Returns shardings for :meth:`init`'s state: each layer's state split
    across ``axis`` as :func:`mpx.zero1_shardings` splits it, the layer axis
    kept whole on every device; the params as given (a ``NamedSharding`` on
    ``mesh``'s shape) or replicated."""
    layer = _one_layer(params)
    per_layer = sharding.zero1_shardings(self.tx, layer, mesh, axis)

    def stacked(leaf_sharding: NamedSharding, leaf: Any) -> NamedSharding:
      spec = list(leaf_sharding.spec)
      # A leaf carried several elements a float splits its last axis as the
      # carriers divide it, or not at all.
      width = jnp.dtype(leaf.dtype).itemsize
      per = 1 if jnp.issubdtype(leaf.dtype, jnp.inexact) else _per_carrier(leaf.shape, width)
      if per > 1 and len(spec) == len(leaf.shape) and spec[-1] is not None:
        names = spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],)
        if (leaf.shape[-1] // per) % math.prod(mesh.shape[name] for name in names):
          spec[-1] = None
      return NamedSharding(mesh, PartitionSpec(None, *spec))

    given = lambda x: getattr(x, "sharding", None)  # noqa: E731
    param_shardings = jax.tree.map(
      lambda x: (
        given(x) if isinstance(given(x), NamedSharding) else NamedSharding(mesh, PartitionSpec())
      ),
      params,
    )
    like = jax.eval_shape(self.tx.init, layer)
    return ScanLayersState(param_shardings, jax.tree.map(stacked, per_layer, like))

  def _layer_state_like(self, params: Any) -> Any:
    """The abstract state ``tx.init`` makes for one layer of ``params``."""
    return jax.eval_shape(self.tx.init, _one_layer(params))


def _one_layer(params: Any) -> Any:
  """One layer of the stacked ``params``, abstract."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), params)


def _layer_count(params: Any) -> int:
  """Returns the leading axis that every leaf of ``params`` shares; refuses
  anything else."""
  leaves = jax.tree.leaves(params)
  counts = {np.shape(x)[0] if np.ndim(x) else -1 for x in leaves}
  if not leaves or len(counts) != 1 or -1 in counts:
    shapes = [np.shape(x) for x in leaves]
    raise ValueError(f"scan_layers: params need one leading layer axis on every leaf, got {shapes}")
  return counts.pop()


def _refuse_loss_scale(state_like: Any) -> None:
  if state_search.find_states(state_like, LossScaleState):
    raise ValueError(
      "scan_layers: tx holds an mpx.loss_scale, whose scale must judge the whole "
      "step before any layer changes; the layers update one at a time. Scale float16 "
      "layers outside, or use bfloat16 params with mpx.mixed_precision."
    )


def _refuse_mapped_axes(carry: Any) -> None:
  """Refuses a carry that varies over ``shard_map`` axes: there each layer's
  gradient would be the device's own, and the transpose of the layers'
  broadcast to the devices would sum their new values. (Types before jax
  0.6.1 carry no such axes: docs/howto.md says it.)"""
  axes = validation.varying_axes(carry)
  if axes:
    raise ValueError(
      f"scan_layers: the carry varies over the shard_map axes {sorted(axes)}; each layer "
      "would be updated by the device's own gradient. Call it under jit with the batch "
      "sharded instead (each layer's gradient is then the whole batch's)."
    )


def _carried(state: Any) -> Any:
  """``state`` with each non-floating leaf's bits in a floating type: bytes four
  (or two) at a time along the last axis where it divides, in float32 (or
  float16), since XLA:CPU writes float8 arrays through a wider type (a whole
  stack converted at each layer); else one element in a floating type of its
  width."""

  def carried(x: Any) -> Any:
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return x
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    per = _per_carrier(x.shape, x.dtype.itemsize)
    if per > 1:
      x = x.reshape((*x.shape[:-1], x.shape[-1] // per, per))
    return jax.lax.bitcast_convert_type(x, _CARRIERS[x.dtype.itemsize * per])

  return jax.tree.map(carried, state)


def _per_carrier(shape: tuple[int, ...], width: int) -> int:
  """How many elements of ``width`` bytes one carrier holds, along the last axis."""
  if width != 1 or not shape:
    return 1
  return next((per for per in (4, 2) if shape[-1] % per == 0), 1)


def _restored(carried: Any, like: Any) -> Any:
  """The inverse of :func:`_carried`, given the state's abstract leaves (one
  layer's: only their dtypes and last axes are read, which stacking keeps)."""

  def restored(x: Any, leaf: Any) -> Any:
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      return x
    dtype = jnp.dtype(jnp.uint8) if leaf.dtype == jnp.bool_ else jnp.dtype(leaf.dtype)
    bits = jax.lax.bitcast_convert_type(x, dtype)
    if _per_carrier(leaf.shape, dtype.itemsize) > 1:
      bits = bits.reshape((*bits.shape[:-2], bits.shape[-2] * bits.shape[-1]))
    return bits != 0 if leaf.dtype == jnp.bool_ else bits

  return jax.tree.map(restored, carried, like)


def _index(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _put(tree: Any, new: Any, i: jax.Array) -> Any:
  return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0), tree, new)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run(stack: ScanLayers, layers: ScanLayersState, carry: Any) -> Any:
  return _forward(stack, layers, carry)[0]


def _forward(stack: ScanLayers, layers: ScanLayersState, carry: Any) -> tuple[Any, Any]:
  """Runs the layers; returns the last carry and each layer's input (what the
  backward pass runs each block again from)."""
  return jax.lax.scan(lambda h, p: (stack.block(p, h), h), carry, layers.params)


def _forward_saving(stack: ScanLayers, layers: ScanLayersState, carry: Any) -> tuple[Any, Any]:
  out, inputs = _forward(stack, layers, carry)
  return out, (layers, inputs)


def _backward(stack: ScanLayers, saved: Any, out_cotangent: Any) -> tuple[Any, Any]:
  """The backward scan: layer ``i``'s gradient, its update by ``tx`` and the
  new layer written over the old, last layer first. Returns the new layers
  as ``layers``' cotangent and the first carry's cotangent. The layers ride in
  the loop's carry and are written a slice at a time, so that XLA updates
  them in place (a scan's outputs would be new stacked arrays)."""
  layers, inputs = saved
  like = stack._layer_state_like(layers.params)
  # An mpx rule stores a layer narrower than it computes it, and XLA:GPU
  # writes out a new value with several readers before copying it into the
  # stack: behind a barrier in its stored form, else in float32 (docs/design.md,
  # "Compiler workarounds").
  as_stored = verdict.holds_mixed_precision(like)

  def layer_step(loop: Any, i: jax.Array) -> tuple[Any, None]:
    params, carried, cotangent = loop
    p = _index(params, i)
    _, vjp = jax.vjp(stack.block, p, _index(inputs, i))
    grads, cotangent = vjp(cotangent)
    # An mpx rule draws the stacked leaves' random bits for this layer
    # (rounding.StackedCount); other rules ignore the extra argument.
    extra = {rounding.STACKED_LAYER: i}
    updates, state = stack.tx.update(grads, _restored(_index(carried, i), like), p, **extra)
    new = (optax.apply_updates(p, updates), _carried(state))
    p, state = jax.lax.optimization_barrier(new) if as_stored else new
    return (_put(params, p, i), _put(carried, state, i), cotangent), None

  n = _layer_count(layers.params)
  loop = (layers.params, layers.inner_state, out_cotangent)
  (params, carried, cotangent), _ = jax.lax.scan(layer_step, loop, jnp.arange(n), reverse=True)
  return ScanLayersState(params, carried), cotangent


_run.defvjp(_forward_saving, _backward)
