"""The Colab notebook is the lab redone on autoaccum's public API, and runs top to bottom offline
(the small shipped Gemma3, CPU)."""

import base64
import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

from tests._paths import REPO

pytestmark = pytest.mark.xdist_group("lab-dry-run")  # see tests/demo/test_demo.py

NOTEBOOK = REPO / "notebooks" / "colab_t4_gemma3.ipynb"


def _sources() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
            if c.cell_type == "code"]


def _index(sources: list[str], text: str) -> int:
    return next(i for i, s in enumerate(sources) if text in s)


def test_notebook_uses_the_public_api_and_keeps_the_labs_order_and_arguments():
    sources = _sources()
    code = "\n".join(sources)
    assert not re.search(r"autoaccum(_demo)?\._", code)  # no private module
    assert '%pip install -q "autoaccum[keras,cuda12,plot]"' in code  # plotting included
    configure, keras_import = _index(sources, "autoaccum.configure("), _index(sources,
                                                                             "import keras")
    dry_run, weights = _index(sources, "plan_preset("), _index(sources, "from_preset(")
    assert configure < keras_import < dry_run < weights  # the dry run before any weight
    model = sources[weights]
    for argument in ('"gemma3_instruct_4b_text"', "enable_lora(rank=4)", "400, 5e-5",
                     "beta_2=0.95", "epsilon=1e-6", "clipnorm=0.5"):
        assert argument in model, argument
    assert "sequence_length=400" in sources[dry_run] and "lora_rank=4" in sources[dry_run]
    fit = sources[_index(sources, "autoaccum.fit(")]
    assert "effective_batch=8" in fit and "plan=plan" in fit and "callbacks=" in fit
    assert _index(sources, "autoaccum.plan(") < _index(sources, "autoaccum.fit(")


@pytest.mark.slow
def test_colab_notebook_runs_offline_top_to_bottom(tmp_path, monkeypatch, lab_dry_run_report):
    # lab_dry_run_report: its plan_preset cell is the lab's dry run, compiled once per session
    monkeypatch.setenv("AUTOACCUM_OFFLINE", "1")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # as on a user's machine
    monkeypatch.delenv("KERAS_BACKEND", raising=False)  # configure() must set it
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # XLA's defaults (tests/_paths.py)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    # Stream chunks are joined as they came: a line may be split across two chunks.
    text = {i: "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
            for i, c in enumerate(cells)}
    html = {i: "\n".join(o.get("data", {}).get("text/html", "") for o in c.outputs
                         if o.output_type == "execute_result") for i, c in enumerate(cells)}
    pngs = [(i, base64.b64decode(o["data"]["image/png"])) for i, c in enumerate(cells)
            for o in c.outputs if "image/png" in o.get("data", {})]
    sources = [c.source for c in cells]
    assert "offline (the small shipped Gemma3 on this machine): True" in text[0]
    dry = html[_index(sources, "plan_preset(")]
    assert "8 = micro_batch 1 x 1 device(s) x 8 accumulation step(s)" in dry
    assert "deviceless compile" in dry and "memory: micro_batch 2 needs" in dry
    planned = html[_index(sources, "autoaccum.plan(")]
    assert "8 = micro_batch 2 x 1 device(s) x 4 accumulation step(s)" in planned
    assert len(pngs) == 2 and all(png[:8] == b"\x89PNG\r\n\x1a\n" for _, png in pngs)
    trained = text[_index(sources, "autoaccum.fit(")]
    assert "[epoch 1]" in trained and "[epoch 6]" in trained
    result = text[_index(sources, "loss per epoch")]
    losses = [float(v) for v in re.search(r"loss per epoch: \[(.*)\]", result)[1].split(",")]
    assert losses[-1] <= 0.5 * losses[0]
    assert "optimizer steps: 186 (= 6 epochs x 31 steps of 8 examples)" in result
    assert os.environ.get("AUTOACCUM_OFFLINE") == "1"
