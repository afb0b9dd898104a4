"""The ``autoaccum`` command line: plan (JSON schema, plot), devices, presets, help, and its
errors (one clear line, or ``{"error": ...}`` under ``--json``, and a non-zero exit)."""

import argparse
import json
import re
import sys

import pytest

import autoaccum
from autoaccum.cli._builder import CliError, flag_values, load_model_function, with_flag_spellings
from autoaccum.cli._main import build_parser, main

TINY = ["plan", "--model", "autoaccum_demo:tiny_lm_plan_inputs", "--effective-batch", "8"]
SMALL = ["plan", "--model", "tests._plans:builder", "--effective-batch", "16"]


@pytest.mark.slow
def test_plan_json_has_the_documented_schema(capsys):
    assert main([*TINY, "--budget", "64MiB", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key, kind in [("schema_version", int), ("device", str), ("profile", str),
                      ("deviceless", bool), ("budget_bytes", int), ("micro_batch", int),
                      ("accum_steps", int), ("effective_batch", int), ("learning_rate", float),
                      ("need_bytes", int), ("probes", list), ("lr_arithmetic", str),
                      ("limited_by", str)]:
        assert isinstance(out[key], kind), key
    assert out["micro_batch"] * out["accum_steps"] * out["data_parallel"] == 8
    assert out["budget_bytes"] == 64 * 2**20 and out["profile"] == "cpu"
    for probe in out["probes"]:
        assert {"micro_batch", "need_bytes", "fits"} <= set(probe)
        assert set(probe["memory"]) >= {"frozen_weights", "trainable_weights", "optimizer_state",
                                        "gradient_accumulator", "batch", "activations_and_temp"}


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_plan_table_itemizes_each_probe_and_plots(tmp_path, capsys):
    png = tmp_path / "need.png"
    assert main([*SMALL, "--budget", "64MiB", "--lr-rule", "sqrt", "--base-lr", "1e-4",
                 "--base-batch", "1", "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "compiling micro_batch=2" in captured.err  # live progress
    for column in ("frozen", "trainable", "optimizer", "grad acc", "batch", "act+temp",
                   "total", "budget", "fits", "limited by"):
        assert column in captured.out
    assert "sqrt(16/1), sqrt" in captured.out
    assert "autoaccum: learning rate 0.0001 -> 0.0004 (sqrt rule, rule given;" in captured.err
    assert captured.out.index("autoaccum plan") < captured.out.index("plot written to")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_failing_plot_loses_no_plan_and_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.ticker", None)
    assert main([*SMALL, "--budget", "64MiB", "--quiet", "--plot", str(tmp_path / "p.png")]) == 1
    captured = capsys.readouterr()
    assert "effective batch   16 = micro_batch" in captured.out  # the plan came first
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autoaccum: error: plot_plan (autoaccum plan "
                                               "--plot) needs autoaccum's `plot` extra")
    assert "matplotlib is not installed" in err[0] and "pip install 'autoaccum[plot]'" in err[0]
    assert main([*SMALL, "--budget", "64MiB", "--quiet", "--json",
                 "--plot", str(tmp_path / "p.png")]) == 1
    out = json.loads(capsys.readouterr().out)  # one JSON document: the plan and the plot error
    assert out["micro_batch"] * out["accum_steps"] == 16
    assert "autoaccum[plot]" in out["plot"]["error"]


@pytest.mark.slow
def test_plan_for_a_named_gpu_is_deviceless_and_says_so(capsys):
    assert main([*TINY, "--device", "t4", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "deviceless" in out["device"] and out["budget_source"] == "profile"
    assert out["deviceless"] is True and out["profile"] == "t4"


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_unknown_device_lists_known_ones(capsys):
    assert main([*TINY, "--device", "k80", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "k80" in err and "t4" in err and "h100" in err


def test_errors_under_json_are_one_json_object_on_stdout(capsys):
    assert main([*TINY, "--device", "k80", "--quiet", "--json"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out) == {"error", "exit_code"} and "k80" in out["error"] and out["exit_code"] == 2
    assert main(["plan", "--effective-batch", "x", "--json"]) == 2  # a usage error too
    assert "expected a whole number" in json.loads(capsys.readouterr().out)["error"]


def test_unknown_architecture_suggests_near_names(capsys):
    assert main(["plan", "--preset", "gemma3-4", "--effective-batch", "8", "--quiet"]) == 2
    assert "gemma3_4b" in capsys.readouterr().err


def test_missing_keras_extra_is_one_line_naming_the_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)
    assert main(["plan", "--preset", "gemma3_1b", "--effective-batch", "8", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keras-hub presets (autoaccum plan --preset)" in err[0]
    assert "keras-hub is not installed" in err[0] and "pip install 'autoaccum[keras]'" in err[0]


@pytest.mark.parametrize("builder, expected", [
    ("builder_needing_an_argument", "calling builder_needing_an_argument() raised TypeError"),
    ("builder_with_unknown_option", "returned options autoaccum.plan does not take: batch_sise"),
    ("no_such_builder", "has no attribute 'no_such_builder'"),
])
def test_model_builder_mistakes_are_one_clear_line(builder, expected, capsys):
    assert main(["plan", "--model", f"tests._plans:{builder}", "--effective-batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def test_a_model_function_its_module_lacks_is_a_cli_error_naming_both():
    message = ("--model 'os.path:no_such_builder': module 'os.path' has no attribute "
               "'no_such_builder'. Its functions: ")
    with pytest.raises(CliError, match=f"^{re.escape(message)}.*join") as raised:
        load_model_function("os.path:no_such_builder")
    assert raised.type is CliError
    with pytest.raises(CliError, match=r"did you mean tests\._plans:builder_needing_an_argument\?"):
        load_model_function("tests._plans:builder_needing_an_argumnt")


def test_a_negative_size_after_its_flag_gets_the_options_own_message(capsys):
    # argparse alone would say "expected one argument" for "--budget -5MiB".
    assert main([*TINY, "--budget", "-5MiB", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Received: budget='-5MiB'" in err and "expected one argument" not in err


def test_budget_larger_than_device_is_refused(capsys):
    assert main([*TINY, "--device", "t4", "--budget", "100GiB", "--quiet"]) == 2
    assert "larger than the memory" in capsys.readouterr().err


def test_an_error_naming_python_keywords_gives_their_flags(capsys):
    assert main([*SMALL, "--device", "colab-tpu", "--memory-fraction", "0.9", "--quiet"]) == 2
    assert ("(on the command line: budget is --budget, device is --device, memory_fraction is "
            "--memory-fraction)") in capsys.readouterr().err


def test_keywords_named_in_an_api_message_are_given_their_flags_and_others_left_alone():
    assert with_flag_spellings(
        "needs base_batch too. Received: rule='linear', base_batch=None") == (
        "needs base_batch too. Received: rule='linear', base_batch=None (on the command line: "
        "base_batch is --base-batch, rule is --lr-rule)")
    assert with_flag_spellings("no keyword here") == "no keyword here"


def test_model_and_preset_are_exclusive(capsys):
    assert main(["plan", "--effective-batch", "8"]) == 2
    assert "exactly one of --model" in capsys.readouterr().err


def test_demo_refuses_zero_epochs(capsys):
    from autoaccum_demo._cli import main as demo_main

    assert demo_main(["--epochs", "0"]) == 2
    assert "--epochs: must be at least 1, got 0" in capsys.readouterr().err


def test_the_library_command_has_no_demo_subcommand(capsys):
    assert main(["demo"]) == 2  # the demo is its own command: autoaccum-demo
    assert "invalid choice: 'demo'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"autoaccum {autoaccum.__version__}"


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help_text():
    missing = [f"{p.prog} {a.option_strings or a.dest}" for p in _parsers(build_parser())
               for a in p._actions
               if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert missing == []


def test_presets_are_listed(capsys):
    assert main(["plan", "--list-presets"]) == 0
    out = capsys.readouterr().out
    for name in ("gemma3_4b", "llama3.2_1b", "mistral_7b"):
        assert name in out
    assert "gemma3_instruct_4b_text" in out
    assert main(["plan", "--list-presets", "--json"]) == 0  # one JSON array, as --json says
    listed = {row["preset"]: row for row in json.loads(capsys.readouterr().out)}
    assert listed["gemma3_4b"]["keras_hub_preset"] == "gemma3_instruct_4b_text"
    assert listed["gemma3_4b"]["layers"] == 34 and listed["gemma3_4b"]["parameters"] > 3e9


def test_devices_table_shows_memory_and_pool_at_the_default_fraction(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "JAX pool" in out and "fraction" in out and "detected here" in out
    t4 = next(line for line in out.splitlines() if line.split()[:1] == ["t4"])
    assert "15.0 GiB" in t4 and "0.90" in t4 and "13.3 GiB" in t4


def test_devices_json_lists_profiles_pools_and_detection(capsys):
    assert main(["devices", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {p["key"] for p in out["profiles"]}
    assert {"t4", "l4", "p100", "v100-16gb", "v100-32gb", "a10g", "a100-40gb", "a100-80gb",
            "h100-80gb", "h200", "rtx3090", "rtx4090", "cpu"} <= keys
    t4 = next(p for p in out["profiles"] if p["key"] == "t4")
    assert t4["pool_bytes"] == int(15102 * 2**20 * 0.9) and t4["memory_fraction"] == 0.9
    assert out["detected"]["source"] in ("nvml", "jax", "cpu")
    # GPUs older than CUDA 13's ptxas targets are compiled with the CUDA 12 extra.
    extras = {p["key"]: p["extra"] for p in out["profiles"]}
    assert extras["v100-16gb"] == extras["p100"] == "dryrun-cuda12" and extras["t4"] == "dryrun"


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_without_base_batch_the_rate_is_kept_and_lr_rule_alone_is_refused(capsys):
    assert main([*SMALL, "--budget", "64MiB", "--base-lr", "1e-4"]) == 0
    captured = capsys.readouterr()
    assert "none (base_batch not given)" in captured.out
    assert "autoaccum: learning rate" not in captured.err
    assert main([*SMALL, "--budget", "64MiB", "--base-lr", "1e-4", "--lr-rule", "linear"]) != 0
    err = capsys.readouterr().err
    assert "needs base_batch too" in err
    assert "(on the command line: base_batch is --base-batch, rule is --lr-rule)" in err


@pytest.mark.parametrize("json_mode", [False, True])
def test_a_builder_that_raises_is_one_paragraph_naming_it_and_where(json_mode, capsys):
    argv = ["plan", "--model", "tests._plans:builder_that_raises", "--effective-batch", "8"]
    assert main([*argv, "--json"] if json_mode else argv) == 1
    captured = capsys.readouterr()
    if json_mode:
        out = json.loads(captured.out)  # one JSON document, nothing else on stdout
        assert set(out) == {"error", "exit_code"} and out["exit_code"] == 1
        message = out["error"]
        assert "Traceback" not in captured.err
    else:
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in captured.err
        message = lines[0]
    assert "the builder builder_that_raises() raised KeyError at " in message
    assert "tests/_plans.py:" in message and "'depth'" in message
    assert "python -c 'import tests._plans; tests._plans.builder_that_raises()'" in message


def test_a_builder_whose_import_fails_names_the_package(capsys):
    assert main(["plan", "--model", "tests._plans:builder_that_cannot_import",
                 "--effective-batch", "8"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "autoaccum_no_such_package" in err[0]


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_flags_win_over_the_builders_options_and_say_so(capsys):
    argv = ["plan", "--model", "tests._plans:builder_with_flag_options", "--json", "--quiet"]
    assert main(argv) == 0  # the builder's effective_batch, budget and remat: no flag given
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["effective_batch"] == 8 and out["budget_bytes"] == 64 * 2**20
    assert out["remat"] == "none" and "wins over" not in captured.err
    assert main([*argv, "--budget", "32MiB", "--effective-batch", "16"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["effective_batch"] == 16 and out["budget_bytes"] == 32 * 2**20
    notes = [line for line in captured.err.splitlines() if "wins over" in line]
    assert notes == [
        "autoaccum: --effective-batch 16 given on the command line wins over effective_batch=8 "
        "from the --model builder",
        "autoaccum: --budget '32MiB' given on the command line wins over budget='64MiB' from "
        "the --model builder",
    ]


def test_effective_batch_is_required_from_the_flag_or_the_builder(capsys):
    assert main(["plan", "--model", "tests._plans:builder", "--quiet"]) == 2
    assert "--effective-batch is required" in capsys.readouterr().err


def test_a_model_over_the_budget_from_shapes_is_a_json_no_with_the_breakdown(capsys):
    assert main([*TINY, "--budget", "4KiB", "--json", "--quiet"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["probes"] == []
    assert out["resident"]["trainable_weights_bytes"] > 0
    assert out["resident"]["state_bytes"] > out["budget_bytes"] == 4096
    assert out["smallest_profile"] == "t4" and "nothing compiled" in out["error"]


@pytest.mark.slow  # the advisor plans a dozen rows, one of them for a deviceless T4
def test_advise_prints_rows_that_fit_as_json(capsys):
    assert main([*TINY, "--budget", "200KiB", "--json", "--quiet", "--advise"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["alternatives"]
    for row in out["alternatives"]:
        assert row["need_bytes"] <= row["budget_bytes"]
        assert set(row) >= {"change", "micro_batch", "accum_steps", "relative_flops"}


@pytest.mark.slow  # the advisor plans a dozen rows, one of them for a deviceless T4
def test_advise_prints_the_verdict_without_pointing_to_advise_then_the_table(capsys):
    assert main([*TINY, "--budget", "200KiB", "--quiet", "--advise"]) == 2
    out = capsys.readouterr().out
    assert "What would fit" in out and "how to apply a row:" in out
    assert "--advise" not in out.split("What would fit")[0]  # it is what runs


@pytest.mark.slow  # deviceless compiles for two T4s
def test_strategy_flag_is_passed_to_the_plan(capsys):
    argv = ["plan", "--model", "tests._plans:keras_builder", "--device", "t4", "--devices",
            "2", "--json", "--quiet", "--no-cache"]
    plans = {}
    for strategy in ("replicated", "fsdp"):
        assert main([*argv, "--strategy", strategy]) == 0
        plans[strategy] = json.loads(capsys.readouterr().out)
    fsdp, replicated = plans["fsdp"], plans["replicated"]
    assert (fsdp["strategy"], fsdp["devices"], fsdp["mesh_shape"]) == ("fsdp", 2, [2])
    assert replicated["strategy"] == "replicated"
    assert {p["strategy"] for p in fsdp["probes"]} == {"fsdp"}
    # Per GPU: the fsdp step holds half of the (divisible) weights.
    half = [p["memory"]["trainable_weights"] for p in fsdp["probes"]]
    whole = [p["memory"]["trainable_weights"] for p in replicated["probes"]]
    assert max(half) < 0.6 * min(whole)


def test_an_unknown_strategy_flag_names_the_choices(capsys):
    assert main([*TINY, "--strategy", "zero3"]) == 2
    err = capsys.readouterr().err
    assert "--strategy: invalid choice: 'zero3'" in err and "'fsdp'" in err


def test_preset_advise_without_remat_flag_plans_every_row_with_auto(monkeypatch):
    # `autoaccum plan --preset ... --advise` without --remat gave every row of the table
    # "could not plan: Unknown remat policy ... Received: remat=None".
    from autoaccum.adapters.keras import presets
    from autoaccum.cli import _main as _advise_command

    given = {}

    def advise_preset(name, **options):
        given.update(options, name=name)
        raise SystemExit(0)

    monkeypatch.setattr(_advise_command, "without_tensorflow", lambda: None)
    monkeypatch.setattr(presets, "advise_preset", advise_preset)
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "gemma3_4b", "--seq-len", "400", "--device", "t4",
              "--effective-batch", "8", "--advise", "--quiet"])
    assert given["name"] == "gemma3_4b" and given["search"].remat == "auto"


def test_a_builder_returning_an_option_of_a_spec_is_told_where_it_lives(capsys):
    assert main(["plan", "--model", "tests._plans:builder_with_an_old_option", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "remat is given as search=autoaccum.Search(remat=...)" in err


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_every_option_of_a_spec_with_a_flag_reaches_the_plan(capsys):
    argv = ["plan", "--model", "tests._plans:builder", "--effective-batch", "4", "--json",
            "--quiet", "--budget", "64MiB", "--remat", "none", "--objective", "memory",
            "--method", "compile", "--no-uneven", "--no-cache", "--base-lr", "0.1",
            "--base-batch", "2", "--lr-rule", "linear", "--data-parallel", "1",
            "--batch-stats", "micro", "--drop-remainder"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["remat"], out["objective"], out["learning_rate"]) == ("none", "memory", 0.2)
    assert (out["lr_rule"], out["base_batch"]) == ("linear", 2)


def test_a_flag_for_a_spec_a_preset_does_not_take_is_a_usage_error(capsys):
    assert main(["plan", "--preset", "gemma3_1b", "--effective-batch", "8", "--quiet",
                 "--batch-stats", "micro"]) == 2
    assert "--batch-stats does not apply here" in capsys.readouterr().err


def test_a_presets_model_flag_next_to_a_model_function_is_a_usage_error(capsys):
    # --seq-len and --lora-rank build a preset's model: with --model they changed nothing, and
    # the plan was the function's model's, silently (found by a helper).
    assert main([*TINY, "--seq-len", "16", "--lora-rank", "4", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--lora-rank, --seq-len build a --preset's model" in err
    assert "Received: --lora-rank=4, --seq-len=16" in err


def test_only_the_spec_fields_of_the_flags_given_are_set():
    args = build_parser().parse_args(["plan", "--preset", "gemma3_1b", "--device", "t4",
                                      "--no-cache", "--base-batch", "1"])
    assert flag_values(args) == {("target", "device"): "t4", ("search", "cache"): False,
                                 ("learning_rate", "base_batch"): 1}
