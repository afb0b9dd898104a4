"""Planning: the train-step contract, budgets, compiled memory, the micro-batch search, real-step
back-off, remat policies and learning-rate rules, and the resulting :class:`Plan`.

Imports only :mod:`autoaccum.devices`; frameworks are reached through :class:`Adapter`.
"""

from ._adapter_interface import Adapter as Adapter
from ._adapter_interface import FitSettings as FitSettings
from ._adapter_interface import Prepared as Prepared
from ._advisor import Advice as Advice
from ._advisor import Alternative as Alternative
from ._budget import Budget as Budget
from ._budget import Resident as Resident
from ._budget import profile_budget as profile_budget
from ._depth import DepthVariant as DepthVariant
from ._lr_scaling import LR_RULES as LR_RULES
from ._lr_scaling import LearningRateScaling as LearningRateScaling
from ._lr_scaling import scale_learning_rate as scale_learning_rate
from ._measure import CompileCount as CompileCount
from ._measure import MemoryEstimate as MemoryEstimate
from ._micro_batches import UnevenBatches as UnevenBatches
from ._plan import SCHEMA_VERSION as SCHEMA_VERSION
from ._plan import Limit as Limit
from ._plan import Plan as Plan
from ._plan import limiting_factor as limiting_factor
from ._plan_options import REMAT_POLICIES as REMAT_POLICIES
from ._plan_options import Candidate as Candidate
from ._plan_options import LearningRate as LearningRate
from ._plan_options import Search as Search
from ._plan_options import Target as Target
from ._search import DoesNotFitError as DoesNotFitError
from ._search import Probe as Probe
from ._strategies import StateLayout as StateLayout
from ._train_program import StepMetrics as StepMetrics
from ._train_program import TrainProgram as TrainProgram

__all__ = [
    "LR_RULES",
    "REMAT_POLICIES",
    "SCHEMA_VERSION",
    "Adapter",
    "Advice",
    "Alternative",
    "Budget",
    "Candidate",
    "CompileCount",
    "DepthVariant",
    "DoesNotFitError",
    "FitSettings",
    "Limit",
    "LearningRate",
    "LearningRateScaling",
    "MemoryEstimate",
    "Plan",
    "Prepared",
    "Probe",
    "Resident",
    "StateLayout",
    "Search",
    "StepMetrics",
    "Target",
    "TrainProgram",
    "UnevenBatches",
    "limiting_factor",
    "profile_budget",
    "scale_learning_rate",
]
