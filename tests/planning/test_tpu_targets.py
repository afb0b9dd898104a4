"""Dry runs for TPU slices that are not here: ``plan(device="v5e-1")`` (Colab's free TPU) and
``device="v5e-8"`` (Kaggle's) compile deviceless with libtpu over every chip of the slice, the
budget is the HBM XLA's compile-time check allows, and a step over it, which that check
refuses, is read as "does not fit" and planned around."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.cli._main import main
from autoaccum.devices import find_profile
from autoaccum.devices._deviceless import deviceless_target
from autoaccum.devices._extras import MissingExtraError
from autoaccum.planning._measure import measure_program
from autoaccum.planning._targets import resolve_target
from tests._models import TinyLM, ragged_tokens, token_loss

pytest.importorskip("libtpu")  # the `tpu` extra: make test installs it

GIB = 2**30


def _plan(device: str, **kwargs):
    model = TinyLM(vocab=512, dim=64, hidden=256, rngs=nnx.Rngs(0))
    return autoaccum.plan(model, ragged_tokens(16, 64, vocab=512), effective_batch=16,
                          optimizer=optax.adamw, learning_rate=1e-4, loss_fn=token_loss,
                          device=device, log=None, search=autoaccum.Search(cache=False),
                          **kwargs)


class Wide(nnx.Module):
    """Activations of 16 KiB x 4096 per example: a few hundred examples fill a v5e chip."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(256, 4096, rngs=rngs)
        self.down = nnx.Linear(4096, 256, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


def _wide_loss(model: Wide, batch: dict) -> tuple[jax.Array, int]:
    return jnp.sum((model(batch["x"]) - batch["x"]) ** 2), batch["x"].shape[0]


@pytest.mark.slow  # a plan of several TPU compiles: over 5 s
def test_colab_tpu_is_planned_deviceless_on_one_chip_with_the_hbm_the_compiler_allows():
    plan = _plan("colab-tpu")
    assert plan.deviceless and plan.profile == "v5e-1" and plan.data_parallel == 1
    assert "TPU v5e-1" in plan.target and "topology v5e:1x1" in plan.target
    assert plan.budget_bytes == int(15.75 * GIB)
    assert 0 < plan.need_bytes <= plan.budget_bytes
    assert plan.micro_batch * plan.accum_steps == 16


@pytest.mark.slow  # a plan of several TPU compiles: over 5 s
def test_kaggle_tpu_is_planned_over_its_eight_chips_and_sharded_per_chip():
    one = _plan("v5e-1", target=autoaccum.Target(strategy="replicated"))
    eight = _plan("kaggle-tpu", target=autoaccum.Target(strategy="fsdp"))
    assert eight.profile == "v5e-8" and eight.data_parallel == 8
    assert eight.strategy == "fsdp" and eight.to_dict()["mesh_shape"] == [8]
    assert eight.micro_batch * 8 * eight.accum_steps == 16
    assert "per chip" in eight.target and eight.budget_bytes == one.budget_bytes
    # fsdp splits the weights over the 8 chips: each holds an eighth (padded up).
    assert eight.estimate.trainable_bytes * 8 <= one.estimate.trainable_bytes * 1.1


def test_a_step_over_a_chips_hbm_is_refused_by_the_compiler_and_read_as_not_fitting():
    data = {"x": np.ones((8, 16, 256), np.float32)}
    estimate = autoaccum.measure(Wide(nnx.Rngs(0)), data, micro_batch=2**16, accum_steps=1,
                                 device="v5e-1", optimizer=optax.adam(1e-3),
                                 loss_fn=_wide_loss, search=autoaccum.Search(cache=False))
    assert estimate.need_bytes > 15.75 * GIB
    assert "refused by the TPU compiler" in estimate.compile_note
    assert "Ran out of memory on HBM" in estimate.compile_note


@pytest.mark.slow  # two TPU compiles: about 30 s
def test_a_step_over_a_budget_under_the_hbm_is_refused_at_libtpus_early_check():
    # A budget of 26 MiB on a 15.75 GiB chip: libtpu is asked to check against it (and its
    # slack), so a step over it is refused before code generation; one under it compiles in
    # full and its memory analysis decides.
    from autoaccum.internal import flax_program
    from autoaccum.planning._cache import CompileRequest, measure_all
    from autoaccum.planning._targets import hbm_check_mib, resolve_target

    resolved = resolve_target("v5e-1", "26MiB")
    assert ("xla_tpu_max_hbm_size_mib", hbm_check_mib(26 * 2**20)) in (
        resolved.compile_target.compiler_options)
    program = flax_program(Wide(nnx.Rngs(0)),
                           {"x": jax.ShapeDtypeStruct((16, 256), jnp.float32)},
                           loss_fn=_wide_loss, tx=optax.adam(1e-3))
    over, under = measure_all([CompileRequest(program, 64, 1), CompileRequest(program, 4, 2)],
                              resolved.compile_target, workers=1)
    assert "refused by the TPU compiler" in over.compile_note
    assert over.need_bytes > hbm_check_mib(26 * 2**20) * 2**20
    assert under.compile_note == "" and under.need_bytes <= 26 * 2**20


@pytest.mark.slow  # big compiles near the HBM: about a minute
def test_an_effective_batch_over_the_hbm_is_planned_around_with_accumulation():
    data = {"x": np.broadcast_to(np.float32(1), (512, 2048, 256))}  # no memory: a view
    plan = autoaccum.plan(Wide(nnx.Rngs(0)), data, effective_batch=512, device="v5e-1",
                          optimizer=optax.adam(1e-3), loss_fn=_wide_loss, log=None,
                          search=autoaccum.Search(cache=False))
    # From the largest candidate down: each one over the chip is refused by the compiler at
    # its early HBM check (seconds); the first that compiles in full is the answer, so the
    # plan finishes one compile (two where the first finished one is just over the budget).
    refused = [p for p in plan.probes if "refused by the TPU compiler" in p.estimate.compile_note]
    finished = [p for p in plan.probes if p not in refused]
    assert all(p.need_bytes > plan.budget_bytes for p in refused)
    assert all(p.micro_batch > plan.micro_batch for p in refused)
    assert 1 <= len(finished) <= 2 and finished[-1].micro_batch == plan.micro_batch
    assert [p.micro_batch for p in plan.probes] == sorted(
        (p.micro_batch for p in plan.probes), reverse=True)
    assert plan.accum_steps > 1 and plan.micro_batch * plan.accum_steps == 512
    assert plan.need_bytes <= plan.budget_bytes
    assert plan.compiles.full == len(plan.probes)


@pytest.mark.slow  # a TPU compile: about 10 s
def test_a_tpu_plan_where_the_whole_batch_fits_finishes_one_compile():
    plan = _plan("v5e-1")
    assert [p.micro_batch for p in plan.probes] == [16]  # the largest candidate first
    assert (plan.micro_batch, plan.accum_steps) == (16, 1)
    assert plan.compiles.full == 1 and plan.compiles.reduced == 0


def test_a_slice_asked_for_another_chip_count_is_refused_naming_the_slices():
    with pytest.raises(ValueError, match=r"instead \(v5e-4, [^:]*: .*Received: "
                                         r"device='v5e-8', devices=4") as refused:
        deviceless_target("v5e-8", devices=4)
    named = str(refused.value).split("instead (")[1].split(":")[0].split(", ")
    assert sorted(named) == ["v4-8", "v5e-4", "v5p-8", "v6e-4"]  # the 4-chip slices only


def test_a_budget_over_a_chip_names_the_limit_so_that_it_can_be_typed_back():
    profile = find_profile("v5e-8")
    with pytest.raises(ValueError, match=r"The budget 15.80 GiB is more than one chip .*: "
                                         r"15.75 GiB of HBM .*at most 15.75 GiB"):
        resolve_target(profile, "15.8GiB")  # the limit read 15.8 GiB, refused when typed
    assert resolve_target(profile, "15.75GiB").budget.bytes == int(15.75 * 2**30)


def test_memory_fraction_with_a_tpu_is_refused_with_the_budget_as_fix():
    with pytest.raises(ValueError, match=r"TPU, whose memory XLA assigns.*budget="):
        _plan("v5e-1", target=autoaccum.Target(memory_fraction=0.9))


def test_without_libtpu_a_tpu_dry_run_names_the_tpu_extra(monkeypatch):
    import autoaccum.devices._deviceless as deviceless

    monkeypatch.setattr(deviceless, "missing_from_extra",
                        lambda extra: ["libtpu is not installed"] if extra == "tpu" else [])
    with pytest.raises(MissingExtraError, match=r"pip install 'autoaccum\[tpu\]'") as info:
        deviceless_target("v6e-1")
    assert info.value.extra == "tpu"


def test_devices_lists_tpu_slices_with_chips_memory_how_they_compile_and_the_extra(capsys):
    assert main(["devices", "--json"]) == 0
    profiles = {p["key"]: p for p in json.loads(capsys.readouterr().out)["profiles"]}
    assert {"v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8", "v5p-8", "v4-8"} <= set(profiles)
    v5e8 = profiles["v5e-8"]
    assert (v5e8["platform"], v5e8["devices"], v5e8["memory_bytes"]) == ("tpu", 8, 16 * GIB)
    assert v5e8["compiled"] == "libtpu v5e:2x4" and v5e8["extra"] == "tpu"
    assert v5e8["extra_installed"] and "kaggle-tpu" in v5e8["aliases"] and v5e8["source"]
    assert profiles["t4"]["extra"] == "dryrun" and profiles["t4"]["platform"] == "gpu"
    assert main(["devices"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.split()[:1] == ["v6e-8"])
    assert "libtpu v6e:2x4" in row and "tpu" in row


@pytest.mark.slow  # a plan of several TPU compiles: over 5 s
def test_the_command_line_plans_for_a_tpu_slice_by_its_name(capsys):
    argv = ["plan", "--model", "autoaccum_demo:tiny_lm_plan_inputs", "--effective-batch", "8",
            "--device", "v5e-4", "--json", "--no-cache"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["profile"], out["data_parallel"], out["deviceless"]) == ("v5e-4", 4, True)
    assert out["budget_bytes"] == int(15.75 * GIB)


@pytest.mark.slow  # a child process: about 4 s
def test_no_libtpu_start_up_lines_where_no_tpu_is_attached():
    code = ("import autoaccum, jax, jax.numpy as jnp\n"
            "from autoaccum.devices._deviceless import deviceless_target\n"
            "t = deviceless_target('v5e-1')\n"
            "x = t.shard(jax.ShapeDtypeStruct((8, 8), jnp.float32))\n"
            "jax.jit(lambda a: a @ a).lower(x).compile()\n"
            "print(jax.devices()[0].platform)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "cpu", done.stderr
    assert "TPU" not in done.stderr and "libtpu" not in done.stderr, done.stderr


@pytest.mark.slow  # a child process with 8 host devices: about 20 s
def test_a_models_own_layout_is_kept_over_the_chips_of_a_slice_that_is_not_here():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-m", "tests._tpu_child"], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["strategy"], out["mesh_shape"], out["mesh_axes"]) == ("own", [2, 4],
                                                                      ["batch", "model"])
    assert (out["profile"], out["deviceless"], out["data_parallel"]) == ("v5e-8", True, 2)
    assert "TPU v5e-8" in out["target"] and out["split"] == 16
    # Per chip, as on the 8 host devices: the 'model' axis splits the weights four ways.
    assert out["trainable"] == out["here_trainable"] and out["here_strategy"] == "own"
    # XLA partitions a kept layout's step (GSPMD): the plan, its probes and report say so.
    assert out["partitioner"] == ["xla", "xla", ["xla"]] and out["report_says_xla"]


@pytest.mark.slow  # a child process with 8 host devices and two TPU compiles
def test_a_kept_layout_on_four_tpu_chips_updates_its_weights_in_their_own_layout():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-m", "tests._tpu_child", "kept_floor"],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = json.loads(done.stdout.strip().splitlines()[-1])
    # need / floor. The accumulator's share (split over 'batch' too) goes back to its
    # weight's layout before the update; XLA ran the optimizer in the accumulator's layout
    # and gathered every new weight and moment: 1.63 (1 x 4) and 1.45 (4 x 1) of the floor.
    assert max(ratios.values()) <= 1.1, ratios


@pytest.mark.slow  # fit's set-up before the check: over 2 s
def test_fit_for_a_slice_that_is_not_here_is_refused_with_the_dry_run_and_where_to_train():
    data = {"x": np.ones((16, 16, 256), np.float32)}
    with pytest.raises(ValueError, match=r"fit\(\) trains on this machine's devices.*"
                                         r"autoaccum.plan\(\.\.\., device='v5e-8'\).*"
                                         r"Received: device='v5e-8', devices=8"):
        autoaccum.fit(Wide(nnx.Rngs(0)), data, effective_batch=16, device="v5e-8",
                      optimizer=optax.sgd(0.1), loss_fn=_wide_loss, verbose=0)


class EmbedProject(nnx.Module):
    """Two 128 MiB matrices (an embedding and its projection): large enough that libtpu keeps
    their gradients in HBM, where its memory analysis counts them."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(32768, 1024, rngs=rngs)
        self.project = nnx.Linear(1024, 32768, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.project(jnp.tanh(self.embed(tokens)))


@pytest.mark.slow  # two TPU compiles of 256 MiB of weights
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_strategies_on_four_tpu_chips_hold_no_whole_micro_batch_gradient(strategy):
    from autoaccum.adapters.flax._nnx_program import flax_program
    from autoaccum.planning._measure import measure_program
    from autoaccum.planning._targets import resolve_target

    def lm_loss(model, batch):
        losses = optax.softmax_cross_entropy_with_integer_labels(
            model(batch["tokens"][:, :-1]), batch["tokens"][:, 1:])
        return jnp.sum(losses), losses.size

    resolved = resolve_target("v5e-4")
    program = flax_program(nnx.eval_shape(lambda: EmbedProject(nnx.Rngs(0))),
                           {"tokens": jax.ShapeDtypeStruct((9,), jnp.int32)}, loss_fn=lm_loss,
                           tx=optax.adamw(1e-3), mesh=resolved.mesh, strategy=strategy)
    estimate = measure_program(program, 4, 1, resolved.compile_target)
    # Each gradient reduce-scattered where the backward pass completes it: the step holds
    # its floor (a chip's share of the state, the batch, one whole gradient leaf). With the
    # reduce-scatter after the whole micro-batch gradient it held 1.39x that.
    assert estimate.need_bytes <= 1.1 * estimate.floor_bytes, (estimate.need_bytes,
                                                               estimate.floor_bytes)


def test_libtpu_compile_options_of_a_tpu_target_reach_libtpu():
    # They used to be probed on this machine's CPU backend, which knows no `xla_tpu_*`
    # option, and dropped: a TPU target's options changed nothing.
    target = resolve_target(find_profile("v5e-1")).compile_target
    spec = {"tokens": jax.ShapeDtypeStruct((17,), jnp.int32),
            "mask": jax.ShapeDtypeStruct((17,), jnp.int32)}
    program = flax_program(nnx.eval_shape(lambda: TinyLM(rngs=nnx.Rngs(0))), spec,
                           loss_fn=token_loss, tx=optax.adamw(1e-3))

    def with_options(**options):
        return dataclasses.replace(target, compiler_options=tuple(options.items()),
                                   fingerprint=f"{target.fingerprint} {options}")

    known = measure_program(program, 2, 2, with_options(
        xla_tpu_enable_latency_hiding_scheduler=False))
    assert known.need_bytes > 0
    with pytest.raises(Exception, match="xla_tpu_no_such_option"):
        measure_program(program, 2, 2, with_options(xla_tpu_no_such_option=True))
