"""The one user-loop step: the planned step of ``autoaccum.train_step`` for a loop you write,
on the one step runner, for every framework. An adapter's step (Flax's ``TrainStep``, Keras's
``KerasTrainStep``) adds only how its framework's batches and outputs look.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..devices._mesh import without_context_mesh
from ..devices._oom import is_out_of_memory
from ..planning._plan import Plan
from ._fit_loop import settle
from ._step_runner import StepOutcome, StepRunner

__all__ = ["UserLoopStep"]


class UserLoopStep:
    """One effective batch (or a smaller last one) in, one optimizer step out, on ``runner``;
    after a failed or interrupted call the model holds the state of one whole step.
    """

    def __init__(self, runner: StepRunner, plan: Plan) -> None:
        self._runner, self._plan, self._noted = runner, plan, 0

    @property
    def plan(self) -> Plan:
        """The plan the step runs now (a smaller micro-batch after :meth:`shrink` or an
        elastic recovery, with the reason in its notes)."""
        runner = self._runner
        split = (runner.micro_batch, runner.accum_steps, runner.last_micro_batch)
        plan = self._plan
        if split != (plan.micro_batch, plan.accum_steps, plan.last_micro_batch):
            new = runner.resplits[self._noted:]
            self._noted = len(runner.resplits)
            self._plan = dataclasses.replace(
                plan, micro_batch=split[0], accum_steps=split[1], last_micro_batch=split[2],
                notes=(*plan.notes, *(f"elastic: {event}" for event in new)))
        return self._plan

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self._runner.steps

    @property
    def events(self) -> list[str]:
        """What happened besides plain steps (skipped steps, out-of-memory recoveries)."""
        return list(self._runner.events)

    def shrink(self, error: BaseException) -> Any:
        """After an out-of-memory from this step: the next smaller micro-batch (more
        accumulation, the same effective batch, the same state). Returns ``self``.

        Raises:
          autoaccum.planning.DoesNotFitError: the micro-batch was already 1.
          ValueError: ``error`` is not an out-of-memory (:func:`autoaccum.is_out_of_memory`):
            a smaller micro-batch would not cure it.
        """
        if not is_out_of_memory(error):
            raise ValueError(
                "shrink(error) takes the out-of-memory this step raised (a smaller micro-batch "
                "cures only that); re-raise any other error. Check with "
                "autoaccum.is_out_of_memory(error) first. Received: "
                f"error={type(error).__name__}({str(error)[:200]!r})") from error
        self._runner.shrink(error)
        return self

    def check_size(self, n: int, what: str = "") -> None:
        """Refuses a batch of ``n`` examples that is empty or above the effective batch
        (``what``: how the batch was given, for the message)."""
        effective = self._runner.effective_batch
        if n > effective or n == 0:
            raise ValueError(
                f"A step takes at most one effective batch of {effective} examples (a smaller "
                f"last one is fine); this batch has {n}. Split your data into batches of "
                f"{effective} (or build the step with effective_batch={n}). Received: a batch "
                f"of {n} examples{what}")

    def run(self, examples: Any) -> StepOutcome:
        """One optimizer step on ``examples`` (host arrays, leading axis = its examples).

        Raises:
          autoaccum.NonFiniteError: ``on_nonfinite="stop"`` and the step was not finite (the
            model keeps the state before it; an optimizer that skips such steps itself is
            left to).
          Exception: the step's error (an out-of-memory without ``elastic``: call
            :meth:`shrink` and try again); the model holds the state of one whole step.
        """
        runner = self._runner
        try:
            with without_context_mesh():  # the step's meshes are autoaccum's (see there)
                outcome = runner.run(examples)
        except BaseException as error:
            settle(runner, error, record=False)
            raise
        if (not outcome.finite and not outcome.optimizer_skipped
                and runner.on_nonfinite == "stop"):
            raise runner.nonfinite_error(outcome)
        return outcome
