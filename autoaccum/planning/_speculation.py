"""The next remat policy (or sharding strategy) planned while a full-depth compile decides
the current one.

Where no micro-batch of a policy fits by the depth line but XLA's rematerialization pass could
bring the smallest under the budget, one full-depth compile decides (the lab's Gemma3-4B LoRA
on a T4 without remat: 13.44 GiB against 13.37, 17 s of compile). That compile releases the
GIL, so while it runs the remat search plans the next policy on this thread: its reduced-depth
compiles and its full-depth lowering. Before any full-depth compile of its own it waits for
the decision; if the current policy fits after all, the next one's planning stops there
(:class:`Superseded`) and only its reduced-depth compiles were spent. Otherwise its outcome is
the one the search would have reached next, a full compile sooner.

Sharding strategies (``--devices 2``) use the same economy: while the replicated step's
micro-batch 1 is decided, the next strategy that its miss would leave to plan (for a LoRA
model, fsdp: zero1 and zero2 split off too little to help) is planned beside it; it stops if
the decision fits, or if its figure leaves a strategy in between to plan first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Decision", "PlannedBeside", "Superseded", "deciding_beside", "next_policy",
           "pending_decision", "planning_next"]


class Superseded(BaseException):
    """The policy being planned beside a decision is not needed: the earlier one fits.

    A ``BaseException``, so that no ``except Exception`` on the way (a model that cannot be
    built shallow, a compile that fails) takes it for a failure of this policy.
    """


class Decision:
    """A full-depth compile under way (``future``), deciding whether the step whose depth
    line (an upper bound) was ``line`` fits ``budget_bytes``."""

    def __init__(self, future: concurrent.futures.Future, *, budget_bytes: int,
                 line: Any = None) -> None:
        self.future, self.budget_bytes, self.line = future, budget_bytes, line
        self.earlier: Decision | None = None
        """The decision the policy that made this one waited on, if any (set by
        :func:`deciding_beside`: a third policy waits on both)."""
        self.stops: list[Callable[[Any], bool]] = []
        """More reasons, given the decided estimate, why what is planned beside is not
        needed (a strategy in between that the figure leaves to plan first)."""

    def superseded(self, *, wait: bool) -> bool:
        """Whether what is planned beside is not needed: an earlier step fits, or a stop
        says so (``wait``: block until the compiles say; else ``False`` while they run). A
        compile that failed decides nothing here: its caller raises it."""
        if self.earlier is not None and self.earlier.superseded(wait=wait):
            return True
        if not wait and not self.future.done():
            return False
        try:
            one = self.future.result()
        except Exception:
            return False
        return one.need_bytes <= self.budget_bytes or any(stop(one) for stop in self.stops)


class PlannedBeside:
    """Outcomes planned beside a decision, by name (a remat policy, a sharding strategy),
    each taken once in its turn.

    Example:
      >>> ahead = PlannedBeside()
      >>> ahead.plan("nothing", lambda: "its plan")
      >>> ahead.take("nothing", lambda: "planned again"), ahead.take("nothing", lambda: "again")
      ('its plan', 'again')
    """

    def __init__(self) -> None:
        self._kept: dict[str, tuple[Any, Exception | None]] = {}

    def plan(self, name: str, work: Callable[[], Any]) -> None:
        """Runs ``work()`` now and keeps its result or error (:class:`Superseded`, not an
        ``Exception``, passes: nothing is kept)."""
        try:
            self._kept[name] = (work(), None)
        except Exception as error:  # raised in its turn
            self._kept[name] = (None, error)

    def take(self, name: str, work: Callable[[], Any]) -> Any:
        """What :meth:`plan` kept for ``name`` (its error raised), else ``work()``."""
        if name not in self._kept:
            return work()
        value, error = self._kept.pop(name)
        if error is not None:
            raise error
        return value


_NEXT: contextvars.ContextVar[Callable[[Decision], None] | None] = contextvars.ContextVar(
    "autoaccum_next_policy", default=None)
_PENDING: contextvars.ContextVar[Decision | None] = contextvars.ContextVar(
    "autoaccum_pending_decision", default=None)


@contextlib.contextmanager
def next_policy(plan_next: Callable[[Decision], None] | None) -> Iterator[None]:
    """Within the block, a decision made by a full-depth compile (:func:`deciding_beside`)
    runs ``plan_next(decision)`` meanwhile (the remat search's next policy or the next
    sharding strategy, its outcome kept by the caller, who may add to ``decision.stops``);
    ``None``: nothing runs beside it."""
    token = _NEXT.set(plan_next)
    try:
        yield
    finally:
        _NEXT.reset(token)


def deciding_beside(decision: Decision) -> None:
    """Plans the next policy (if :func:`next_policy` set one) while ``decision`` compiles; its
    full-depth compiles wait for the decision, and stop it where the earlier policy fits."""
    plan_next = _NEXT.get()
    if plan_next is None:
        return
    decision.earlier = _PENDING.get()
    outer = _NEXT.set(None)  # the next policy sets its own next
    pending = _PENDING.set(decision)
    try:
        plan_next(decision)
    except Superseded:
        pass
    finally:
        _PENDING.reset(pending)
        _NEXT.reset(outer)


def planning_next() -> bool:
    """Whether a decision made now would have the next policy planned beside it.

    Example:
      >>> planning_next()
      False
    """
    return _NEXT.get() is not None


def pending_decision() -> Decision | None:
    """The decision the policy being planned waits on before a full-depth compile, if any.

    Example:
      >>> pending_decision() is None
      True
    """
    return _PENDING.get()
