"""The callbacks of the training loop: each hook called on every callback, requests to stop."""

from autoaccum.training._callbacks import Callback, CallbackList


def test_a_hook_reaches_every_callback_and_nobody_asked_to_stop():
    calls = []

    class Log(Callback):
        def on_epoch_end(self, epoch, logs):
            calls.append((epoch, logs["loss"]))

    cbs = CallbackList([Log()], model=None, result=None)
    cbs.call("on_epoch_end", 0, {"loss": 1.0})
    assert (calls, cbs.stop_requested()) == ([(0, 1.0)], None)
