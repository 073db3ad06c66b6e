"""``check_master_precision``: an error where 24-bit masters stopped carrying the updates."""

from __future__ import annotations

import jax
import numpy as np
import optax

from mpx._src import state_search
from mpx._src.states import MIXED_PRECISION_STATES, MixedPrecision24bitState


class MasterPrecisionError(RuntimeError):
  """The updates of a ``masters="24bit"`` run fell below the precision of its
  largest masters (:func:`mpx.check_master_precision`)."""


def check_master_precision(opt_state: optax.OptState) -> None:
  """Raises if a ``masters="24bit"`` state counted a step too small for its masters.

  A 24-bit master keeps 15 bits of mantissa, so an update below half the
  spacing of 24-bit values at a weight is lost, and one below the spacing is
  rounded to a step of twice its size or to none. Each applied step counts,
  in the state's ``stalled_steps``, whether at some leaf the largest update
  was below the spacing at that leaf's largest master: the learning rate can
  no longer move the largest weights (the check FlashOptim makes of its
  24-bit masters, here of the updates themselves, inside the jitted step).
  The step is applied all the same. Both maxima are read over a sample
  spread evenly over every dimension of the leaf (a 256th of it, 256 to
  4096 elements, a smaller leaf whole), so large weights that fall between
  the sampled elements go unseen: a warning, not a proof (docs/concepts_masters.md).
  Counting costs no host sync; this check reads the count, so call it where
  the loop syncs anyway (at logging). States of other modes are not checked:
  their masters are float32.

  Args:
    opt_state: an optimizer state; its :class:`~mpx.MixedPrecision24bitState`
      states are found at any depth (``loss_scale``, chain, ``MultiSteps``,
      partitions).

  Raises:
    MasterPrecisionError: if any of them counted a stalled step, with the count
      and the fixes.
    ValueError: if ``opt_state`` holds no ``mixed_precision`` state at all
      (None, or the params passed by mistake).
    TypeError: under ``jax.jit``: the count is read on the host.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.full(3, 256.0, jnp.bfloat16)}  # spacing 2**-7 at 256
    >>> tx = mpx.mixed_precision(optax.sgd(1e-3), masters="24bit")
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
    >>> int(state.stalled_steps)
    1
    >>> mpx.check_master_precision(state)
    Traceback (most recent call last):
    ...
    mpx._src.precision_check.MasterPrecisionError: 1 of 1 applied steps ...
  """
  if not state_search.find_states(opt_state, MIXED_PRECISION_STATES):
    raise ValueError(
      "check_master_precision: opt_state holds no mixed_precision state (got a "
      f"{type(opt_state).__name__}): pass the optimizer state, e.g. the opt_state "
      "that tx.update returns, not the params."
    )
  for state in state_search.find_states(opt_state, MixedPrecision24bitState):
    if isinstance(state.stalled_steps, jax.core.Tracer):
      raise TypeError(
        "check_master_precision reads the stalled_steps count on the host, so it "
        "cannot run under jax.jit (or another transformation): call it outside the "
        "jitted step, where the loop syncs anyway (at logging)."
      )
    stalled = int(np.asarray(state.stalled_steps))
    if stalled:
      applied = int(np.asarray(state.applied_steps))
      raise MasterPrecisionError(
        f"{stalled} of {applied} applied steps of a mixed_precision(masters='24bit') "
        "state had a leaf whose largest update was below the spacing of 24-bit masters "
        "at its largest weight (2**-15 of it): those updates were rounded away or "
        "doubled. Raise the learning rate, keep the leaves with large weights under "
        "masters='remainder' (exact float32 masters, 1 byte more per param; e.g. with "
        "optax.partition), or switch the run with mpx.switch_masters."
      )
