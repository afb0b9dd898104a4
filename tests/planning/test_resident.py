"""A "no" in seconds: what no micro-batch can avoid is known from shapes, and planning stops
before any compile when it exceeds the budget; the search wastes no compile either (no
whole batch after micro-batch 1 fails, no full-depth compile when arguments and outputs
alone are over the budget). Compiles are counted with ``compile_count``."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

import autoaccum
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.planning._budget import (
    Budget,
    Resident,
    check_resident,
    resident_of,
    smallest_profile,
    split_resident,
)
from autoaccum.planning._depth import DepthVariants, plan_by_depth
from autoaccum.planning._lr_scaling import scale_learning_rate
from autoaccum.planning._measure import CompileTarget, MemoryEstimate, compile_count
from autoaccum.planning._plan_model import ruled_out_by_less_sharding
from autoaccum.planning._search import DoesNotFitError, Probe
from autoaccum.planning._strategies import state_layout


class MLP(nnx.Module):
    def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def mse(model, batch):
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["y"].shape[0]


def data(width: int, n: int = 16) -> dict:
    return {"x": np.ones((n, width), np.float32), "y": np.zeros((n, width), np.float32)}


def test_resident_is_read_from_abstract_shapes_per_category():
    model = nnx.eval_shape(lambda: MLP(64, 2, nnx.Rngs(0)))
    spec = {"x": jax.ShapeDtypeStruct((64,), jnp.float32),
            "y": jax.ShapeDtypeStruct((64,), jnp.float32)}
    program = flax_program(model, spec, loss_fn=mse, tx=optax.adam(1e-3))
    resident = resident_of(program)
    params = 2 * (64 * 64 + 64) * 4
    assert resident.trainable_bytes == params
    assert resident.gradient_bytes == params  # float32 accumulator
    assert 2 * params <= resident.optimizer_bytes <= 2 * params + 64  # mu, nu and a count
    assert resident.state_bytes == resident.trainable_bytes + resident.optimizer_bytes
    assert resident.accumulating_bytes == resident.state_bytes + params


def test_fsdp_on_four_devices_holds_a_quarter_of_the_weights_gradients_and_optimizer_state():
    w = [jax.ShapeDtypeStruct((64, 64), np.float32)]
    layout = state_layout("fsdp", AbstractMesh((4,), ("data",)), params=w, optimizer=w)
    r = split_resident(layout, trainable=w, frozen=[], optimizer=w, other=[])
    assert (r.trainable_bytes, r.gradient_bytes, r.optimizer_bytes) == (4096, 4096, 4096)


def test_a_state_over_the_budget_says_by_how_much_and_that_nothing_was_compiled():
    assert check_resident(Resident(0, 4, 4, 8, 0), 100) is None
    with pytest.raises(ValueError) as info:
        check_resident(Resident(0, 40, 40, 80, 0), 100)
    assert str(info.value).splitlines()[0] == (
        "No micro-batch can fit: the weights and optimizer state alone need 120 B, over the "
        "budget of 100 B by 20 B (known from shapes, nothing compiled).")


def test_state_over_the_budget_is_refused_before_any_compile():
    model = MLP(256, 2, nnx.Rngs(0))  # 0.5 MiB of float32 weights, 1.5 MiB with Adam
    before = compile_count()
    with pytest.raises(DoesNotFitError) as info:
        autoaccum.plan(model, data(256), effective_batch=8, optimizer=optax.adam(1e-3),
                       loss_fn=mse, budget="1MiB", log=None,
                       search=autoaccum.Search(method="compile", cache=False))
    assert compile_count() == before  # nothing compiled
    error = info.value
    assert error.resident.trainable_bytes == 2 * (256 * 256 + 256) * 4
    assert error.resident.state_bytes > error.budget_bytes == 2**20
    assert error.probes == ()
    assert error.smallest_profile == "t4"
    message = str(error)
    assert "nothing compiled" in message and "trainable weights" in message
    assert "optimizer state" in message and "t4" in message
    as_json = error.to_dict()
    assert as_json["fits"] is False
    assert as_json["resident"]["trainable_weights_bytes"] == error.resident.trainable_bytes
    assert as_json["smallest_profile"] == "t4"
    json.dumps(as_json)
    assert "trainable weights" in error._repr_html_()


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_state_that_fits_is_planned_as_before():
    plan = autoaccum.plan(MLP(16, 2, nnx.Rngs(0)), data(16), effective_batch=8,
                          optimizer=optax.adam(1e-3), loss_fn=mse, budget="64MiB",
                          log=None,
                          search=autoaccum.Search(method="compile", cache=False))
    assert plan.micro_batch * plan.accum_steps == 8


def test_no_accumulating_step_is_compiled_when_the_accumulator_cannot_fit():
    # state (weights + Adam) 3P fits, state + the float32 accumulator 4P does not: only the
    # whole batch (no accumulation loop) can fit, so only it is compiled.
    model = MLP(512, 1, nnx.Rngs(0))
    spec = {"x": jax.ShapeDtypeStruct((512,), jnp.float32),
            "y": jax.ShapeDtypeStruct((512,), jnp.float32)}
    resident = resident_of(flax_program(model, spec, loss_fn=mse, tx=optax.adam(1e-3)))
    budget = (resident.state_bytes + resident.accumulating_bytes) // 2
    before = compile_count()
    with pytest.raises(DoesNotFitError) as info:
        autoaccum.plan(model, data(512), effective_batch=8, optimizer=optax.adam(1e-3),
                       loss_fn=mse, budget=budget, log=None,
                       search=autoaccum.Search(method="compile", remat="none", cache=False))
    assert compile_count() == before + 1
    assert [(p.micro_batch, p.accum_steps) for p in info.value.probes] == [(8, 1)]


class Wide(nnx.Module):
    """A few weights, a large input: every step's batch argument dominates its need."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones((4,), jnp.float32))

    def __call__(self, x):
        return x * jnp.sum(self.w)


