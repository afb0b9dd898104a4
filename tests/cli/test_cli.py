"""The ``autoaccum`` command line: plan (JSON schema, plot), devices, and its errors."""

import json

import pytest

from autoaccum.cli._main import main

TINY = ["plan", "--model", "autoaccum_demo:tiny_lm_plan_inputs", "--effective-batch", "8"]


@pytest.mark.slow
def test_plan_json_has_the_documented_schema(capsys):
    assert main([*TINY, "--budget", "64MiB", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key, kind in [("device", str), ("budget_bytes", int), ("micro_batch", int),
                      ("accum_steps", int), ("effective_batch", int), ("learning_rate", float),
                      ("need_bytes", int), ("probes", list), ("lr_arithmetic", str)]:
        assert isinstance(out[key], kind), key
    assert out["micro_batch"] * out["accum_steps"] * out["data_parallel"] == 8
    assert out["budget_bytes"] == 64 * 2**20
    for probe in out["probes"]:
        assert {"micro_batch", "need_bytes", "fits"} <= set(probe)
        assert set(probe["memory"]) >= {"frozen_weights", "trainable_weights", "optimizer_state",
                                        "gradient_accumulator", "batch", "activations_and_temp"}


@pytest.mark.slow
def test_plan_table_itemizes_each_probe_and_plots(tmp_path, capsys):
    png = tmp_path / "need.png"
    assert main([*TINY, "--budget", "64MiB", "--lr-rule", "sqrt", "--base-lr", "1e-4",
                 "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "compiling micro_batch=2" in captured.err  # live progress
    for column in ("frozen", "trainable", "optimizer", "grad acc", "batch", "act+temp",
                   "total", "budget", "fits"):
        assert column in captured.out
    assert "sqrt(8/1), sqrt" in captured.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_plan_for_a_named_gpu_is_deviceless_and_says_so(capsys):
    assert main([*TINY, "--device", "t4", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "deviceless" in out["device"] and out["budget_source"] == "profile"


def test_unknown_device_lists_known_ones(capsys):
    assert main([*TINY, "--device", "k80", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "k80" in err and "t4" in err and "h100" in err


def test_unknown_architecture_suggests_near_names(capsys):
    assert main(["plan", "--preset", "gemma3-4", "--effective-batch", "8", "--quiet"]) == 2
    assert "gemma3_4b" in capsys.readouterr().err


def test_budget_larger_than_device_is_refused(capsys):
    assert main([*TINY, "--device", "t4", "--budget", "100GiB", "--quiet"]) == 2
    assert "larger than the memory" in capsys.readouterr().err


def test_model_and_preset_are_exclusive():
    with pytest.raises(SystemExit, match="exactly one"):
        main(["plan", "--effective-batch", "8"])


def test_devices_lists_profiles_and_detection(capsys):
    assert main(["devices", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {p["key"] for p in out["profiles"]}
    assert {"t4", "l4", "p100", "v100-16gb", "v100-32gb", "a10g", "a100-40gb", "a100-80gb",
            "h100-80gb", "h200", "rtx3090", "rtx4090", "cpu"} <= keys
    assert out["detected"]["source"] in ("nvml", "jax", "cpu")
