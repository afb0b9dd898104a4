"""The one interface between autoaccum's core and a framework: what an adapter implements.

The planner, back-off and ``fit`` talk only to an :class:`Adapter`; only the public entry points
(``autoaccum.plan``, ``measure``, ``fit``) pick one for the model they are given
(:func:`autoaccum.adapters.adapter_for`). An adapter recognises its models, builds their
accumulated train step as a :class:`~autoaccum.planning._train_program.TrainProgram`, runs real
steps for back-off, applies a rematerialization policy to the model's blocks, and trains.
Imports point one way: adapters -> training / planning -> devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TextIO, runtime_checkable

from ._lr_scaling import LearningRateScaling
from ._train_program import TrainProgram

if TYPE_CHECKING:
    from ._backoff import RealStepRunner
    from ._plan import Plan

__all__ = ["Adapter", "FitSettings", "Prepared"]


@dataclass(frozen=True)
class Prepared:
    """A model's accumulated step for one remat policy, its data, and its learning-rate scaling.

    Built by :meth:`Adapter.prepare`; ``extras`` holds what only that adapter reads back (the
    optax transformation and ``loss_fn`` for Flax, the converted arrays for Keras).
    """

    program: TrainProgram
    data: Any
    """The training data as host arrays with a leading example axis (as the adapter trains on)."""
    lr_scaling: LearningRateScaling
    adapter: Adapter
    remat: str = "none"
    extras: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FitSettings:
    """The framework-neutral options of ``autoaccum.fit``, as an adapter's ``fit`` receives them."""

    epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    verbose: Any = 1
    log: TextIO | None = None
    elastic: bool = True
    backup: str = "auto"
    mesh: Any = None
    """The one-axis data-parallel ``jax.sharding.Mesh`` of the plan, or ``None``."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradients are not finite: ``"stop"`` (raise ``NonFiniteError``, the
    model keeps the last finite state) or ``"skip"`` (state unchanged, counted, go on); see
    ``autoaccum.training._nonfinite``."""
    batch_stats: str = "effective"
    """BatchNorm running averages: ``"effective"`` (one update per optimizer step from the
    whole effective batch's moments) or ``"micro"`` (one per micro-batch); see
    ``autoaccum.training._batch_norm_moments``."""
    drop_remainder: bool = False
    """``False``: the examples after the last full effective batch of an epoch make a final,
    smaller step (normalised by its own count); ``True``: they are dropped. Either way the
    result says how many."""
    uneven: bool = True
    """Whether steps the adapter splits itself (a leftover step, validation batches) may end
    with a smaller micro-batch; ``False``: divisors only."""


@runtime_checkable
class Adapter(Protocol):
    """What a framework adapter implements (see :mod:`autoaccum.adapters`).

    Example:
      >>> from autoaccum.adapters import adapter_for
      >>> from flax import nnx
      >>> adapter = adapter_for(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
      >>> isinstance(adapter, Adapter), adapter.name
      (True, 'flax')
    """

    name: str
    """``"flax"`` or ``"keras"``: how reports and errors name the framework."""
    remat_policies: tuple[str, ...]
    """Policies ``remat="auto"`` tries, in order of increasing recompute.

    Optional class attributes, read with ``getattr``: ``trains_leftovers`` (``True``: the
    examples after the last full effective batch make a final step) and ``uneven_batches``
    (``True``: the adapter's steps take :class:`~._micro_batches.UnevenBatches`, so plans may end
    with a smaller micro-batch)."""

    def recognizes(self, model: Any) -> bool:
        """Whether ``model`` belongs to this framework."""
        ...

    def prepare(self, model: Any, data: Any, *, effective_batch: int, options: dict,
                remat: str, remat_layers: Any) -> Prepared:
        """The model's program with ``remat``; consumes (pops) the ``options`` it uses."""
        ...

    def remat_context(self, model: Any, policy: str,
                      layers: Any = None) -> AbstractContextManager[int]:
        """Within the context the model's blocks run rematerialized with ``policy``."""
        ...

    def has_remat_layers(self, model: Any, layers: Any = None) -> bool:
        """Whether per-layer rematerialization has blocks to wrap in ``model``."""
        ...

    def auto_mesh(self) -> Any:
        """The mesh ``data_parallel="auto"`` means for this framework, or ``None``."""
        ...

    def step_runner(self, model: Any, prepared: Prepared) -> RealStepRunner:
        """One real, non-donating step of the model's live state (back-off, timing)."""
        ...

    def check_trainable(self, model: Any, where: str) -> None:
        """Raises a ``ValueError`` naming the fix when ``model`` cannot be trained by
        ``where`` (``"fit"``, ``"train_step"``), before anything is planned."""
        ...

    def validate_fit_options(self, options: dict) -> None:
        """Raises a ``ValueError`` naming the fix for ``fit`` options this framework cannot
        honour, before anything is planned."""
        ...

    def fit(self, model: Any, prepared: Prepared, plan: Plan, *, settings: FitSettings,
            options: dict) -> Any:
        """Trains ``model`` in place with ``plan``; ``options`` are the framework's own."""
        ...
