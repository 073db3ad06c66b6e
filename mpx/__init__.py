"""mpx: mixed-precision training as optax gradient transformations.

``mpx.mixed_precision(optax.adamw(3e-4))`` trains bfloat16 params on float32
masters; wrap it in ``mpx.loss_scale`` for float16.
"""

from mpx._src.accumulation import accumulate, accumulate_gradients
from mpx._src.clipping import clipped_grad
from mpx._src.full_precision import init_from_full_precision
from mpx._src.hyperparams import adjust
from mpx._src.loss_scale import (
  get_loss_scale,
  loss_scale,
  scale_loss,
  static_loss_scale,
  unscale,
)
from mpx._src.mixed_precision import inner_state, master_params, mixed_precision
from mpx._src.precision_check import MasterPrecisionError, check_master_precision
from mpx._src.scan_layers import ScanLayers, scan_layers
from mpx._src.sharding import zero1_shardings
from mpx._src.states import (
  AccumulationState,
  Bfloat16Moment,
  LossScaleState,
  MixedPrecision24bitState,
  MixedPrecisionRemainderState,
  MixedPrecisionState,
  MixedPrecisionStochasticState,
  Nonnegative4bitMoment,
  Nonnegative8bitMoment,
  ScanLayersState,
  Signed4bitMoment,
  Signed8bitMoment,
)
from mpx._src.switch import switch_masters
from mpx._src.sync import sync_masters
from mpx._src.tree import cast_tree, select_tree
from mpx._src.verdict import all_finite

__version__ = "0.1.0"

__all__ = [
  "AccumulationState",
  "Bfloat16Moment",
  "LossScaleState",
  "MasterPrecisionError",
  "MixedPrecision24bitState",
  "MixedPrecisionRemainderState",
  "MixedPrecisionState",
  "MixedPrecisionStochasticState",
  "Nonnegative4bitMoment",
  "Nonnegative8bitMoment",
  "ScanLayers",
  "ScanLayersState",
  "Signed4bitMoment",
  "Signed8bitMoment",
  "accumulate",
  "accumulate_gradients",
  "adjust",
  "all_finite",
  "cast_tree",
  "check_master_precision",
  "clipped_grad",
  "get_loss_scale",
  "init_from_full_precision",
  "inner_state",
  "loss_scale",
  "master_params",
  "mixed_precision",
  "scale_loss",
  "scan_layers",
  "select_tree",
  "static_loss_scale",
  "switch_masters",
  "sync_masters",
  "unscale",
  "zero1_shardings",
]
