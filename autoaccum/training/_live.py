"""The train state a fit loop donates to each step, kept so an interrupt never loses the model.

A jitted step with a donated state deletes its input buffers when it runs; while it runs the
model's own arrays (the previous step's) are gone. :class:`LiveState` keeps, at every point
of the loop, enough to put the model back on live arrays of ONE optimizer step:

* ``state``: the newest state (the last step's output, as soon as the step returns);
* ``steps``: how many optimizer steps ``state`` has taken once it is committed, and
  ``pending``, the metrics of a step whose output is not committed yet;
* the :class:`~autoaccum.training._snapshot.HostSnapshot` of the last committed state.

After any exception (a ``KeyboardInterrupt`` included, wherever it lands: inside the step,
between the step and the model update, inside a callback or validation) :meth:`settle`
writes into the model the newest intact state: the committed state if it is alive, else the
host copy (the state before the failed step), else the uncommitted output if it is alive;
with none of these (``backup="none"`` and a consumed state) it says so and how to recover.

Ctrl-C is held back (:func:`~autoaccum.training._interrupts.deferred_interrupts`) while a step
is dispatched and its output taken, and while a state is written into the model, so neither
ever stops halfway: the model holds one step's state, never a mix of two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._interrupts import deferred_interrupts
from ._snapshot import HostSnapshot, is_consumed

__all__ = ["LiveState", "StateLostError"]

PyTree = Any


class StateLostError(RuntimeError):
    """The donated state was consumed by a failed step and no host copy was kept."""


class LiveState:
    """The donated train state of a fit loop, its host copy, and how the model receives it.

    Args:
      state: the initial train state (step ``steps``).
      snapshot: the host-copy policy; a copy of ``state`` is taken now.
      apply: writes a state into the model (e.g. ``nnx.update``); must be idempotent.
      steps: optimizer steps ``state`` has already taken.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> held = {}
      >>> live = LiveState({"w": jnp.zeros(2)}, HostSnapshot("host"), held.update)
      >>> step = jax.jit(lambda s: ({"w": s["w"] + 1}, jnp.float32(0.5)), donate_argnums=0)
      >>> metrics = live.run(step)
      >>> live.commit(1); live.steps, held["w"].tolist()
      (1, [1.0, 1.0])
    """

    def __init__(self, state: PyTree, snapshot: HostSnapshot, apply: Callable[[PyTree], None],
                 *, steps: int = 0) -> None:
        self.state = state
        self.snapshot = snapshot
        self.apply = apply
        self.steps = steps
        self.pending: Any = None
        snapshot.take(state, step=steps)

    def run(self, executable: Callable[..., tuple[PyTree, Any]], *args: Any) -> Any:
        """``executable(state, *args) -> (new_state, metrics)``; ``new_state`` is held (not
        yet committed) as soon as the call returns. Returns ``metrics``."""
        self.pending = True
        with deferred_interrupts():
            new_state, metrics = executable(self.state, *args)
            self.state, self.pending = new_state, metrics
        return metrics

    def commit(self, steps: int) -> None:
        """The held state is the state after ``steps`` optimizer steps: copy it to the host
        and write it into the model."""
        self.steps, self.pending = steps, None
        self.snapshot.take(self.state, step=steps)
        self._write()

    def recover(self) -> PyTree:
        """After a failed step: the state before it, live, written into the model.

        Raises:
          StateLostError: the step consumed the state and no host copy is held.
        """
        if self.snapshot.available:
            self.state = self.snapshot.restore()  # exactly the state before the failed step
            self.steps = self.snapshot.step if self.snapshot.step is not None else self.steps
        elif is_consumed(self.state):
            raise StateLostError(
                f"step {self.steps + 1} had consumed (donated) the training state and no host "
                "copy was kept (backup='none', or the state is above 4 GiB with "
                "backup='auto'); reload the weights from a checkpoint, or pass backup='host'."
            )
        self.pending = None
        self._write()
        return self.state

    def settle(self, ok: Callable[[Any], bool] | None = None) -> int:
        """After any exception: the model holds live arrays of one optimizer step; returns how
        many steps that state has taken.

        ``ok(metrics)`` says whether an uncommitted step's output may be kept (its metrics
        were read fine and the step was applied); by default it is not, and the host copy
        (or, without one, the output if alive) is used.
        """
        if self.pending is None and not is_consumed(self.state):
            self._write()  # redo: an interrupted update may have left it half done
            return self.steps
        metrics = self.pending
        if self.snapshot.available:
            self.recover()
            return self.steps
        if is_consumed(self.state):
            raise StateLostError(
                f"step {self.steps + 1} had consumed (donated) the training state and no host "
                "copy was kept (backup='none', or the state is above 4 GiB with "
                "backup='auto'); reload the weights from a checkpoint, or pass backup='host'."
            )
        if metrics is not True and metrics is not None and ok is not None and ok(metrics):
            self.steps += 1
        self.pending = None
        self._write()
        return self.steps

    def _write(self) -> None:
        """Writes the held state into the model, with Ctrl-C held back until it is whole."""
        with deferred_interrupts():
            self.apply(self.state)