def test_no_whole_batch_probe_once_micro_batch_1_fails():
    # The batch (8 x 1 MiB x 2 inputs, in every split) is over the budget: micro-batch 2
    # and 1 fail, and the whole batch, which needs at least as much, is not compiled.
    width = 262144
    before = compile_count()
    with pytest.raises(DoesNotFitError) as info:
        autoaccum.plan(Wide(nnx.Rngs(0)), data(width), effective_batch=8,
                       optimizer=optax.sgd(0.1), loss_fn=mse, budget="8MiB",
                       log=None,
                       search=autoaccum.Search(method="compile", remat="none", cache=False,
                                               uneven=False))
    probed = [p.micro_batch for p in info.value.probes]
    assert probed == [2, 1]
    assert compile_count() == before + 2


class Stack(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for block in self.blocks:
            x = jax.nn.relu(block(x))
        return x


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_no_full_depth_compile_when_arguments_and_outputs_alone_exceed_the_budget():
    spec = {"x": jax.ShapeDtypeStruct((128,), jnp.float32),
            "y": jax.ShapeDtypeStruct((128,), jnp.float32)}

    def build(depth):
        model = nnx.eval_shape(lambda: Stack(depth, nnx.Rngs(0)))
        return flax_program(model, spec, loss_fn=mse, tx=optax.adam(1e-3))

    full = resident_of(build(16))
    # A target whose rematerialization pass would act (so the extrapolation alone would
    # call for full-depth compiles), and a budget below the state at full depth.
    target = CompileTarget(remat_pass_base_bytes=1)
    before = compile_count()
    with pytest.raises(DoesNotFitError) as info:
        plan_by_depth(DepthVariants(full_depth=16, build=build), effective_batch=8,
                      lr_scaling=scale_learning_rate(None, effective_batch=8),
                      budget=Budget(full.state_bytes // 2, "user", ""), target=target,
                      log=None)
    assert compile_count() == before + 4  # depths 2 and 3 at micro-batches 2 and 1
    assert all(p.estimate.source == "extrapolated" for p in info.value.probes)


def test_smallest_profile_holding_a_size():
    assert smallest_profile(1).key == "t4"
    assert smallest_profile(10 * 2**30).key == "t4"
    assert smallest_profile(10 * 2**40) is None
    assert smallest_profile(30 * 2**30).key in {"a100-40gb", "v100-32gb"}
    assert smallest_profile(2**50) is None


def test_a_strategy_is_not_compiled_where_a_less_sharded_miss_minus_its_split_is_over():
    estimate = MemoryEstimate(1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 120, "t", 0.0)
    missed = DoesNotFitError("no", probes=(Probe(1, 4, 120, False, "", estimate),),
                             budget_bytes=100)
    state = {"replicated": Resident(0, 4, 4, 8, 0), "zero1": Resident(0, 4, 4, 4, 0)}
    why = ruled_out_by_less_sharding("zero1", [("replicated", missed)], state.get)
    assert str(why)[:37] == "not compiled: micro_batch=1 needs at "
    state["zero1"] = Resident(0, 4, 4, 0, 0)  # splits off enough: compile it
    assert ruled_out_by_less_sharding("zero1", [("replicated", missed)], state.get) is None
