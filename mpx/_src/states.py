"""Every optimizer state mpx makes, in one place (docs/design.md, "The modules")."""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax


class MixedPrecisionState(NamedTuple):
  """State of :func:`mpx.mixed_precision` with ``masters="full"``.

  Attributes:
    master_params: the parameter tree with a ``dtype`` master copy at every
      floating leaf narrower than ``dtype`` and ``optax.MaskedNode()`` at every
      other leaf (those are updated in place, with no copy). The masters are
      the true weights; the low-precision parameters are their rounding.
    applied_steps: int32, the number of steps applied.
    nonfinite_steps: int32, the number of steps this transformation skipped
      because a gradient, as the inner rule would receive it, held inf or NaN.
      Under :func:`mpx.loss_scale`, read its ``skipped_steps``: it counts every
      skip of the step, whoever found it.
    inner_state: the wrapped rule's state, built on the master view, so all of
      its floating leaves (Adam's moments, injected hyperparameters) are in
      ``dtype`` or wider.
  """

  master_params: optax.Params
  applied_steps: jax.Array
  nonfinite_steps: jax.Array
  inner_state: optax.OptState


class MixedPrecisionRemainderState(NamedTuple):
  """State of :func:`mpx.mixed_precision` with ``masters="remainder"``.

  Attributes:
    master_remainders: the parameter tree with, at every bfloat16 leaf, the
      int16 that completes it to its float32 master (``Remainder.view`` in
      :mod:`mpx._src.storage`), and ``optax.MaskedNode()``
      at every other leaf. Use :func:`mpx.master_params` for the masters.
    applied_steps: as in :class:`MixedPrecisionState`.
    nonfinite_steps: as in :class:`MixedPrecisionState`.
    inner_state: the wrapped rule's state, built on the float32 master view.
  """

  master_remainders: optax.Params
  applied_steps: jax.Array
  nonfinite_steps: jax.Array
  inner_state: optax.OptState


class MixedPrecisionStochasticState(NamedTuple):
  """State of :func:`mpx.mixed_precision` with ``masters="stochastic"``.

  Attributes:
    rounding_keys: the parameter tree with a uint32 scalar at every bfloat16
      leaf (its stream of random bits, from ``seed`` and the leaf's position)
      and ``optax.MaskedNode()`` at every other leaf.
    applied_steps: int32, the number of applied steps; also the counter of
      the random bits, so a skipped step draws no bits.
    nonfinite_steps: as in :class:`MixedPrecisionState`.
    inner_state: the wrapped rule's state, built on the params in float32.
  """

  rounding_keys: optax.Params
  applied_steps: jax.Array
  nonfinite_steps: jax.Array
  inner_state: optax.OptState


class MixedPrecision24bitState(NamedTuple):
  """State of :func:`mpx.mixed_precision` with ``masters="24bit"``.

  Attributes:
    master_corrections: the parameter tree with, at every bfloat16 leaf, the
      int8 that completes it to its 24-bit master (a float32 with 15 bits of
      mantissa: ``Master24bit.view`` in
      :mod:`mpx._src.storage`), and ``optax.MaskedNode()`` at every other
      leaf. Use :func:`mpx.master_params` for the masters.
    applied_steps: as in :class:`MixedPrecisionState`.
    nonfinite_steps: as in :class:`MixedPrecisionState`.
    stalled_steps: int32, the number of applied steps on which, at some leaf,
      the largest update was below the spacing of 24-bit masters at the
      leaf's largest master: a learning rate too small for the largest
      weights, whose updates then round away or double. Both maxima are read
      over a sample spread evenly over every dimension of the leaf (a 256th
      of it, 256 to 4096 elements, a smaller leaf whole): large weights
      between the sampled elements go unseen. The step is applied all the
      same; :func:`mpx.check_master_precision` raises on a nonzero count.
    inner_state: the wrapped rule's state, built on the float32 master view.
  """

  master_corrections: optax.Params
  applied_steps: jax.Array
  nonfinite_steps: jax.Array
  stalled_steps: jax.Array
  inner_state: optax.OptState


MIXED_PRECISION_STATES = (
  MixedPrecisionState,
  MixedPrecisionRemainderState,
  MixedPrecision24bitState,
  MixedPrecisionStochasticState,
)


class Bfloat16Moment(NamedTuple):
  """A float32 leaf of the inner rule's state stored in bfloat16
  (``mixed_precision(..., moments="bfloat16")``); :func:`mpx.inner_state`
  gives it back in float32.

  Attributes:
    values: the leaf, rounded stochastically to bfloat16.
  """

  values: jax.Array


class Signed8bitMoment(NamedTuple):
  """A float32 leaf of the inner rule's state that may take either sign (a
  first moment: ``mu``, ``trace``) stored in 8 bits
  (``mixed_precision(..., moments="8bit")``); :func:`mpx.inner_state` gives
  it back in float32.

  Attributes:
    codes: uint8, the leaf's shape: a sign bit and a 7-bit magnitude level
      relative to the element's block.
    scales: float32, ``shape[:-1] + (n_blocks,)``: the largest magnitude of
      each block of at most 256 elements along the last axis.
  """

  codes: jax.Array
  scales: jax.Array


