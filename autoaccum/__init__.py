"""autoaccum: the batch you want, within the memory you have.

Finds the largest per-device micro-batch whose compiled train step fits the accelerator,
accumulates gradients exactly over the rest inside one jitted step, scales the learning
rate by a named rule, and trains.
"""

from ._accumulate import AccumulatedGradients as AccumulatedGradients
from ._accumulate import accumulate_gradients as accumulate_gradients
from ._accumulate import mean_gradients as mean_gradients
from ._accumulate import mean_loss as mean_loss
from ._api import fit as fit
from ._api import measure as measure
from ._api import plan as plan
from ._api import plan_program as plan_program
from ._budget import Budget as Budget
from ._budget import format_bytes as format_bytes
from ._budget import parse_budget as parse_budget
from ._configure import configure as configure
from ._data_parallel import data_parallel_accumulate as data_parallel_accumulate
from ._data_parallel import data_parallel_mesh as data_parallel_mesh
from ._data_parallel import replicate as replicate
from ._data_parallel import shard_batches as shard_batches
from ._detect import DetectedDevice as DetectedDevice
from ._detect import detect_device as detect_device
from ._deviceless import DevicelessTarget as DevicelessTarget
from ._deviceless import deviceless_target as deviceless_target
from ._lr import LR_RULES as LR_RULES
from ._lr import LearningRateScaling as LearningRateScaling
from ._lr import scale_learning_rate as scale_learning_rate
from ._measure import CompileTarget as CompileTarget
from ._measure import MemoryEstimate as MemoryEstimate
from ._measure import measure_program as measure_program
from ._noise_scale import NoiseScaleEstimator as NoiseScaleEstimator
from ._objective import Candidate as Candidate
from ._objective import choose_fastest as choose_fastest
from ._oom import is_out_of_memory as is_out_of_memory
from ._plan import Plan as Plan
from ._plot import plot_plan as plot_plan
from ._profiles import DeviceProfile as DeviceProfile
from ._profiles import find_profile as find_profile
from ._profiles import list_profiles as list_profiles
from ._program import StepMetrics as StepMetrics
from ._program import TrainProgram as TrainProgram
from ._remat import REMAT_POLICIES as REMAT_POLICIES
from ._remat import rematerialized as rematerialized
from ._result import FitResult as FitResult
from ._search import DoesNotFitError as DoesNotFitError
from ._search import Probe as Probe
from ._search import SearchResult as SearchResult
from ._search import search_micro_batch as search_micro_batch
from ._targets import ResolvedTarget as ResolvedTarget
from ._targets import per_device_budget as per_device_budget
from ._targets import resolve_target as resolve_target

__version__ = "0.1.0"
