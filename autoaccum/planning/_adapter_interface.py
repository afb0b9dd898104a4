"""The one interface between autoaccum's core and a framework: what an adapter implements.

The planner, back-off and ``fit`` talk only to an :class:`Adapter`; only the public entry points
pick one for their model (:func:`autoaccum.adapters.adapter_for`). Imports point one way:
adapters -> training / planning -> devices.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from ._lr_scaling import LearningRateScaling
from ._train_program import TrainProgram

if TYPE_CHECKING:
    from ._backoff import RealStepRunner
    from ._plan import Plan
    from ._plan_options import ProgramOptions

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
    model keeps the last finite state) or ``"skip"`` (state unchanged, counted, go on)."""
    batch_stats: str = "effective"
    """BatchNorm running averages: ``"effective"`` (one update per optimizer step from the
    whole effective batch's moments) or ``"micro"`` (one per micro-batch)."""
    drop_remainder: bool = False
    """``False``: the examples after the last full effective batch of an epoch make a final,
    smaller step (normalised by its own count); ``True``: they are dropped. Either way the
    result says how many."""
    uneven: bool = True
    """Whether steps the adapter splits itself (a leftover step, validation batches) may end
    with a smaller micro-batch; ``False``: divisors only."""


class Adapter(abc.ABC):
    """What a framework adapter implements: every method the core calls, abstract where a new
    framework must write it, else with the default for a framework without that feature. The
    core never asks which adapter it holds.

    Example:
      >>> from autoaccum.adapters import adapter_for
      >>> from flax import nnx
      >>> adapter = adapter_for(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
      >>> isinstance(adapter, Adapter), adapter.name
      (True, 'flax')
    """

    name: str
    """How reports and errors name the framework (``"flax"``, ``"keras"``)."""
    remat_policies: tuple[str, ...]
    """Policies ``remat="auto"`` tries, in order of increasing recompute."""
    own_remat: str = "jax.checkpoint"
    """How a user checkpoints layers in this framework themselves, for messages."""
    trains_leftovers: bool = False
    """The examples after the last full effective batch make a final, smaller step."""
    uneven_batches: bool = False
    """The adapter's steps take :class:`~autoaccum.planning.UnevenBatches`, so plans may end with
    a smaller micro-batch."""

    # -- what every framework writes -------------------------------------------------------

    @abc.abstractmethod
    def recognizes(self, model: Any) -> bool:
        """Whether ``model`` belongs to this framework."""

    @abc.abstractmethod
    def prepare(self, model: Any, data: Any, *, effective_batch: int,
                options: ProgramOptions, remat: str, remat_layers: Any) -> Prepared:
        """The model's program with ``remat`` (see :class:`Prepared`)."""

    @abc.abstractmethod
    def remat_context(self, model: Any, policy: str,
                      layers: Any = None) -> AbstractContextManager[int]:
        """Within the context the model's blocks run rematerialized with ``policy``."""

    @abc.abstractmethod
    def has_remat_layers(self, model: Any, layers: Any = None) -> bool:
        """Whether per-layer rematerialization has blocks to wrap in ``model``."""

    @abc.abstractmethod
    def step_runner(self, model: Any, prepared: Prepared) -> RealStepRunner:
        """One real, non-donating step of the model's live state (back-off, timing)."""

    @abc.abstractmethod
    def validate_fit_options(self, options: dict) -> None:
        """Raises a ``ValueError`` naming the fix for ``fit`` options (the framework's own,
        ``model.fit``-style) it cannot honour, before planning."""

    @abc.abstractmethod
    def fit(self, model: Any, prepared: Prepared, plan: Plan, *, settings: FitSettings,
            options: dict) -> Any:
        """Trains ``model`` in place with ``plan``; ``options`` are the framework's own."""

    @abc.abstractmethod
    def train_step(self, model: Any, prepared: Prepared, plan: Plan, *, remat_layers: Any,
                   uneven: bool, on_nonfinite: str, batch_stats: str, backup: str,
                   elastic: bool, log: TextIO | None) -> Any:
        """The planned step for a loop the user writes (``autoaccum.train_step``): called with
        one effective batch, it trains one optimizer step in place."""

    # -- what a framework may change --------------------------------------------------------

    def auto_mesh(self) -> Any:
        """The mesh ``data_parallel="auto"`` means for this framework: every device (``None``
        on one)."""
        import jax

        from ..devices._mesh import data_parallel_mesh

        return data_parallel_mesh() if len(jax.devices()) > 1 else None

    def own_mesh(self, model: Any, mesh: Any) -> Any:
        """The data-parallel mesh ``model``'s own sharding asks for instead of ``mesh`` (or
        ``None`` for a layout the program keeps itself); default: ``mesh``."""
        return mesh

    def with_targets(self, data: Any, y: Any, sample_weight: Any) -> Any:
        """``data`` with ``y`` and ``sample_weight`` given apart, as ``model.fit(x, y,
        sample_weight=...)`` takes them; default: refused (the data is one argument)."""
        from ._option_checks import received

        name = "y" if y is not None else "sample_weight"
        raise ValueError(
            f"A {self.name.capitalize()} model takes its data as one argument, the batches "
            "the loss_fn reads: pass `(x, y)` (or a dict such as `{'x': x, 'y': y, 'weight': "
            "w}`) as `data`, e.g. `autoaccum.fit(model, (x, y), effective_batch=...)`; "
            "separate `y` and `sample_weight` arguments are for Keras models, as in "
            f"`model.fit(x, y)`. Received: "
            f"{received(name, y if y is not None else sample_weight)}")

    def check_trainable(self, model: Any, where: str) -> None:
        """Raises a ``ValueError`` naming the fix when ``model`` cannot be trained by
        ``where`` (``"fit"``, ``"train_step"``), before anything is planned; default: any
        model can."""
        del model, where

    def advice_changes(self, model: Any, options: ProgramOptions) -> list[dict[str, Any]]:
        """The framework's own changes the advisor plans (LoRA, optimizers, dtypes); default:
        none."""
        return []

    def apply_change(self, model: Any, options: ProgramOptions,
                     change: dict[str, Any]) -> tuple[Any, ProgramOptions]:
        """The model to plan and the options with an advice row's ``change`` applied."""
        raise ValueError(f"The {self.name} adapter cannot apply {sorted(change)}. "
                         f"Received: change={change!r}")

    def change_hint(self, key: str, value: Any) -> str | None:
        """How a user applies an advice row's ``key=value`` (``None``: not this framework's)."""
        return None
