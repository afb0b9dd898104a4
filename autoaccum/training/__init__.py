"""The training engine: exact accumulation (one device or data-parallel), batching, elastic
recovery, host snapshots, progress, the gradient noise scale, and what ``fit`` returns.

Imports :mod:`autoaccum.planning` and :mod:`autoaccum.devices`; never a framework adapter.
"""

from ._accumulate import AccumulatedGradients as AccumulatedGradients
from ._accumulate import accumulate_gradients as accumulate_gradients
from ._accumulate import mean_gradients as mean_gradients
from ._accumulate import mean_loss as mean_loss
from ._batch_stats import BATCH_STATS_MODES as BATCH_STATS_MODES
from ._callbacks import Callback as Callback
from ._callbacks import StopTraining as StopTraining
from ._data_parallel import data_parallel_accumulate as data_parallel_accumulate
from ._live import LiveState as LiveState
from ._live import StateLostError as StateLostError
from ._noise_scale import NoiseScaleEstimator as NoiseScaleEstimator
from ._nonfinite import NONFINITE_POLICIES as NONFINITE_POLICIES
from ._nonfinite import NonFiniteError as NonFiniteError
from ._result import FitResult as FitResult
from ._snapshot import HostSnapshot as HostSnapshot

__all__ = [
    "BATCH_STATS_MODES",
    "NONFINITE_POLICIES",
    "AccumulatedGradients",
    "Callback",
    "LiveState",
    "StateLostError",
    "StopTraining",
    "FitResult",
    "HostSnapshot",
    "NoiseScaleEstimator",
    "NonFiniteError",
    "accumulate_gradients",
    "data_parallel_accumulate",
    "mean_gradients",
    "mean_loss",
]
