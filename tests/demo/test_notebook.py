"""The Colab notebook runs top to bottom offline (embedded tiny model, CPU)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests._paths import REPO

pytestmark = pytest.mark.slow  # subprocesses, keras-hub builds or large compiles

NOTEBOOK = REPO / "notebooks" / "colab_t4_gemma3.ipynb"


def test_colab_notebook_runs_offline_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOACCUM_OFFLINE", "1")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # as on a user's machine
    monkeypatch.delenv("KERAS_BACKEND", raising=False)  # configure() must set it
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "\n".join(
        out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
        for out in cell.get("outputs", []) if out.get("output_type") == "stream"
    )
    assert "offline (embedded tiny model): True" in outputs
    assert "accumulation step(s)" in outputs and "loss per epoch" in outputs
    assert "deviceless compile" in outputs
    assert (tmp_path / "plan.png").exists()
    assert os.environ.get("AUTOACCUM_OFFLINE") == "1"
