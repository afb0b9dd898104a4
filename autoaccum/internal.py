"""The engine's parts, public but unstable (equinox's ``internal`` convention).

What the guides use is in :mod:`autoaccum` and its documented subpackages
(:mod:`autoaccum.planning`, :mod:`autoaccum.training`, :mod:`autoaccum.devices`,
:mod:`autoaccum.reporting`, the adapters). Here is the machinery under them (compile requests,
the need cache, the search, back-off, deviceless targets, meshes, the adapters' program
builders), for tests, benchmarks and readers; it may change in any release without a
deprecation (the changelog says what moved).

Example:
  >>> from autoaccum.internal import search_micro_batch
  >>> search_micro_batch.__module__
  'autoaccum.planning._search'
"""

from typing import TYPE_CHECKING

from .devices._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers and the docs
    from .adapters.flax._nnx_optimizer import build_optax_optimizer as build_optax_optimizer
    from .adapters.flax._nnx_program import flax_program as flax_program
    from .adapters.flax._nnx_program import make_flax_step as make_flax_step
    from .adapters.flax._nnx_program import split_model as split_model
    from .adapters.keras._keras_data import KerasArrays as KerasArrays
    from .adapters.keras._keras_data import KerasData as KerasData
    from .adapters.keras._keras_data import keras_data as keras_data
    from .adapters.keras._keras_data import to_keras_arrays as to_keras_arrays
    from .adapters.keras._keras_learning_rate import (
        scale_keras_learning_rate as scale_keras_learning_rate,
    )
    from .adapters.keras._keras_program import check_keras_model as check_keras_model
    from .adapters.keras._keras_program import is_keras_model as is_keras_model
    from .adapters.keras._keras_program import keras_lowering_scope as keras_lowering_scope
    from .adapters.keras._keras_program import keras_program as keras_program
    from .adapters.keras._keras_program import (
        validate_keras_fit_kwargs as validate_keras_fit_kwargs,
    )
    from .adapters.keras._schedule import ScaledSchedule as ScaledSchedule
    from .adapters.keras.presets._architectures import Architecture as Architecture
    from .adapters.keras.presets._architectures import abstract_state as abstract_state
    from .adapters.keras.presets._architectures import abstract_token_batch as abstract_token_batch
    from .adapters.keras.presets._architectures import architectures_dir as architectures_dir
    from .adapters.keras.presets._architectures import (
        build_abstract_causal_lm as build_abstract_causal_lm,
    )
    from .adapters.keras.presets._architectures import load_architecture as load_architecture
    from .devices._detect import host_memory as host_memory
    from .devices._deviceless import DevicelessTarget as DevicelessTarget
    from .devices._deviceless import deviceless_target as deviceless_target
    from .devices._margins import Margin as Margin
    from .devices._margins import command_buffers_enabled as command_buffers_enabled
    from .devices._margins import environment_memory_fraction as environment_memory_fraction
    from .devices._mesh import data_parallel_mesh as data_parallel_mesh
    from .devices._mesh import replicate as replicate
    from .devices._mesh import resolve_mesh as resolve_mesh
    from .devices._mesh import shard_batches as shard_batches
    from .devices._oom import AddressSpaceCap as AddressSpaceCap
    from .planning._backoff import RealStepRunner as RealStepRunner
    from .planning._backoff import auto_plan as auto_plan
    from .planning._backoff import backoff_search as backoff_search
    from .planning._budget import parse_budget as parse_budget
    from .planning._budget import resident_of as resident_of
    from .planning._cache import CompileRequest as CompileRequest
    from .planning._cache import NeedCache as NeedCache
    from .planning._cache import measure_all as measure_all
    from .planning._cache import resolve_cache as resolve_cache
    from .planning._depth import DepthExtrapolator as DepthExtrapolator
    from .planning._depth import DepthVariants as DepthVariants
    from .planning._depth import plan_by_depth as plan_by_depth
    from .planning._measure import CompileTarget as CompileTarget
    from .planning._measure import measure_program as measure_program
    from .planning._micro_batches import micro_batch_sizes as micro_batch_sizes
    from .planning._micro_batches import micro_steps as micro_steps
    from .planning._micro_batches import split_sizes as split_sizes
    from .planning._plan_model import plan_program as plan_program
    from .planning._plan_options import METHODS as METHODS
    from .planning._plan_options import choose_fastest as choose_fastest
    from .planning._search import SearchResult as SearchResult
    from .planning._search import search_micro_batch as search_micro_batch
    from .planning._strategies import PARTITIONERS as PARTITIONERS
    from .planning._strategies import STRATEGIES as STRATEGIES
    from .planning._strategies import state_layout as state_layout
    from .planning._targets import ResolvedTarget as ResolvedTarget
    from .planning._targets import per_device_budget as per_device_budget
    from .planning._targets import resolve_target as resolve_target
    from .training._callbacks import NoiseScaleEstimator as NoiseScaleEstimator
    from .training._data_parallel import data_parallel_accumulate as data_parallel_accumulate
    from .training._epoch_batches import EpochBatches as EpochBatches
    from .training._epoch_batches import Rebatcher as Rebatcher
    from .training._snapshot import HostSnapshot as HostSnapshot
    from .training._step_runner import deferred_interrupts as deferred_interrupts

