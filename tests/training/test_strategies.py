"""Sharding strategies (replicated, zero1, zero2, fsdp): the layout rule, option checks, and
(in child processes with 4 and 8 host-platform CPU devices: the device count is fixed when
JAX starts) exact steps, planning under a per-device budget, fit, train_step and elastic
recovery with sharded state."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from autoaccum.internal import STRATEGIES, state_layout
from autoaccum.planning._strategies import leaf_spec, tree_specs, validate_strategy
from tests._paths import REPO, host_devices_env
from tests._session import once_per_session

# One worker runs the module: its fixtures' children run once per session, and the other
# worker never waits for them.
pytestmark = pytest.mark.xdist_group("training.test_strategies")


def _child(devices: int, *modes: str) -> dict:
    env = host_devices_env(devices)
    done = subprocess.run([sys.executable, "-m", "tests._shard_child", *modes], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def _child_once(key: str, devices: int, *modes: str) -> dict:
    """:func:`_child`'s result, run once per test session (the workers share it)."""
    return json.loads(once_per_session(key, lambda: json.dumps(_child(devices, *modes))))


# -- the layout rule (in process) -----------------------------------------------------------

def test_strategies_are_ordered_by_communication():
    assert STRATEGIES == ("replicated", "zero1", "zero2", "fsdp")


def test_a_leaf_is_split_along_its_first_divisible_axis():
    # The outermost axis: a shard is one contiguous block (gathered and reduce-scattered in
    # place, with no transposed copy).
    assert leaf_spec((512, 768), 4, "data") == P("data")
    assert leaf_spec((768, 512), 4, "data") == P("data")
    assert leaf_spec((6, 1000), 4, "data") == P(None, "data")  # 6 is not divisible by 4


def test_small_scalar_and_indivisible_leaves_are_copied():
    assert leaf_spec((64,), 4, "data") == P()  # a bias: fewer than 1024 elements
    assert leaf_spec((), 4, "data") == P()  # a step counter
    assert leaf_spec((3, 5001), 4, "data") == P()  # no axis divisible by 4
    assert leaf_spec((4096,), 1, "data") == P()  # one device: nothing to split


def test_tree_specs_read_shapes_of_abstract_leaves():
    tree = {"w": jax.ShapeDtypeStruct((256, 64), np.float32), "b": np.zeros(64)}
    assert tree_specs(tree, 8, "d") == {"w": P("d"), "b": P()}


def test_each_strategy_splits_more_of_the_state():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    params = {"w": jax.ShapeDtypeStruct((256, 64), np.float32)}
    opt = {"mu": params["w"], "count": jax.ShapeDtypeStruct((), np.int32)}
    for strategy in STRATEGIES:  # one device: every layout copies everything
        layout = state_layout(strategy, mesh, params=params, optimizer=opt)
        assert layout.params == {"w": P()} and layout.optimizer["mu"] == P()


def test_unknown_strategy_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"'fsdp'.*Received: strategy='zero3'"):
        validate_strategy("zero3")
    with pytest.raises(ValueError, match=r"Received: strategy=3$"):
        validate_strategy(3)
    with pytest.raises(ValueError, match="Received: strategy='auto'"):
        validate_strategy("auto", allow_auto=False)


def test_plan_refuses_an_unknown_strategy_before_compiling():
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import autoaccum

    def loss_fn(m, b):
        return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]

    data = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.float32)}
    with pytest.raises(ValueError, match="Received: strategy='zero-1'"):
        autoaccum.plan(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), data, effective_batch=8,
                       optimizer=optax.sgd, learning_rate=0.1, loss_fn=loss_fn,
                       budget="1GiB", log=None, target=autoaccum.Target(strategy="zero-1"))


def test_a_single_device_plan_is_replicated_in_its_json():
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import autoaccum

    def loss_fn(m, b):
        return jnp.sum((m(b["x"])[:, 0] - b["y"]) ** 2), b["y"].shape[0]

    data = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.float32)}
    plan = autoaccum.plan(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), data, effective_batch=8,
                          optimizer=optax.sgd, learning_rate=0.1, loss_fn=loss_fn,
                          budget="1GiB", log=None,
                          target=autoaccum.Target(strategy="fsdp", data_parallel=1))
    out = plan.to_dict()
    assert (plan.strategy, plan.mesh_shape) == ("replicated", (1,))
    assert (out["strategy"], out["devices"], out["mesh_shape"]) == ("replicated", 1, [1])
    assert {p["strategy"] for p in out["probes"]} == {"replicated"}


