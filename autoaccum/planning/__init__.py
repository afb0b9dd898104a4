"""Planning: the train-step contract, budgets, compiled memory, the micro-batch search, real-step
back-off, remat policies and learning-rate rules, and the resulting :class:`Plan`.

Imports only :mod:`autoaccum.devices`; frameworks are reached through :class:`Adapter`.
"""

from ._adapter_interface import Adapter as Adapter
from ._adapter_interface import FitSettings as FitSettings
from ._adapter_interface import Prepared as Prepared
from ._advisor import Advice as Advice
from ._advisor import Alternative as Alternative
from ._backoff import RealStepRunner as RealStepRunner
from ._backoff import auto_plan as auto_plan
from ._backoff import backoff_search as backoff_search
from ._budget import Budget as Budget
from ._budget import Resident as Resident
from ._budget import parse_budget as parse_budget
from ._budget import profile_budget as profile_budget
from ._budget import resident_of as resident_of
from ._cache import CompileRequest as CompileRequest
from ._cache import NeedCache as NeedCache
from ._cache import measure_all as measure_all
from ._cache import resolve_cache as resolve_cache
from ._depth import DepthExtrapolator as DepthExtrapolator
from ._depth import DepthVariant as DepthVariant
from ._depth import DepthVariants as DepthVariants
from ._depth import plan_by_depth as plan_by_depth
from ._lr_scaling import LR_RULES as LR_RULES
from ._lr_scaling import LearningRateScaling as LearningRateScaling
from ._lr_scaling import scale_learning_rate as scale_learning_rate
from ._measure import CompileTarget as CompileTarget
from ._measure import MemoryEstimate as MemoryEstimate
from ._measure import measure_program as measure_program
from ._micro_batches import UnevenBatches as UnevenBatches
from ._micro_batches import micro_batch_sizes as micro_batch_sizes
from ._micro_batches import micro_steps as micro_steps
from ._micro_batches import split_sizes as split_sizes
from ._plan import SCHEMA_VERSION as SCHEMA_VERSION
from ._plan import Limit as Limit
from ._plan import Plan as Plan
from ._plan import limiting_factor as limiting_factor
from ._plan_model import plan_program as plan_program
from ._plan_options import METHODS as METHODS
from ._plan_options import REMAT_POLICIES as REMAT_POLICIES
from ._plan_options import Candidate as Candidate
from ._plan_options import LearningRate as LearningRate
from ._plan_options import Search as Search
from ._plan_options import Target as Target
from ._plan_options import choose_fastest as choose_fastest
from ._search import DoesNotFitError as DoesNotFitError
from ._search import Probe as Probe
from ._search import SearchResult as SearchResult
from ._search import search_micro_batch as search_micro_batch
from ._strategies import PARTITIONERS as PARTITIONERS
from ._strategies import STRATEGIES as STRATEGIES
from ._strategies import StateLayout as StateLayout
from ._strategies import state_layout as state_layout
from ._targets import ResolvedTarget as ResolvedTarget
from ._targets import per_device_budget as per_device_budget
from ._targets import resolve_target as resolve_target
from ._train_program import StepMetrics as StepMetrics
from ._train_program import TrainProgram as TrainProgram

__all__ = [
    "LR_RULES",
    "METHODS",
    "PARTITIONERS",
    "REMAT_POLICIES",
    "SCHEMA_VERSION",
    "STRATEGIES",
    "Adapter",
    "Advice",
    "Alternative",
    "Budget",
    "Candidate",
    "CompileRequest",
    "CompileTarget",
    "DepthExtrapolator",
    "DepthVariant",
    "DepthVariants",
    "DoesNotFitError",
    "FitSettings",
    "Limit",
    "LearningRate",
    "LearningRateScaling",
    "MemoryEstimate",
    "NeedCache",
    "Plan",
    "Prepared",
    "Probe",
    "RealStepRunner",
    "Resident",
    "StateLayout",
    "ResolvedTarget",
    "Search",
    "SearchResult",
    "StepMetrics",
    "Target",
    "TrainProgram",
    "UnevenBatches",
    "auto_plan",
    "backoff_search",
    "choose_fastest",
    "limiting_factor",
    "measure_all",
    "measure_program",
    "micro_batch_sizes",
    "micro_steps",
    "parse_budget",
    "per_device_budget",
    "plan_by_depth",
    "plan_program",
    "profile_budget",
    "resolve_cache",
    "resident_of",
    "resolve_target",
    "scale_learning_rate",
    "search_micro_batch",
    "split_sizes",
    "state_layout",
]
