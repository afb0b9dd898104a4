"""autoaccum: the batch you want, within the memory you have.

Finds the largest per-device micro-batch whose compiled train step fits the accelerator,
accumulates gradients exactly over the rest inside one jitted step, scales the learning
rate by a named rule when you say which batch it was tuned for, and trains.

The top level is the front door: entry points, plans and results, errors, callbacks and the
names of the rules, each imported when first used (importing autoaccum changes nothing in the
process). The engine is public in documented subpackages: :mod:`autoaccum.planning` (budgets,
compiled memory, the search, learning-rate rules), :mod:`autoaccum.training` (exact
accumulation, data parallelism, callbacks), :mod:`autoaccum.devices` (profiles, detection,
deviceless targets, meshes), :mod:`autoaccum.reporting` (reports, tables, plots); unstable
parts are in :mod:`autoaccum.internal`.

Example:
  >>> import autoaccum
  >>> {"fit", "plan", "train_step", "Plan", "DoesNotFitError"} <= set(autoaccum.__all__)
  True
  >>> autoaccum.internal.search_micro_batch.__module__
  'autoaccum.planning._search'
"""

from typing import TYPE_CHECKING

from .devices._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers and the docs
    from . import devices as devices
    from . import internal as internal
    from . import planning as planning
    from . import reporting as reporting
    from . import training as training
    from ._front_door import advise as advise
    from ._front_door import fit as fit
    from ._front_door import measure as measure
    from ._front_door import plan as plan
    from ._front_door import train_step as train_step
    from ._version import __version__ as __version__
    from .adapters.flax import StepOutput as StepOutput
    from .adapters.flax import TrainStep as TrainStep
    from .adapters.keras.presets import advise_preset as advise_preset
    from .adapters.keras.presets import plan_preset as plan_preset
    from .devices import configure as configure
    from .devices import is_out_of_memory as is_out_of_memory
    from .planning import LR_RULES as LR_RULES
    from .planning import REMAT_POLICIES as REMAT_POLICIES
    from .planning import Advice as Advice
    from .planning import DepthVariant as DepthVariant
    from .planning import DoesNotFitError as DoesNotFitError
    from .planning import LearningRate as LearningRate
    from .planning import Plan as Plan
    from .planning import Search as Search
    from .planning import Target as Target
    from .reporting import plot_plan as plot_plan
    from .training import BATCH_STATS_MODES as BATCH_STATS_MODES
    from .training import NONFINITE_POLICIES as NONFINITE_POLICIES
    from .training import Callback as Callback
    from .training import FitResult as FitResult
    from .training import NonFiniteError as NonFiniteError
    from .training import StopTraining as StopTraining
    from .training import Training as Training

# Imported when first used: ``import autoaccum`` imports neither JAX nor a framework.
__getattr__, __dir__ = lazy_exports(__name__, {
    "devices": ".devices", "planning": ".planning", "training": ".training",
    "reporting": ".reporting", "internal": ".internal",
    "advise": "._front_door", "fit": "._front_door", "measure": "._front_door",
    "plan": "._front_door", "train_step": "._front_door", "__version__": "._version",
    "StepOutput": ".adapters.flax", "TrainStep": ".adapters.flax",
    "advise_preset": ".adapters.keras.presets", "plan_preset": ".adapters.keras.presets",
    "plot_plan": ".reporting", "configure": ".devices._configure",
    "is_out_of_memory": ".devices._oom",
    **dict.fromkeys(("LR_RULES", "REMAT_POLICIES", "Advice", "DepthVariant", "DoesNotFitError",
                     "LearningRate", "Plan", "Search", "Target"), ".planning"),
    **dict.fromkeys(("BATCH_STATS_MODES", "NONFINITE_POLICIES", "Callback", "FitResult",
                     "NonFiniteError", "StopTraining", "Training"), ".training"),
})

__all__ = [
    # entry points
    "advise",
    "advise_preset",
    "configure",
    "fit",
    "measure",
    "plan",
    "plan_preset",
    "plot_plan",
    "train_step",
    # options
    "LearningRate",
    "Search",
    "Target",
    "Training",
    # plans, steps and results
    "Advice",
    "DepthVariant",
    "FitResult",
    "Plan",
    "StepOutput",
    "TrainStep",
    # errors
    "DoesNotFitError",
    "NonFiniteError",
    "is_out_of_memory",
    # callbacks
    "Callback",
    "StopTraining",
    # names of the rules
    "BATCH_STATS_MODES",
    "LR_RULES",
    "NONFINITE_POLICIES",
    "REMAT_POLICIES",
]