# -- several devices (child processes) ------------------------------------------------------

@pytest.mark.slow
def test_every_strategy_step_on_four_devices_equals_one_device_full_batch():
    out = _child(4, "exact")["exact"]
    for split in ("even", "uneven", "one"):
        for strategy in STRATEGIES:
            r = out[f"{split}/{strategy}"]
            assert r["params_error"] <= 1e-5 and r["opt_error"] <= 1e-5, (split, strategy, r)
            assert r["loss_error"] <= 1e-5 and r["count"][0] == r["count"][1]
            split_params = any("data" in s for s in r["param_specs"])
            split_opt = any("data" in s for s in r["opt_specs"])
            assert split_params == (strategy == "fsdp"), (strategy, r["param_specs"])
            assert split_opt == (strategy != "replicated"), (strategy, r["opt_specs"])
            # zero2/fsdp reduce-scatter each micro-batch's gradients into a split accumulator;
            # zero1 its copied accumulator once, for the optimizer's split update.
            assert (r["reduce_scatters"] > 0) == (strategy != "replicated")
    needs = [out[f"need/{s}"] for s in STRATEGIES]
    # Per device. (On this 40 KB model fsdp's per-operation gathers cost about what its
    # split weights save, so it is not compared with zero2 here; see
    # test_fsdp_never_holds_the_whole_weight_tree for a model whose weights matter.)
    assert needs[0] > needs[1] > needs[2] and needs[1] > needs[3], needs


@pytest.fixture(scope="module")
def fsdp_layouts() -> dict:
    """The fsdp checks (gathering at use, frozen weights split) in one child with 4
    host-platform devices, once per session."""
    return _child_once("shard-fsdp-at-use", 4, "fsdp_at_use", "fsdp_frozen")


@pytest.mark.slow
def test_fsdp_never_holds_the_whole_weight_tree_and_is_planned_under_that_budget(
        fsdp_layouts):
    out = fsdp_layouts["fsdp_at_use"]
    # The budget: one device's shards plus the whole weights (all of them gathered at once,
    # as the fsdp before per-use gathering did, needs more than that: 3.1 MB here).
    assert out["budget"] == out["args"]["fsdp"] + out["whole"]
    # What a micro-step holds beyond the arguments is less than the whole weight tree:
    # each weight is gathered where it is used, and gathered again in the backward pass.
    assert out["temps"]["fsdp"] < out["whole"], out
    assert out["needs"]["fsdp"] <= out["budget"] < out["needs"]["zero2"], out["needs"]
    assert out["strategy"] == "fsdp" and out["need"] <= out["budget"]
    assert out["steps"] == [2, 2] and out["params_error"] <= 1e-5
    assert any("data" in s for s in out["param_specs"])


@pytest.mark.slow
def test_fsdp_splits_a_lora_models_frozen_base_and_trains_its_adapters_exactly(fsdp_layouts):
    out = fsdp_layouts["fsdp_frozen"]
    assert out["strategy"] == "fsdp" and out["steps"] == [2, 2]
    # One device holds a quarter of each frozen base kernel, in the step and after fit.
    assert out["frozen_bytes"]["fsdp"] < out["frozen_bytes"]["replicated"] / 3
    assert out["args"]["fsdp"] < out["args"]["replicated"]
    assert out["base_specs"] == {"one.base_module.kernel": "P('data',)",
                                 "two.base_module.kernel": "P('data',)"}
    assert out["base_unchanged"] == 0.0
    assert out["lora_changed"] and out["lora_error"] <= 1e-5
    (val,), (ref_val,) = out["val_losses"]
    assert val == pytest.approx(ref_val, rel=1e-5)


@pytest.mark.slow
def test_sharded_strategies_on_eight_devices_equal_one_device():
    out = _child(8, "exact_uneven_sharded")["exact_uneven_sharded"]
    assert out["devices"] == 8
    for strategy in ("zero2", "fsdp"):
        r = out[f"uneven/{strategy}"]
        assert r["params_error"] <= 1e-5 and r["opt_error"] <= 1e-5, (strategy, r)
        assert r["count"][0] == r["count"][1]


@pytest.mark.slow
def test_batchnorm_model_under_every_strategy_equals_one_device_on_the_same_micro_batches():
    out = _child(4, "batchnorm")["batchnorm"]
    for strategy in STRATEGIES:
        r = out[strategy]
        assert r["params_error"] <= 1e-5 and r["stats_error"] <= 1e-5, (strategy, r)
        assert r["stats_changed"]


