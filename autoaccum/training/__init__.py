"""The training engine: the one step runner both adapters use (:class:`StepRunner`, each
framework supplying its model's state as :class:`StateHooks`), the one training loop on top of
it (:func:`run_fit_loop`, with a framework's :class:`FitHooks`), exact accumulation (one device
or data-parallel), batching and stream re-batching, elastic recovery, host snapshots, Ctrl-C
held back while state is written, progress, the gradient noise scale, and what ``fit`` returns.

Imports :mod:`autoaccum.planning` and :mod:`autoaccum.devices`; never a framework adapter.
"""

from ._accumulate import BATCH_STATS_MODES as BATCH_STATS_MODES
from ._accumulate import AccumulatedGradients as AccumulatedGradients
from ._accumulate import accumulate_gradients as accumulate_gradients
from ._accumulate import mean_gradients as mean_gradients
from ._accumulate import mean_loss as mean_loss
from ._accumulate import token_loss_sum as token_loss_sum
from ._callbacks import Callback as Callback
from ._callbacks import StopTraining as StopTraining
from ._fit_loop import EpochTally as EpochTally
from ._fit_loop import FitCallbacks as FitCallbacks
from ._fit_loop import FitHooks as FitHooks
from ._fit_loop import FitLoop as FitLoop
from ._fit_loop import FitResult as FitResult
from ._fit_loop import run_fit_loop as run_fit_loop
from ._nonfinite import NONFINITE_POLICIES as NONFINITE_POLICIES
from ._nonfinite import NonFiniteError as NonFiniteError
from ._step_runner import StateHooks as StateHooks
from ._step_runner import StateLostError as StateLostError
from ._step_runner import StepOutcome as StepOutcome
from ._step_runner import StepRunner as StepRunner
from ._training_options import Training as Training

__all__ = [
    "BATCH_STATS_MODES",
    "NONFINITE_POLICIES",
    "AccumulatedGradients",
    "Callback",
    "EpochTally",
    "FitCallbacks",
    "FitHooks",
    "FitLoop",
    "StateHooks",
    "StateLostError",
    "StopTraining",
    "Training",
    "FitResult",
    "NonFiniteError",
    "StepOutcome",
    "StepRunner",
    "accumulate_gradients",
    "mean_gradients",
    "mean_loss",
    "run_fit_loop",
    "token_loss_sum",
]
