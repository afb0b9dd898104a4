"""What ``autoaccum.fit`` returns for Flax/optax training."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..planning._plan import Plan


@dataclass
class FitResult:
    """The plan that was used and what training measured, step by step."""

    plan: Plan
    losses: list[float] = field(default_factory=list)
    """Mean loss of each optimizer step (over the whole effective batch)."""
    epoch_losses: list[float] = field(default_factory=list)
    """Mean of the step losses of each epoch."""
    steps: int = 0
    """Optimizer steps taken."""
    seconds: float = 0.0
    """Wall time of training, planning excluded."""
    events: list[str] = field(default_factory=list)
    """Notable events (restores after failures, elastic out-of-memory recoveries, ...)."""
    micro_batch: int | None = None
    """The micro-batch training ended with (below the plan's after an elastic recovery)."""
    accum_steps: int | None = None
    """The accumulation steps training ended with (``micro_batch * accum_steps`` per device
    is always the plan's)."""

    noise_scale: list[float | None] = field(default_factory=list)
    """Estimated critical batch B_simple (in valid items) after each step (None: not yet)."""
    epoch_noise_scale: list[float | None] = field(default_factory=list)
    noise_advice: str = ""
    """Whether the effective batch is far above or below the estimated critical batch."""

    @property
    def history(self) -> dict[str, list]:
        """Keras-like ``{"loss": [...], "gradient_noise_scale": [...]}``, per epoch."""
        return {"loss": list(self.epoch_losses),
                "gradient_noise_scale": list(self.epoch_noise_scale)}
