"""Elastic recovery: after a real out-of-memory mid-training, redo the same step smaller.

The step runner (:class:`~autoaccum.training._step_runner.StepRunner`) runs a step through
:func:`retry_smaller`: after a real out-of-memory it restores the state from before the
failed step, then calls :func:`shrink` for the next split: the largest divisor of the
per-device effective batch below the failed micro-batch, with accumulation raised so the
effective batch is unchanged. The same examples, in the same order, are split again into
more micro-batches, so the redone step computes the same gradient (sums in another order:
equal to float rounding). Step count, learning-rate schedule and data order are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..devices._oom import first_line, is_out_of_memory, no_micro_batch_fits, requested_bytes
from ..planning._search import DoesNotFitError, divisors

__all__ = ["ElasticEvent", "retry_smaller", "shrink"]

T = TypeVar("T")


def retry_smaller(attempt: Callable[[], T], *, elastic: bool,
                  recover: Callable[[BaseException], None]) -> T:
    """``attempt()`` (one optimizer step at the current split) until it does not run out of
    memory: after a real out-of-memory with ``elastic``, ``recover(error)`` puts the state
    from before the step back and shrinks the split (it raises when it cannot: the state was
    consumed, or the micro-batch was already 1); any other error propagates.

    Example:
      >>> splits = [8]
      >>> def attempt():
      ...     if splits[-1] > 2:
      ...         raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
      ...     return splits[-1]
      >>> retry_smaller(attempt, elastic=True, recover=lambda e: splits.append(splits[-1] // 2))
      2
    """
    while True:
        try:
            return attempt()
        except Exception as error:
            if not (elastic and is_out_of_memory(error)):
                raise
            recover(error)


@dataclass(frozen=True)
class ElasticEvent:
    """One out-of-memory survived: the step, the old and new split, and the error.

    Example:
      >>> str(ElasticEvent(7, 8, 2, 4, 4, "RESOURCE_EXHAUSTED: Out of memory", 1 << 20))
      'step 7: out of memory at micro_batch 8 x 2 accumulation (RESOURCE_EXHAUSTED: Out of memory; it asked for 1.00 MiB); redone from the same state and data at micro_batch 4 x 4 (effective batch 16 unchanged)'
    """  # noqa: E501

    step: int
    """1-based optimizer step that was redone."""
    old_micro_batch: int
    old_accum_steps: int
    new_micro_batch: int
    new_accum_steps: int
    error: str
    """First line of the out-of-memory error."""
    requested_bytes: int | None = None
    """The failed allocation's size, where the error names it."""
    data_parallel: int = 1
    """Data-parallel devices: micro-batches are per device."""
    per_device: int | None = None
    """Examples per device in the step (``None``: ``micro_batch x accum_steps``, even)."""

    def __str__(self) -> str:
        from ..devices._units import format_bytes

        asked = (f"; it asked for {format_bytes(self.requested_bytes)}"
                 if self.requested_bytes is not None else "")
        dp = self.data_parallel
        devices = f" x {dp} devices" if dp > 1 else ""
        per = self.per_device or self.old_micro_batch * self.old_accum_steps
        last = per - (self.old_accum_steps - 1) * self.old_micro_batch
        tail = f", the last of {last}" if last != self.old_micro_batch else ""
        return (
            f"step {self.step}: out of memory at micro_batch {self.old_micro_batch}{devices} x "
            f"{self.old_accum_steps} accumulation{tail} ({self.error}{asked}); redone "
            "from the same "
            f"state and data at micro_batch {self.new_micro_batch}{devices} x "
            f"{self.new_accum_steps} (effective batch "
            f"{per * dp} unchanged)"
        )


def shrink(error: BaseException, *, step: int, micro_batch: int,
           accum_steps: int, data_parallel: int = 1,
           per_device: int | None = None) -> ElasticEvent:
    """The next split after ``error`` at ``micro_batch x accum_steps``, as an event: the largest
    divisor of the per-device batch below ``micro_batch`` (``per_device``, when the failed
    split was uneven; default ``micro_batch x accum_steps``).

    Raises:
      DoesNotFitError: ``micro_batch`` was already 1 (raised from ``error``, with advice).

    Example:
      >>> e = shrink(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"), step=3, micro_batch=6,
      ...            accum_steps=2)
      >>> e.new_micro_batch, e.new_accum_steps
      (4, 3)
    """
    given = per_device
    per_device = per_device or micro_batch * accum_steps
    smaller = [d for d in divisors(per_device) if d < micro_batch]
    if not smaller:
        raise DoesNotFitError(
            no_micro_batch_fits(error, accum_steps=accum_steps,
                                advice=f"(Optimizer step {step} was not taken.)")
        ) from error
    new = smaller[-1]
    return ElasticEvent(step, micro_batch, accum_steps, new, per_device // new,
                        first_line(error), requested_bytes(error), data_parallel, given)

