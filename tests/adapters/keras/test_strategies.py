"""Sharding strategies for Keras models (replicated, zero1, zero2, fsdp) over 4 host-platform
CPU devices, in one child process (the device count is fixed when JAX starts): each
strategy's accumulated step equals ``model.fit`` on the whole batch on one device, the
planner picks the cheapest strategy that fits a per-device budget, and fit, a second fit,
Keras's ``predict``, ``train_step`` and elastic recovery run on the variables as the strategy
leaves them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoaccum.internal import STRATEGIES
from tests._paths import REPO
from tests._session import once_per_session
from tests.training.test_data_parallel import _env, _result

pytestmark = [pytest.mark.slow,  # a subprocess on 4 host-platform devices
              pytest.mark.xdist_group("adapters.keras.test_strategies")]


@pytest.fixture(scope="module")
def four_devices() -> dict:
    def child() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tests._shard_child", "keras_exact", "keras_planned",
             "keras_elastic"],
            cwd=REPO, env=_env(4), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-5000:]
        return json.dumps(_result(done.stdout, done.stderr))

    return json.loads(once_per_session("keras-strategies-four-devices", child))


@pytest.mark.parametrize("split", ["even", "uneven"])
def test_every_strategy_step_equals_model_fit_on_the_whole_batch(four_devices, split):
    out = four_devices["keras_exact"]
    assert out["devices"] == 4
    for strategy in STRATEGIES:
        r = out[f"{split}/{strategy}"]
        assert r["params_error"] <= 1e-5 and r["opt_error"] <= 1e-5, (strategy, r)
        assert r["loss_error"] <= 1e-5 and r["mae_error"] <= 1e-5, (strategy, r)
        assert r["history_strategy"] == strategy
        # After fit the variables keep the strategy's layout.
        split_params = any("data" in s for s in r["param_specs"])
        split_opt = any("data" in s for s in r["opt_specs"])
        assert split_params == (strategy == "fsdp"), (strategy, r["param_specs"])
        assert split_opt == (strategy != "replicated"), (strategy, r["opt_specs"])


def test_a_batchnorm_model_under_every_strategy_equals_one_device(four_devices):
    out = four_devices["keras_exact"]
    for strategy in STRATEGIES:
        r = out[f"batchnorm/{strategy}"]
        # Weights: one device scanning the same micro-batches (BatchNorm normalises each
        # micro-batch by its own statistics); moving statistics: model.fit's whole batch.
        assert r["params_error"] <= 1e-5 and r["opt_error"] <= 1e-5, (strategy, r)
        assert r["moving_error"] <= 1e-5 and r["moving_changed"], (strategy, r)
    assert any("data" in s for s in out["batchnorm/fsdp"]["param_specs"])


def test_a_budget_replicated_exceeds_is_planned_with_the_cheapest_fitting_strategy(
        four_devices):
    out = four_devices["keras_planned"]
    assert out["needs"]["replicated"] > out["budget"]
    assert out["strategy"] == out["expected"] != "replicated"
    assert out["history_strategy"] == out["strategy"] and out["need"] <= out["budget"]
    assert out["json"] == {"strategy": out["strategy"], "devices": 4, "mesh_shape": [4]}
    assert out["report_line"].startswith(f"sharding          {out['strategy']}:")
    # The strategies tried before the chosen one are in the probes.
    assert set(out["probe_strategies"]) == set(STRATEGIES[:STRATEGIES.index(out["strategy"])
                                                          + 1])


def test_the_planned_fit_trains_as_model_fit_and_keeps_the_strategys_layout(four_devices):
    out = four_devices["keras_planned"]
    first = out["first"]
    assert first["params_error"] <= 1e-5 and first["opt_error"] <= 1e-5, first
    assert any("data" in s for s in first["opt_specs"])
    assert any("data" in s for s in first["param_specs"]) == (out["strategy"] == "fsdp")
    assert out["predict_error"] <= 1e-5  # Keras runs on the split variables as they are


def test_a_second_fit_lays_autoaccums_own_layout_out_afresh(four_devices):
    out = four_devices["keras_planned"]
    assert out["again_strategy"] == out["strategy"] and out["steps"] == 4
    assert out["again_error"] <= 1e-5


def test_strategy_names_one_for_plan_and_train_step(four_devices):
    out = four_devices["keras_planned"]
    assert out["named"] == ["fsdp", 4]
    step = out["train_step"]
    assert step["strategy"] == "zero2" and step["steps"] == 2
    assert step["params_error"] <= 1e-5 and step["loss_error"] <= 1e-5
    assert any("data" in s for s in step["opt_specs"])


def test_an_out_of_memory_under_fsdp_is_redone_smaller_from_the_restored_split_state(
        four_devices):
    out = four_devices["keras_elastic"]
    # 8 per device -> 4 -> 2 (the fake out-of-memory surfaces when the result is read, after
    # the next batch was fetched: no batch is lost to the retries).
    assert out["events"] == 2 and out["end"] == [2, 4] and out["steps"] == 2
    assert out["params_error"] <= 1e-5
    assert any("data" in s for s in out["param_specs"])
