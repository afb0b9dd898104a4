"""Ctrl-C held back: a SIGINT inside ``deferred_interrupts`` is delivered when the block ends,
never inside it; outside the main thread the block is a no-op."""

import os
import signal
import threading

import pytest

from autoaccum.training._step_runner import deferred_interrupts, interrupt_guard


def test_ctrl_c_inside_the_block_is_raised_when_it_ends():
    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        for i in range(1000):  # many bytecodes: the handler would have run here
            done.append(i)
    assert len(done) == 1000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_ctrl_c_the_block_runs_and_the_handler_is_put_back():
    with deferred_interrupts():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_outside_the_main_thread_it_does_nothing():
    seen = []

    def work():
        with deferred_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def _signal_arrives() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):  # backward jumps: Python runs the handler at one of them
        pass


def test_a_guard_holds_ctrl_c_while_holding_and_raises_it_on_release():
    before = signal.getsignal(signal.SIGINT)
    with interrupt_guard() as guard:
        guard.holding = True
        _signal_arrives()
        assert len(guard.held) == 1  # kept, not raised
        with pytest.raises(KeyboardInterrupt):
            guard.release()
        assert not guard.holding and not guard.held
        with pytest.raises(KeyboardInterrupt):  # not holding: raised at once
            _signal_arrives()
    assert signal.getsignal(signal.SIGINT) is before
