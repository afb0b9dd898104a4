"""autoaccum: the batch you want, within the memory you have.

Finds the largest per-device micro-batch whose compiled train step fits the accelerator,
accumulates gradients exactly over the rest inside one jitted step, scales the learning
rate by a named rule, and trains.
"""

from .cli._quiet import quiet_command_line as _quiet_command_line

_quiet_command_line()  # only for the `autoaccum` command, before JAX is imported

# First: on a machine without a GPU, ``devices`` quiets JAX's and TensorFlow's start-up before
# anything imports them (see autoaccum/devices/_quiet.py).
from . import devices as devices

# isort: split
from ._advise_api import advise as advise
from ._api import fit as fit
from ._api import measure as measure
from ._api import plan as plan
from ._train_step import train_step as train_step
from .adapters.flax import StepOutput as StepOutput
from .adapters.flax import TrainStep as TrainStep
from .adapters.flax import rematerialized as rematerialized
from .adapters.keras.presets import advise_preset as advise_preset
from .adapters.keras.presets import plan_preset as plan_preset
from .cli import plot_plan as plot_plan
from .devices import DetectedDevice as DetectedDevice
from .devices import DevicelessTarget as DevicelessTarget
from .devices import DeviceProfile as DeviceProfile
from .devices import configure as configure
from .devices import data_parallel_mesh as data_parallel_mesh
from .devices import detect_device as detect_device
from .devices import deviceless_target as deviceless_target
from .devices import find_profile as find_profile
from .devices import format_bytes as format_bytes
from .devices import is_out_of_memory as is_out_of_memory
from .devices import list_profiles as list_profiles
from .devices import replicate as replicate
from .devices import shard_batches as shard_batches
from .planning import LR_RULES as LR_RULES
from .planning import REMAT_POLICIES as REMAT_POLICIES
from .planning import Advice as Advice
from .planning import Alternative as Alternative
from .planning import Budget as Budget
from .planning import Candidate as Candidate
from .planning import CompileTarget as CompileTarget
from .planning import DepthVariant as DepthVariant
from .planning import DoesNotFitError as DoesNotFitError
from .planning import LearningRateScaling as LearningRateScaling
from .planning import MemoryEstimate as MemoryEstimate
from .planning import NeedCache as NeedCache
from .planning import Plan as Plan
from .planning import Probe as Probe
from .planning import Resident as Resident
from .planning import ResolvedTarget as ResolvedTarget
from .planning import SearchResult as SearchResult
from .planning import StepMetrics as StepMetrics
from .planning import TrainProgram as TrainProgram
from .planning import UnevenBatches as UnevenBatches
from .planning import choose_fastest as choose_fastest
from .planning import measure_program as measure_program
from .planning import parse_budget as parse_budget
from .planning import per_device_budget as per_device_budget
from .planning import plan_program as plan_program
from .planning import resolve_target as resolve_target
from .planning import scale_learning_rate as scale_learning_rate
from .planning import search_micro_batch as search_micro_batch
from .training import BATCH_STATS_MODES as BATCH_STATS_MODES
from .training import NONFINITE_POLICIES as NONFINITE_POLICIES
from .training import AccumulatedGradients as AccumulatedGradients
from .training import Callback as Callback
from .training import FitResult as FitResult
from .training import NoiseScaleEstimator as NoiseScaleEstimator
from .training import NonFiniteError as NonFiniteError
from .training import StopTraining as StopTraining
from .training import accumulate_gradients as accumulate_gradients
from .training import data_parallel_accumulate as data_parallel_accumulate
from .training import mean_gradients as mean_gradients
from .training import mean_loss as mean_loss

__version__ = "0.1.0"