class Nonnegative8bitMoment(NamedTuple):
  """A non-negative float32 leaf of the inner rule's state (a second moment:
  ``nu``) stored in 8 bits (``mixed_precision(..., moments="8bit")``): a
  positive value never decodes to zero. :func:`mpx.inner_state` gives it
  back in float32.

  Attributes:
    codes: uint8, the leaf's shape: one of 255 nonzero levels (or zero)
      relative to the element's block.
    scales: float32, ``shape[:-1] + (n_blocks,)``: the largest value of each
      block of at most 256 elements along the last axis.
  """

  codes: jax.Array
  scales: jax.Array


class Signed4bitMoment(NamedTuple):
  """A float32 leaf of the inner rule's state that may take either sign (a
  first moment) stored in 4 bits (``mixed_precision(..., moments="4bit")``);
  :func:`mpx.inner_state` gives it back in float32.

  Attributes:
    codes: uint8, ``(*shape[:-1], shape[-1] // 2)``: two codes a byte (element
      ``2i`` in the low nibble), each a sign bit and a 3-bit magnitude level
      ``(j / 7) ** 2`` of the element's block maximum.
    scales: float32, ``(*shape[:-1], n_blocks + shape[-1] % 2)``: the largest
      magnitude of each block of at most 128 elements along the last axis;
      for an odd last axis, then the row's last element itself.
  """

  codes: jax.Array
  scales: jax.Array


class Nonnegative4bitMoment(NamedTuple):
  """A non-negative float32 leaf of the inner rule's state (a second moment)
  stored in 4 bits (``mixed_precision(..., moments="4bit")``): a positive
  value never decodes to zero. :func:`mpx.inner_state` gives it back in
  float32.

  Attributes:
    codes: uint8, ``(*shape[:-1], shape[-1] // 2)``: two codes a byte, each
      zero (a value that is not positive) or one of 15 levels of the
      element's block, evenly spaced in the float32 bits between its ends.
    ranges: float32, ``(*shape[:-1], n_blocks + shape[-1] % 2)``: each block
      of at most 128 elements along the last axis as a word holding its top
      level (its largest value, rounded up to 11 mantissa bits) and the step
      between its levels (docs/moment_codes.md, "4 bits"); for an odd last
      axis, then the row's last element itself. (States saved before held
      each block's largest value here, as ``scales``: they no longer
      restore into this type, rather than decode wrongly.)
  """

  codes: jax.Array
  ranges: jax.Array


# Every stored form of a compressed moment: a node of the inner state that
# stands for one float32 leaf of the inner rule's state.
COMPRESSED_MOMENTS: tuple[type, ...] = (
  Bfloat16Moment,
  Signed8bitMoment,
  Nonnegative8bitMoment,
  Signed4bitMoment,
  Nonnegative4bitMoment,
)


class LossScaleState(NamedTuple):
  """State of :func:`mpx.loss_scale` and :func:`mpx.static_loss_scale`.

  Attributes:
    loss_scale: float32 scalar; multiply the loss by it before differentiating
      (see :func:`mpx.scale_loss`). It is the scale the next gradients are
      unscaled with.
    growth_tracker: int32 count of consecutive finite steps since the last
      growth or overflow.
    overflow_streak: int32 count of consecutive non-finite steps (drives
      ``hysteresis``).
    skipped_steps: int32 total of steps skipped for non-finite values: in the
      gradients, in their cast to a master dtype, or made by a rule inside.
    last_step_finite: bool, whether the last step was applied.
    inner_state: the wrapped rule's state.
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array
  overflow_streak: jax.Array
  skipped_steps: jax.Array
  last_step_finite: jax.Array
  inner_state: optax.OptState


class AccumulationState(NamedTuple):
  """State of :func:`mpx.accumulate`; ``mini_step``, ``gradient_step`` and
  ``acc_grads`` are named as ``optax.MultiSteps`` names them, for trainers
  that read them with ``optax.tree.get``.

  Attributes:
    mini_step: int32, the micro-batches averaged in the current window.
    gradient_step: int32, the windows ended (each ran the inner rule once).
    acc_grads: the mean of the window's gradients so far, float32 or
      bfloat16, at each floating param leaf (``optax.MaskedNode()`` at the
      others), inf or NaN where a micro-batch held them (its window is then
      skipped). After a window ends it holds that window's mean until the
      next micro-batch starts the next (so the step that ends a window writes
      it only once).
    inner_state: the wrapped rule's state.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  acc_grads: optax.Updates
  inner_state: optax.OptState


class ScanLayersState(NamedTuple):
  """The layers of :func:`mpx.scan_layers`, params and optimizer state together,
  so that one ``jax.grad`` argument returns both after the update.

  Attributes:
    params: the layers' params, each leaf stacked along a leading axis of one
      entry a layer.
    inner_state: the layers' rule's state for each layer, stacked along a
      leading axis; its non-floating leaves (counters, codes, keys) hold
      their bits in a floating type of the same width, since a cotangent
      carries it out of the backward pass (``ScanLayers.inner_state`` gives
      the state as the rule holds it).
  """

  params: optax.Params
  inner_state: optax.OptState