@pytest.mark.slow
def test_a_budget_replicated_exceeds_is_planned_with_the_cheapest_fitting_strategy():
    out = _child(4, "planned")["planned"]
    assert out["needs"]["replicated"] > out["budget"]
    assert out["strategy"] == out["expected"] != "replicated"
    assert out["fit_strategy"] == out["strategy"] and out["need"] <= out["budget"]
    assert out["json"] == {"strategy": out["strategy"], "devices": 4, "mesh_shape": [4]}
    assert out["report_has_strategy"]
    assert out["steps"] == [2, 2] and out["params_error"] <= 1e-5
    # the trained weights keep the strategy's layout (fsdp: split over the devices)
    if out["strategy"] == "fsdp":
        assert any("data" in s for s in out["param_specs"])


@pytest.mark.slow
def test_train_step_and_elastic_recovery_with_sharded_state():
    out = _child(4, "train_step_and_elastic")
    step, elastic = out["train_step_and_elastic"]["train_step"], \
        out["train_step_and_elastic"]["elastic"]
    assert step["strategy"] == "fsdp" and step["steps"] == [2, 2]
    assert step["params_error"] <= 1e-5 and step["loss_error"] <= 1e-5
    assert any("data" in s for s in step["param_specs"] + step["opt_specs"])
    assert elastic["strategy"] == "zero2" and elastic["end"] == [2, 4]
    assert elastic["events"] == 2 and elastic["steps"] == [2, 2]
    assert elastic["params_error"] <= 1e-5


@pytest.fixture(scope="module")
def own_layouts() -> dict:
    """The own-sharding checks (a one-axis mesh, a ('batch', 'model') mesh) in one child with
    4 host-platform devices, once per session."""
    return _child_once("shard-own-layouts", 4, "own_sharding", "own_mesh",
                       "own_abstract_and_deviceless", "own_split_strategies",
                       "users_other_axes")


@pytest.mark.slow
def test_a_model_split_by_its_own_annotations_keeps_that_sharding_through_plan_and_fit(
        own_layouts):
    out = own_layouts["own_sharding"]
    assert out["before"]["up.kernel"] == "P(None, 'fsdp')"
    assert out["before"]["embed.embedding"] == "P('fsdp',)"
    assert out["after"] == out["before"], (out["before"], out["after"])
    assert out["axes"] == ["('fsdp',)"] and out["plan_devices"] == 4
    # Back on the user's own mesh (Explicit axes), so their code under jax.set_mesh runs.
    assert out["on_users_mesh"] and out["runs_under_users_mesh"] == ["", ""]
    assert out["notes"] and "own sharding is kept for 3 weight(s)" in out["notes"][0]
    assert out["steps"] == [2, 2] and out["params_error"] <= 1e-5
    assert "plan is for one device" in out["errors"]["one_device"]
    assert "data_parallel='auto'" in out["errors"]["one_device"]
    assert "would train on devices [0, 1]" in out["errors"]["other_devices"]
    assert "Received: kernel: P(None, 'model')" in out["errors"]["other_devices"]


@pytest.mark.slow
def test_a_model_fitted_with_fsdp_under_a_two_axis_mesh_goes_back_to_that_mesh(own_layouts):
    # fsdp splits the weights over a one-axis mesh of its own; left there, the model failed
    # under the user's ("batch", "model") mesh ("context mesh ... should match the aval mesh")
    out = own_layouts["users_other_axes"]
    assert out["strategy"] == "fsdp"
    assert out["after"] == out["before"] and out["on_users_mesh"]
    assert out["runs_under_users_mesh"] == ""
    # the user's nnx.Optimizer's moments too: its own step runs as before
    assert out["moments_on_users_mesh"] and out["user_step"] == ""


