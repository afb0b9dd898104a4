"""The Flax NNX + optax adapter: :class:`FlaxAdapter` and the pieces it is made of.

``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)`` is the loss of a
micro-batch as a sum over its valid items with their count, so masking is exact.
"""

from ._nnx_adapter import FlaxAdapter as FlaxAdapter
from ._nnx_adapter import StepOutput as StepOutput
from ._nnx_adapter import TrainStep as TrainStep
from ._nnx_fit import flax_fit as flax_fit
from ._nnx_optimizer import build_optax_optimizer as build_optax_optimizer
from ._nnx_program import flax_program as flax_program
from ._nnx_program import make_flax_step as make_flax_step
from ._nnx_program import rematerialized as rematerialized
from ._nnx_program import split_model as split_model

__all__ = [
    "FlaxAdapter",
    "StepOutput",
    "TrainStep",
    "build_optax_optimizer",
    "flax_fit",
    "flax_program",
    "make_flax_step",
    "rematerialized",
    "split_model",
]
