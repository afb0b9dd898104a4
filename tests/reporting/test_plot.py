"""``plot_plan`` draws a Figure with matplotlib's object API: no pyplot state, no backend change,
units by size, integer micro-batch ticks, failed probes in the legend and the reason on it."""

import sys

import matplotlib
import pytest
from matplotlib.figure import Figure

import autoaccum
from tests._plans import accumulating_plan, whole_batch_plan


def _texts(fig):
    ax = fig.axes[0]
    return ([t.get_text() for t in ax.get_legend().get_texts()],
            [t.get_text() for t in fig.texts], ax.get_title(), ax.get_ylabel())


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_plot_is_a_figure_that_leaves_backend_and_pyplot_alone(tmp_path):
    backend = matplotlib.rcParams._get_backend_or_none()
    pyplot = sys.modules.get("matplotlib.pyplot")
    figures = pyplot.get_fignums() if pyplot else None
    fig = autoaccum.plot_plan(accumulating_plan(), tmp_path / "need.png")
    assert isinstance(fig, Figure)
    assert matplotlib.rcParams._get_backend_or_none() == backend
    if pyplot is not None:
        assert pyplot.get_fignums() == figures
    assert (tmp_path / "need.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"  # what a notebook shows


def test_plot_shows_failed_probes_units_by_size_and_why(tmp_path):
    plan = accumulating_plan()
    fig = autoaccum.plot_plan(plan)
    legend, texts, title, ylabel = _texts(fig)
    assert any("does not fit" in t for t in legend)
    assert any(t.startswith("chosen: micro_batch 2 x 8") for t in legend)
    assert ylabel == "need per step (MiB)"  # a few MiB: not a flat line in GiB
    assert texts == [f"limited by {autoaccum.planning.limiting_factor(plan).detail}"]
    assert texts[0].startswith("limited by memory: micro_batch 4 needs")
    assert "effective batch 16 = 2 x 1 device(s) x 8 accumulation" in title
    fig.canvas.draw()
    ticks = fig.axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_plot_says_when_the_effective_batch_capped_the_choice():
    fig = autoaccum.plot_plan(whole_batch_plan())
    legend, texts, _, _ = _texts(fig)
    assert texts[0].startswith("limited by effective batch: micro_batch 8 is the whole")
    assert not any("does not fit" in t for t in legend)