@pytest.mark.slow
def test_a_minigpt_split_over_a_batch_by_model_mesh_keeps_its_layout_and_trains_exactly(
        own_layouts):
    out = own_layouts["own_mesh"]
    assert out["plan"] == {"strategy": "own", "devices": 4, "mesh_shape": [2, 2],
                           "mesh_axes": ["batch", "model"], "data_parallel": 2}
    assert out["report"] and "batches split over 'batch'" in out["notes"][0]
    # each micro-batch is split over a group of 2 devices (the 'model' axis), 2 groups
    assert any("8 = micro_batch 4 x 2 group(s) of 2 devices x 1" in x for x in out["groups"])
    assert any("per group of 2 devices on all 2 groups (4 devices)" in x for x in out["groups"])
    for split, expected in (("even", [2, 2]), ("uneven", [3, 2])):  # 4 per device: 2+2, 3+1
        fit = out[split]
        assert fit["steps"] == 1 and fit["split"] == expected
        assert fit["params_error"] <= 1e-5, (split, fit["params_error"])
        assert fit["same_shardings"]  # spec and mesh of every weight, as before fit
        assert fit["specs"] == {"tokens.embedding": "P(None, 'model')",
                                "blocks.0.linear1.kernel": "P(None, 'model')",
                                "blocks.0.linear2.kernel": "P('model',)",
                                "blocks.0.norm1.scale": "P()"}
    step = out["train_step"]  # autoaccum.train_step: the same step, the same layout
    assert step["step"] == 1 and step["strategy"] == "own" and step["params_error"] <= 1e-5
    assert step["specs"] == ["P('model',)", "P(None, 'model')"]
    # optimizer moments laid out like the weights; one device holds less than the state
    assert out["moments_like_weights"]
    assert out["argument_bytes"] < out["whole_state_bytes"]
    assert out["measure"] == [2, 2, True]  # autoaccum.measure: 8 = 2 x 2 (batch axis) x 2
    assert out["tp"] == {"strategy": "own", "devices": 4, "mesh_shape": [1, 4],
                         "data_parallel": 1}
    assert "strategy='auto'" in out["errors"]["strategy"]
    assert "Received: strategy='fsdp'" in out["errors"]["strategy"]
    assert "both a 'batch' and a 'data' axis" in out["errors"]["ambiguous"]
    assert "plan is for one device" in out["errors"]["one_device"]
    assert "split over its 'batch' axis" in out["errors"]["one_device"]


@pytest.mark.slow
def test_weights_a_model_leaves_whole_beside_its_own_split_train_exactly_under_every_strategy(
        own_layouts):
    out = own_layouts["own_split_strategies"]  # zero2 (and zero1 at one micro-batch) split
    for split in ("accumulated", "one"):       # the whole weights' gradients: a crash before
        for strategy in STRATEGIES:
            row = out[f"{split}/{strategy}"]
            assert row["params_error"] <= 1e-6 and row["loss_error"] <= 1e-6, (split, strategy)


@pytest.mark.slow
def test_a_model_built_on_an_abstract_mesh_plans_as_on_real_devices_and_for_a_tpu_slice(
        own_layouts):
    out = own_layouts["own_abstract_and_deviceless"]
    for mesh in ("one_axis", "two_axes"):  # nnx.eval_shape under use_abstract_mesh
        assert out[mesh]["abstract"] == out[mesh]["real"], mesh
    assert out["two_axes"]["real"]["strategy"] == "own"
    errors = out["errors"]
    assert "abstract mesh of 8 devices" in errors["too_few_devices"]
    assert "xla_force_host_platform_device_count=8" in errors["too_few_devices"]
    if "v5e_4" not in out:
        pytest.skip("libtpu (the `tpu` extra) is not installed")
    # A one-axis ('fsdp',) split kept over the slice's own axis (a raw JAX error before).
    assert out["v5e_4"]["data_parallel"] == 4
    assert "kept for 3 weight(s) (split over its mesh axis 'fsdp', 4 devices" in (
        out["v5e_4"]["notes"][0])
    assert "plan is for one device ('v5e-1')" in errors["one_chip"]
    assert "is over 4 devices (mesh {'data': 2, 'fsdp': 2}), and the target has 1" in (
        errors["kept_one_chip"])
    assert "build the model without a mesh" in errors["kept_one_chip"]
    assert "does not divide over the 8 devices" in errors["indivisible"]
    assert "(8, 20) by P(None, 'fsdp')" in errors["indivisible"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo collectives on Linux")
def test_two_processes_train_with_fsdp_as_one_device_does():
    port = str(_free_port())
    env = host_devices_env(2)
    procs = [subprocess.Popen([sys.executable, "-m", "tests._shard_multiprocess", str(i), port],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
            assert p.returncode == 0 and lines, stderr[-5000:]
            outs.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out in outs:
        assert out["process_count"] == 2 and out["devices"] == 4
        assert out["strategy"] == "fsdp" and out["data_parallel"] == 4
        # split weights: each process holds only its 2 of the 4 shards
        assert out["split"] >= 3 and set(out["addressable"]) == {2}
        assert out["steps"] == 2 and out["params_error"] <= 1e-5
    assert outs[0]["checksum"] == outs[1]["checksum"]
    assert outs[0]["losses"] == outs[1]["losses"]
