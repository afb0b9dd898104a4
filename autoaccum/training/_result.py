"""What ``autoaccum.fit`` returns for Flax/optax training."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..planning._plan import Plan


@dataclass
class FitResult:
    """The plan that was used and what training measured, step by step.

    Example:
      >>> FitResult(plan=None, epoch_losses=[1.0], val_losses=[1.5]).history["val_loss"]
      [1.5]
    """

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
    val_losses: list[float] = field(default_factory=list)
    """Mean validation loss after each validated epoch (``validation_data``)."""
    skipped_steps: int = 0
    """Steps whose loss or gradients were not finite, skipped (``on_nonfinite="skip"``)."""
    leftover_examples: int = 0
    """Examples per epoch after the last full effective batch."""
    drop_remainder: bool = False
    """``False``: those examples made a final, smaller step each epoch; ``True``: dropped."""
    dropped_examples: int = 0
    """Examples not trained, over all epochs (``drop_remainder=True``)."""
    stopped: str = ""
    """Why training ended early (a callback), or ``""`` when it ran every epoch."""

    @property
    def history(self) -> dict[str, list]:
        """Keras-like ``{"loss": [...], "gradient_noise_scale": [...]}`` per epoch, with
        ``"val_loss"`` when validation ran."""
        out: dict[str, list] = {"loss": list(self.epoch_losses),
                                "gradient_noise_scale": list(self.epoch_noise_scale)}
        if self.val_losses:
            out["val_loss"] = list(self.val_losses)
        return out
