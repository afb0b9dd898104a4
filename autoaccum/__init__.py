"""autoaccum: the batch you want, within the memory you have.

Finds the largest per-device micro-batch whose compiled train step fits the accelerator,
accumulates gradients exactly over the rest inside one jitted step, scales the learning
rate by a named rule when you say which batch it was tuned for, and trains.

The top level is the front door: the entry points, the plan and what training returns, the
errors, callbacks and the names of the rules. The engine is public in documented subpackages,
each with its own ``__all__``: :mod:`autoaccum.planning` (budgets, compiled memory, the search,
learning-rate rules), :mod:`autoaccum.training` (exact accumulation, data parallelism,
callbacks), :mod:`autoaccum.devices` (profiles, detection, deviceless targets, meshes).

Example:
  >>> import autoaccum
  >>> {"fit", "plan", "train_step", "Plan", "DoesNotFitError"} <= set(autoaccum.__all__)
  True
  >>> autoaccum.planning.search_micro_batch.__module__
  'autoaccum.planning._search'
"""

# First: on a machine without a GPU, ``devices`` quiets JAX's and TensorFlow's start-up before
# anything imports them, and the ``autoaccum`` command's stderr filter starts (see
# autoaccum/devices/_quiet.py).
from . import devices as devices

# isort: split
from . import planning as planning
from . import training as training
from ._advise_api import advise as advise
from ._fit_api import fit as fit
from ._measure_api import measure as measure
from ._plan_api import plan as plan
from ._train_step_api import train_step as train_step
from ._version import __version__ as __version__
from .adapters.flax import StepOutput as StepOutput
from .adapters.flax import TrainStep as TrainStep
from .adapters.keras.presets import advise_preset as advise_preset
from .adapters.keras.presets import plan_preset as plan_preset
from .cli import plot_plan as plot_plan
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
from .training import BATCH_STATS_MODES as BATCH_STATS_MODES
from .training import NONFINITE_POLICIES as NONFINITE_POLICIES
from .training import Callback as Callback
from .training import FitResult as FitResult
from .training import NonFiniteError as NonFiniteError
from .training import StopTraining as StopTraining
from .training import Training as Training

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
