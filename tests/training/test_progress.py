"""Flax ``fit``'s progress: a live tqdm bar with loss and steps/s in terminals and notebooks,
one final line per epoch in logs and files."""

import io
import sys
import types

from autoaccum.training._callbacks import ProgressBar, in_notebook


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_one_final_line_per_epoch():
    out = io.StringIO()
    bar = ProgressBar(total=3, epoch=1, epochs=2, stream=out)
    for i in range(3):
        bar.update(i + 1, loss=1.0 / (i + 1))
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epoch 2/2 [")
    assert "3/3  loss 0.3333" in lines[0] and "steps/s" in lines[0]


def test_a_terminal_gets_a_live_bar_with_loss_and_rate():
    out = _Terminal()
    bar = ProgressBar(total=4, epoch=0, epochs=1, stream=out)
    for i in range(4):
        bar.update(i + 1, loss=2.0 - i * 0.5)
    bar.close()
    text = out.getvalue()
    assert "\r" in text and "epoch 1/1" in text and "4/4" in text
    assert "loss=0.5000" in text and "step/s" in text


def test_a_notebook_gets_a_live_bar_on_its_own_output(monkeypatch, capsys):
    shell = types.SimpleNamespace(config={"IPKernelApp": {}})
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert in_notebook()
    bar = ProgressBar(total=2, epoch=0, epochs=1)  # the kernel's stderr: not a terminal
    assert bar.notebook and bar.interactive
    bar.update(1, loss=1.0)
    bar.update(2, loss=0.25)
    bar.close()
    err = capsys.readouterr().err
    assert "loss=0.2500" in err and "2/2" in err


def test_nothing_is_drawn_before_the_first_step():
    out = _Terminal()
    ProgressBar(total=5, epoch=0, epochs=1, stream=out)  # fit with verbose=0 builds one too
    assert out.getvalue() == ""