# Imported when first used: importing this module imports nothing else.
_MODULES: dict[str, tuple[str, ...]] = {
    "adapters.flax._nnx_optimizer": ("build_optax_optimizer",),
    "adapters.flax._nnx_program": ("flax_program", "make_flax_step", "split_model"),
    "adapters.keras._keras_data": ("KerasArrays", "KerasData", "keras_data", "to_keras_arrays"),
    "adapters.keras._keras_learning_rate": ("scale_keras_learning_rate",),
    "adapters.keras._keras_program": (
        "check_keras_model", "is_keras_model", "keras_lowering_scope", "keras_program",
        "validate_keras_fit_kwargs"),
    "adapters.keras._schedule": ("ScaledSchedule",),
    "adapters.keras.presets._architectures": (
        "Architecture", "abstract_state", "abstract_token_batch", "architectures_dir",
        "build_abstract_causal_lm", "load_architecture"),
    "devices._detect": ("host_memory",),
    "devices._deviceless": ("DevicelessTarget", "deviceless_target"),
    "devices._margins": ("Margin", "command_buffers_enabled", "environment_memory_fraction"),
    "devices._mesh": ("data_parallel_mesh", "replicate", "resolve_mesh", "shard_batches"),
    "devices._oom": ("AddressSpaceCap",),
    "planning._backoff": ("RealStepRunner", "auto_plan", "backoff_search"),
    "planning._budget": ("parse_budget", "resident_of"),
    "planning._cache": ("CompileRequest", "NeedCache", "measure_all", "resolve_cache"),
    "planning._depth": ("DepthExtrapolator", "DepthVariants", "plan_by_depth"),
    "planning._measure": ("CompileTarget", "measure_program"),
    "planning._micro_batches": ("micro_batch_sizes", "micro_steps", "split_sizes"),
    "planning._plan_model": ("plan_program",),
    "planning._plan_options": ("METHODS", "choose_fastest"),
    "planning._search": ("SearchResult", "search_micro_batch"),
    "planning._strategies": ("PARTITIONERS", "STRATEGIES", "state_layout"),
    "planning._targets": ("ResolvedTarget", "per_device_budget", "resolve_target"),
    "training._callbacks": ("NoiseScaleEstimator",),
    "training._data_parallel": ("data_parallel_accumulate",),
    "training._epoch_batches": ("EpochBatches", "Rebatcher"),
    "training._snapshot": ("HostSnapshot",),
    "training._step_runner": ("deferred_interrupts",),
}
__getattr__, __dir__ = lazy_exports(__name__, {
    name: f"autoaccum.{module}" for module, names in _MODULES.items() for name in names})

__all__ = [
    "abstract_state",
    "abstract_token_batch",
    "AddressSpaceCap",
    "Architecture",
    "architectures_dir",
    "auto_plan",
    "backoff_search",
    "build_abstract_causal_lm",
    "build_optax_optimizer",
    "check_keras_model",
    "choose_fastest",
    "command_buffers_enabled",
    "CompileRequest",
    "CompileTarget",
    "data_parallel_accumulate",
    "data_parallel_mesh",
    "deferred_interrupts",
    "DepthExtrapolator",
    "DepthVariants",
    "deviceless_target",
    "DevicelessTarget",
    "environment_memory_fraction",
    "EpochBatches",
    "flax_program",
    "host_memory",
    "HostSnapshot",
    "is_keras_model",
    "keras_data",
    "keras_lowering_scope",
    "keras_program",
    "KerasArrays",
    "KerasData",
    "load_architecture",
    "make_flax_step",
    "Margin",
    "measure_all",
    "measure_program",
    "METHODS",
    "micro_batch_sizes",
    "micro_steps",
    "NeedCache",
    "NoiseScaleEstimator",
    "parse_budget",
    "PARTITIONERS",
    "per_device_budget",
    "plan_by_depth",
    "plan_program",
    "RealStepRunner",
    "Rebatcher",
    "replicate",
    "resident_of",
    "resolve_cache",
    "resolve_mesh",
    "resolve_target",
    "ResolvedTarget",
    "scale_keras_learning_rate",
    "ScaledSchedule",
    "search_micro_batch",
    "SearchResult",
    "shard_batches",
    "split_model",
    "split_sizes",
    "state_layout",
    "STRATEGIES",
    "to_keras_arrays",
    "validate_keras_fit_kwargs",
]
