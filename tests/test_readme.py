"""The README's runnable examples run as written (blocks marked ``<!-- readme-test: NAME -->``)."""

from __future__ import annotations

import re

import pytest

from tests._paths import REPO

BLOCK = re.compile(r"<!-- readme-test: (\S+) -->\s*```python\n(.*?)```", re.S)


def _blocks() -> dict[str, str]:
    return dict(BLOCK.findall((REPO / "README.md").read_text()))


def test_the_readme_marks_its_runnable_examples():
    assert {"train_step", "keras_train_step"} <= set(_blocks())


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("name", sorted(_blocks()))
def test_a_readme_example_runs_as_written(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # examples may write files (checkpoints)
    exec(compile(_blocks()[name], f"README.md:{name}", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    if name == "train_step":
        lines = printed.strip().splitlines()
        assert len(lines) == 4 and (tmp_path / "checkpoint.pkl").exists()
        losses = [float(line.split()[1]) for line in lines[1:]]
        assert losses[-1] < losses[0]  # it trains
    if name == "keras_train_step":
        lines = printed.strip().splitlines()
        assert len(lines) == 4 and (tmp_path / "regressor.keras").exists()
        losses = [float(line.split()[1]) for line in lines[1:]]
        assert losses[-1] < losses[0]  # it trains
