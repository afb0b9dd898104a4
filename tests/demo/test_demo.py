"""``make demo`` learns visibly: the lab's dry run says 1 x 8 on a T4, and the real run's loss
on the answers falls by more than half while its answers come to match the questions."""

import io
import re
import subprocess
import sys

import pytest

from autoaccum_demo import lab_summary, load_qa
from autoaccum_demo._cli import main
from autoaccum_demo._finetune import chat_data, demo_questions
from tests._paths import REPO, users_environment

# The demo and the notebook share the lab dry run (tests/demo/conftest.py): one worker runs
# both, so neither waits for the other's compile.
pytestmark = pytest.mark.xdist_group("lab-dry-run")


def test_under_loadgroup_the_demo_tests_are_one_group(request):
    # pytest 9 ignored xdist's group suffix (pyproject.toml pins pytest below 9 for it).
    if getattr(request.config.option, "loadgroup", False):  # an xdist worker of loadgroup
        assert request.node.nodeid.endswith("@lab-dry-run"), request.node.nodeid


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9.]+", text.lower()) if len(w) > 3}


def test_chat_data_puts_the_model_turn_in_the_prompt_so_the_loss_is_on_the_answer():
    data = chat_data(load_qa()[:2])
    assert all(p.endswith("<end_of_turn>\n<start_of_turn>model\n") for p in data["prompts"])
    assert all(r.endswith("<end_of_turn>") and "<start_of_turn>" not in r
               for r in data["responses"])
    assert [r["category"] for r in demo_questions(load_qa(), 3)] == ["memory", "geography",
                                                                    "animals"]


def test_make_demo_runs_the_default_demo_with_the_dry_run(monkeypatch):
    calls = []
    monkeypatch.setattr("autoaccum_demo._cli._prepare_cpu_environment", lambda: None)
    monkeypatch.setattr("autoaccum_demo._demo.run_default_demo",
                        lambda **options: calls.append(options) or {"failed": []})
    assert main([]) == 0 and main(["--epochs", "2", "--no-dry-run"]) == 0
    assert calls == [{"epochs": None, "dry_run": True}, {"epochs": 2, "dry_run": False}]


def test_make_demo_exits_non_zero_when_its_dry_run_failed(monkeypatch, capsys):
    monkeypatch.setattr("autoaccum_demo._cli._prepare_cpu_environment", lambda: None)
    monkeypatch.setattr("autoaccum_demo._demo.run_default_demo",
                        lambda **options: {"failed": ["dry_run"]})
    assert main([]) == 1
    assert "the demo's dry_run failed" in capsys.readouterr().err


@pytest.mark.slow  # the fine-tune (the 4B dry run's compiles: once per session, see conftest)
def test_make_demo_dry_run_says_one_by_eight_and_the_fine_tune_halves_its_loss(
        lab_dry_run_report):
    # What `make demo` runs (see the test above), as users run it: its own process, XLA's
    # default flags (tests/_paths.py), the story on stdout, the plan's live log on stderr.
    proc = subprocess.run([sys.executable, "-m", "autoaccum_demo"], env=users_environment(),
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    out, log = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + log[-3000:]
    assert "before fine-tuning" in out and "On the T4" in out
    assert "autoaccum:   micro_batch=" in log and "autoaccum:   micro_batch=" not in out
    assert "before fine-tuning" not in log
    planned = re.search(r"effective batch 8 = micro_batch (\d+) x (\d+) accumulation steps",
                        out)
    assert planned and planned.groups() == ("2", "4")
    # The plan compiled a micro-batch that does not fit (the budget is below micro-batch 4's).
    assert re.search(r"micro_batch=\d+ +need .* does not fit", log), log[-2000:]
    summary = re.search(r"On the T4: micro-batch 1 needs .* \(fits\); micro-batch 2 needs .* "
                        r"\(does not fit\)\. So 8 = 1 x 8 accumulation steps.*learning rate "
                        r"0\.0004 = 5e-05 x 8/1, linear\.", out)
    assert summary, out
    assert "budget" in out and "1.5 x the compiled need of micro-batch 2" in out
    found = re.search(r"loss on the answers: ([\d.]+) at the first step; per epoch ([\d., ]+):",
                      out)
    first, losses = float(found[1]), [float(v) for v in found[2].split(", ")]
    assert len(losses) == 6 and losses[-1] <= 0.5 * losses[0] and losses[-1] <= 0.25 * first
    exact, asked = map(int, re.search(r"answered word for word: (\d+) of (\d+)", out).groups())
    assert asked == 25 and exact >= 8
    after = out[out.index("after fine-tuning"):]
    answers = re.findall(r"  Q: (.*)\n  A: (.*)\n     \[(.*)\]", after)
    assert len(answers) == 3
    for question, answer, expected in answers:
        shared = _words(answer) & _words(expected)
        assert len(shared) >= 4, (question, answer, expected)


@pytest.mark.slow  # a fine-tune of two steps
def test_the_demo_story_goes_to_the_stream_it_is_given(capsys, monkeypatch):
    from autoaccum_demo._demo import run_default_demo

    # 16 QA pairs, one epoch: two steps of 8 (the routing is what is checked, not learning).
    monkeypatch.setattr("autoaccum_demo._finetune.load_qa", lambda: load_qa()[:16])
    story = io.StringIO()
    run_default_demo(out=story, dry_run=False, epochs=1, verbose=0)
    out = story.getvalue()
    assert "before fine-tuning" in out and "after fine-tuning" in out
    # The whole story goes to the stream it is given, nothing of it to stdout.
    assert "fine-tuning" not in capsys.readouterr().out


def test_lab_summary_reads_the_plan():
    from types import SimpleNamespace as S

    probes = (S(micro_batch=4, need_bytes=3 * 2**30, fits=False, remat="none"),
              S(micro_batch=2, need_bytes=2 * 2**30, fits=True, remat="none"))
    plan = S(probes=probes, budget_bytes=int(2.5 * 2**30), micro_batch=2, accum_steps=4,
             effective_batch=8, remat="none", profile="l4",
             lr_scaling=S(arithmetic=lambda: "8 = 1 x 8/1, linear"))
    assert lab_summary(plan).startswith("On the L4: micro-batch 2 needs 2.00 GiB of the 2.50 GiB "
                                        "budget (fits); micro-batch 4 needs 3.00 GiB (does not "
                                        "fit). So 8 = 2 x 4 accumulation steps")
