"""autoaccum.advise: when a model does not fit, every row it lists fits when the model is
planned again, independently, with that change (same budget); the table is attached to the
DoesNotFitError of plan(advise=True); JSON and HTML show it."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning._measure import compile_count

# The module's fixtures are built once: its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_advise_api")

WIDTH, DEPTH, RANK = 256, 2, 8
LR = 1e-3


class LoRAMLP(nnx.Module):
    def __init__(self, *, rank: int = RANK, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.layers = nnx.List([
            nnx.LoRALinear(WIDTH, WIDTH, lora_rank=rank, param_dtype=param_dtype, rngs=rngs)
            for _ in range(DEPTH)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def mse(model, batch):
    out = model(batch["x"]).astype(jnp.float32)
    return jnp.sum((out - batch["y"]) ** 2), batch["y"].shape[0]


DATA = {"x": np.ones((16, WIDTH), np.float32), "y": np.zeros((16, WIDTH), np.float32)}
BUDGET = 1_500_000  # weights + Adam's moments (1.67 MB) do not fit; many changes do
OPTIMIZERS = {"sgd": optax.sgd, "adafactor": optax.adafactor, "adamw": optax.adamw,
              "lion": optax.lion}


def replan(change: dict):
    """``autoaccum.plan`` with ``change`` applied by hand (not by the advisor's hooks)."""
    kwargs = dict(optimizer=optax.adam, learning_rate=LR, budget=BUDGET)
    model_kwargs, remat = {}, "auto"
    for key, value in change.items():
        if key == "optimizer":
            factory = OPTIMIZERS[value]
            if "mu_dtype" in change:
                factory = functools.partial(factory, mu_dtype=jnp.dtype(change["mu_dtype"]))
            kwargs["optimizer"] = factory
        elif key == "trainable":
            kwargs["trainable"] = nnx.LoRAParam
        elif key == "lora_rank":
            model_kwargs["rank"] = value
        elif key == "weight_dtype":
            model_kwargs["param_dtype"] = jnp.dtype(value)
        elif key == "remat":
            remat = value
        elif key == "device":
            kwargs.update(device=value, budget=None)
        elif key != "mu_dtype":
            raise AssertionError(f"unexpected change {key}")
    model = LoRAMLP(rngs=nnx.Rngs(0), **model_kwargs)
    return autoaccum.plan(model, DATA, effective_batch=2, loss_fn=mse, log=None, **kwargs,
                          search=autoaccum.Search(remat=remat, method="compile", cache=False))


@pytest.fixture(scope="module")
def advice():
    return autoaccum.advise(LoRAMLP(rngs=nnx.Rngs(0)), DATA, effective_batch=2,
                            optimizer=optax.adam, learning_rate=LR, loss_fn=mse,
                            budget=BUDGET, log=None, search=autoaccum.Search(cache=False))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_the_model_as_given_does_not_fit_from_shapes_alone(advice):
    assert not advice.fits
    assert advice.resident.state_bytes > BUDGET
    assert advice.error.resident is advice.resident or advice.error.resident == advice.resident
    with pytest.raises(autoaccum.DoesNotFitError):
        replan({})


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_every_advised_row_fits_when_planned_with_its_change(advice):
    changes = [a.change for a in advice.alternatives]
    assert {"trainable": "lora"} in changes
    assert any(c.get("optimizer") == "sgd" for c in changes)
    assert any("device" in c for c in changes)
    for row in advice.alternatives:
        plan = replan(row.change)
        assert plan.need_bytes <= plan.budget_bytes
        assert row.need_bytes <= row.budget_bytes
        assert (plan.micro_batch, plan.accum_steps) == (row.micro_batch, row.accum_steps)
        assert row.relative_flops >= 1.0 or np.isnan(row.relative_flops)
    assert min(a.relative_flops for a in advice.alternatives) == 1.0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_the_report_says_how_to_apply_each_kind_of_row(advice):
    report = advice.report()
    assert "how to apply a row:" in report
    assert "trainable=lora: trainable=nnx.LoRAParam" in report
    assert "optimizer=sgd: optimizer=optax.sgd" in report
    device = next(a.change["device"] for a in advice.alternatives if "device" in a.change)
    assert f'device={device}: device="{device}" without budget=' in report
    assert set(advice.to_dict()["hints"]) == set(advice.hints)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_rows_that_cannot_shrink_the_state_are_not_tried(advice):
    tried = [c for c, _ in advice.tried] + [a.change for a in advice.alternatives]
    assert not any(set(c) == {"remat"} for c in tried)
    # A row that does not fit says its verdict, not the general advice the table replaces.
    assert advice.tried and all("What would help" not in why for _, why in advice.tried)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_advice_as_json_and_html(advice):
    out = json.loads(json.dumps(advice.to_dict(), default=str))
    assert out["fits"] is False and out["resident"]["state_bytes"] > BUDGET
    row = out["alternatives"][0]
    assert set(row) >= {"change", "micro_batch", "accum_steps", "last_micro_batch",
                        "need_bytes", "budget_bytes", "relative_flops"}
    assert "trainable=lora" in advice._repr_html_()
    error = advice.error.to_dict()
    assert error["fits"] is False and error["alternatives"] == out["alternatives"]
    assert "trainable=lora" in advice.error._repr_html_()
    assert "What would fit" in str(advice.error) and "trainable=lora" in str(advice.error)


@pytest.mark.slow  # runs the whole advisor again
def test_plan_with_advise_raises_the_error_with_the_table():
    before = compile_count()
    with pytest.raises(autoaccum.DoesNotFitError) as info:
        autoaccum.plan(LoRAMLP(rngs=nnx.Rngs(0)), DATA, effective_batch=2,
                       optimizer=optax.adam, learning_rate=LR, loss_fn=mse, budget=BUDGET,
                       log=None, advise=True,
                       search=autoaccum.Search(cache=False, method="compile"))
    error = info.value
    assert error.resident is not None and error.alternatives
    assert "What would fit" in str(error)
    assert compile_count() > before  # the rows were compiled


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_model_that_fits_needs_no_advice():
    advice = autoaccum.advise(LoRAMLP(rngs=nnx.Rngs(0)), DATA, effective_batch=2,
                              optimizer=optax.adam, learning_rate=LR, loss_fn=mse,
                              budget="64MiB", log=None, search=autoaccum.Search(cache=False))
    assert advice.fits and advice.plan is not None and advice.alternatives == ()
    assert "the configuration as given fits" in advice.report()
    assert "What would fit" not in advice.report()  # no empty table of 0 changes


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


@pytest.mark.slow
def test_more_of_the_same_gpu_is_advised_with_the_strategy_that_fits(tmp_path):
    # Weights + Adam's moments (1.6 MB) are over one T4's budget here: more T4s fit only when
    # they split the state (a replica per device could not). One need cache for the advisor
    # and the re-plan, as a user's session has (the re-plan finds the row's programs there).
    kwargs = dict(effective_batch=16, optimizer=optax.adam, learning_rate=LR, loss_fn=mse,
                  device="t4", budget=BUDGET, log=None,
                  search=autoaccum.Search(cache=str(tmp_path)))
    advice = autoaccum.advise(MLP(rngs=nnx.Rngs(0)), DATA, **kwargs)
    assert not advice.fits and advice.resident.state_bytes > BUDGET
    rows = [a for a in advice.alternatives if "devices" in a.change]
    assert len(rows) == 1, [a.change for a in advice.alternatives]
    row = rows[0]
    assert row.change["strategy"] in ("zero1", "zero2", "fsdp"), row.change
    assert "strategy=" in advice.report() and f"devices={row.change['devices']}" in advice.report()
    again = autoaccum.plan(MLP(rngs=nnx.Rngs(0)), DATA, **kwargs,
                           target=autoaccum.Target(devices=row.change["devices"],
                                                   strategy=row.change["strategy"]))
    assert again.need_bytes <= BUDGET and again.data_parallel == row.change["devices"]
    assert (again.micro_batch, again.accum_steps) == (row.micro_batch, row.accum_steps)
    assert {p.estimate.source for p in again.probes} == {"cache"}  # the advisor's programs


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_advise_keeps_the_learning_rate_as_plan_does_unless_base_batch_is_given():
    # The advisor plans what autoaccum.plan would with the same arguments: the rate as given,
    # scaled only when base_batch says which batch it was tuned for.
    kwargs = dict(effective_batch=16, optimizer=optax.sgd, loss_fn=mse, budget="1GiB", log=None,
                  search=autoaccum.Search(cache=False))
    kept = autoaccum.advise(LoRAMLP(rngs=nnx.Rngs(0)), DATA, learning_rate=LR, **kwargs)
    assert kept.fits and not kept.plan.lr_scaling.changed
    assert kept.plan.lr_scaling.learning_rate == LR
    scaled = autoaccum.advise(LoRAMLP(rngs=nnx.Rngs(0)), DATA, **kwargs,
                              learning_rate=autoaccum.LearningRate(value=LR, base_batch=1,
                                                                   rule="linear"))
    assert scaled.plan.lr_scaling.changed and scaled.plan.lr_scaling.learning_rate == 16 * LR
