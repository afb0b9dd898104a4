"""The Flax NNX + optax adapter: :class:`FlaxAdapter` and the pieces it is made of.

``loss_fn(model, batch) -> (sum_of_losses, number_of_valid_items)`` is the loss of a
micro-batch as a sum over its valid items with their count, so masking is exact.
"""

from ._nnx_adapter import FlaxAdapter as FlaxAdapter
from ._nnx_adapter import StepOutput as StepOutput
from ._nnx_adapter import TrainStep as TrainStep
from ._nnx_fit import flax_fit as flax_fit
from ._nnx_program import rematerialized as rematerialized

__all__ = [
    "FlaxAdapter",
    "StepOutput",
    "TrainStep",
    "flax_fit",
    "rematerialized",
]
