"""Child process for tests/test_data_parallel.py: runs on several host-platform CPU devices.

Usage: ``python -m tests._dp_child MODE...`` under
``XLA_FLAGS=--xla_force_host_platform_device_count=4``
(set by the parent). Prints one JSON line ``RESULT {...}`` that the parent asserts on.
"""

from __future__ import annotations

import io
import json
import os
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from autoaccum.adapters.flax._nnx_program import flax_program, make_flax_step, split_model
from autoaccum.devices._mesh import data_parallel_mesh, replicate, shard_batches
from autoaccum.training._data_parallel import data_parallel_accumulate
from tests._models import TinyLM, ragged_tokens, token_loss


def _max_relative_error(a, b) -> float:
    errors = jax.tree.map(
        lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)), a, b)
    return max(jax.tree.leaves(errors))


def flax_exact(devices: int = 4, micro: int = 2, accum: int = 2) -> dict:
    """One DP step (devices x micro x accum) against the single-device full-batch step."""
    effective = devices * micro * accum
    data = ragged_tokens(effective, 10, seed=3)
    tx = optax.adam(1e-2)
    model = TinyLM(rngs=nnx.Rngs(1))
    graphdef, params, frozen, other = split_model(model, nnx.Param)
    full = jax.jit(make_flax_step(graphdef, loss_fn=token_loss, tx=tx, trainable=nnx.Param))
    ref_state, ref_metrics = full((params, other, tx.init(params)),
                                  jax.tree.map(lambda a: a[None], data), frozen)

    mesh = data_parallel_mesh(jax.devices()[:devices])
    program = flax_program(model, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:],
                                                                               a.dtype), data),
                           loss_fn=token_loss, tx=tx, mesh=mesh)
    batches = jax.tree.map(lambda a: a.reshape(accum, devices * micro, *a.shape[1:]), data)
    per_device = batches["mask"][:, :, 1:].reshape(accum, devices, micro, -1).sum(axis=(0, 2, 3))
    state = replicate((params, other, tx.init(params)), mesh)
    placed = shard_batches(batches, mesh)
    step = jax.jit(program.step, donate_argnums=0)
    hlo = step.lower(state, placed, replicate(frozen, mesh)).compile().as_text()
    new_state, metrics = step(state, placed, replicate(frozen, mesh))
    return {
        "params_error": _max_relative_error(new_state[0], ref_state[0]),
        "loss": float(metrics.loss), "ref_loss": float(ref_metrics.loss),
        "count": float(metrics.count), "ref_count": float(ref_metrics.count),
        "valid_per_device": per_device.tolist(),
        "batch_sharding": str(placed["tokens"].sharding.spec),
        "param_sharding": str(jax.tree.leaves(new_state[0])[0].sharding.spec),
        "all_reduces": hlo.count("all_reduce") + hlo.count("all-reduce"),
    }


def carry_policy() -> dict:
    """Integer carry: device 0's; float carry: the mean over devices."""
    mesh = data_parallel_mesh()

    def micro_loss(w, carry, mb):
        ints, floats = carry
        return ((jnp.sum(mb * w), jnp.float32(mb.shape[0])),
                (ints + jnp.int32(jnp.sum(mb)), floats + jnp.sum(mb)))

    accumulate = data_parallel_accumulate(mesh)
    batches = jnp.arange(16, dtype=jnp.float32).reshape(2, 8)  # device d: [2d, 2d+1, 2d+8, 2d+9]
    acc = jax.jit(lambda b: accumulate(micro_loss, jnp.float32(1.0),
                                       (jnp.int32(0), jnp.float32(0)), b))(batches)
    return {"int_carry": int(acc.carry[0]), "float_carry": float(acc.carry[1]),
            "grad_sum": float(acc.grad_sum), "count": float(acc.count)}


def keras_exact() -> dict:
    """Keras: keras_fit over 4 devices (2 x 4 x 2) equals one full-batch step of 16."""
    import keras

    from autoaccum.adapters.keras import keras_fit

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    w = (rng.random(16) > 0.3).astype("float32")  # unequal weight per device
    ref = build()
    ref_hist = keras_fit(ref, (x, y, w), micro_batch=16, accum_steps=1, shuffle=False, verbose=0)
    dp = build()
    hist = keras_fit(dp, (x, y, w), micro_batch=2, accum_steps=2, data_parallel=4,
                     shuffle=False, verbose=0)
    ragged = build()  # 22 examples: the epoch's last 6 do not split over 4 devices
    extra = (np.concatenate([x, x[:6]]), np.concatenate([y, y[:6]]), np.concatenate([w, w[:6]]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        left = keras_fit(ragged, extra, micro_batch=2, accum_steps=2, data_parallel=4,
                         shuffle=False, verbose=0).autoaccum_remainder
    out = {
        "ragged_remainder": left,
        "weights_error": _max_relative_error([v.value for v in dp.trainable_variables],
                                             [v.value for v in ref.trainable_variables]),
        "loss": hist.history["loss"][-1], "ref_loss": ref_hist.history["loss"][-1],
        "mae": hist.history["mae"][-1], "ref_mae": ref_hist.history["mae"][-1],
        "iterations": int(dp.optimizer.iterations),
        "data_parallel": hist.autoaccum_data_parallel,
    }
    # autoaccum.fit plans and trains over every device by default.
    import autoaccum

    model = build()
    hist = autoaccum.fit(model, (x, y, w), effective_batch=16, budget="64MiB", verbose=0,
                         log=None,
                         training=autoaccum.Training(shuffle=False),
                         learning_rate=autoaccum.LearningRate(rule="none"))
    plan = hist.autoaccum_plan
    out["fit_plan"] = [plan.micro_batch, plan.data_parallel, plan.accum_steps]
    out["fit_weights_error"] = _max_relative_error(
        [v.value for v in model.trainable_variables], [v.value for v in ref.trainable_variables])
    # keras.distribution.DataParallel set: keras_fit uses its mesh by default.
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:2]))
    try:
        model = build()
        hist = keras_fit(model, (x, y, w), micro_batch=4, accum_steps=2, shuffle=False,
                         verbose=0)
        out["distribution_data_parallel"] = hist.autoaccum_data_parallel
        out["distribution_weights_error"] = _max_relative_error(
            [v.value for v in model.trainable_variables],
            [v.value for v in ref.trainable_variables])
    finally:
        keras.distribution.set_distribution(None)
    return out


def keras_train_step() -> dict:
    """Keras: ``autoaccum.train_step`` over 4 devices (2 x 4 x 2, and a leftover of 8) equals
    ``train_on_batch`` on one device."""
    import keras

    import autoaccum

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5)).astype("float32")
    y = rng.normal(size=(24, 1)).astype("float32")
    w = (rng.random(24) > 0.3).astype("float32")  # unequal weight per device
    ref, model = build(), build()
    step = autoaccum.train_step(model, (x, y, w), effective_batch=16, budget="64MiB",
                                log=None,
                                target=autoaccum.Target(data_parallel=4),
                                learning_rate=autoaccum.LearningRate(base_batch=16))
    out: dict = {"plan": [step.plan.micro_batch, step.plan.data_parallel,
                          step.plan.accum_steps], "losses": [], "ref_losses": []}
    for part in (slice(0, 16), slice(16, 24)):
        got = step((x[part], y[part], w[part]))
        expected = ref.train_on_batch(x[part], y[part], sample_weight=w[part],
                                      return_dict=True)
        out["losses"].append(got.logs["loss"])
        out["ref_losses"].append(expected["loss"])
    out["weights_error"] = _max_relative_error(
        [v.value for v in model.trainable_variables], [v.value for v in ref.trainable_variables])
    out["iterations"] = int(model.optimizer.iterations)
    return out


def plans() -> dict:
    """Plan arithmetic, per-device budgets, the non-multiple error and a DP fit."""
    import autoaccum
    from autoaccum.planning._targets import resolve_target

    model = TinyLM(rngs=nnx.Rngs(0))
    data = ragged_tokens(64, 16)
    options = {"optimizer": optax.adam, "learning_rate": 1e-3, "loss_fn": token_loss}
    p4 = autoaccum.plan(model, data, effective_batch=32, budget="6MiB", log=None,
                        **options,
                        target=autoaccum.Target(data_parallel="auto"),
                        search=autoaccum.Search(method="compile"))
    p1 = autoaccum.plan(model, data, effective_batch=32, budget="6MiB", log=None,
                        **options,
                        target=autoaccum.Target(data_parallel=1),
                        search=autoaccum.Search(method="compile"))
    from autoaccum.devices._mesh import data_parallel_mesh as mesh_of

    dp_budget = resolve_target(None, None, mesh=mesh_of()).budget
    one_budget = resolve_target(None, None).budget
    try:
        autoaccum.plan(model, data, effective_batch=30, log=None, **options,
                       target=autoaccum.Target(data_parallel=4))
        error = ""
    except ValueError as e:
        error = str(e)
    est4 = autoaccum.measure(model, data, micro_batch=2, accum_steps=2, **options,
                             target=autoaccum.Target(data_parallel=4))
    est1 = autoaccum.measure(model, data, micro_batch=2, accum_steps=2, **options,
                             target=autoaccum.Target(data_parallel=1))
    log = io.StringIO()
    result = autoaccum.fit(model, data, effective_batch=32, budget="6MiB", epochs=2,
                           verbose=1, log=log, **options)
    return {
        "p4": [p4.micro_batch, p4.data_parallel, p4.accum_steps, p4.effective_batch],
        "p1": [p1.micro_batch, p1.data_parallel, p1.accum_steps, p1.effective_batch],
        "p4_budget": p4.budget_bytes, "p4_need": p4.need_bytes,
        "p4_report": p4.report(),
        "dp_budget": dp_budget.bytes, "one_budget": one_budget.bytes,
        "dp_budget_detail": dp_budget.detail,
        "error": error,
        "need4": est4.need_bytes, "need1": est1.need_bytes,
        "batch4": est4.batch_bytes, "batch1": est1.batch_bytes,
        "fit_steps": result.steps, "fit_losses": result.losses,
        "fit_data_parallel": result.plan.data_parallel,
        "fit_noise": [v for v in result.noise_scale if v is not None][:1],
        "fit_log": log.getvalue(),
    }


def elastic() -> dict:
    """Out of memory above per-device micro-batch 2: redone smaller on every device, same result."""
    import dataclasses

    import autoaccum
    from autoaccum.adapters.flax._nnx_fit import flax_fit

    def check(tokens):
        if tokens.shape[0] > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1234 bytes (fake)")
        return np.float32(0)

    def failing_loss(model, batch):
        total, count = token_loss(model, batch)
        zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), batch["tokens"])
        return total + zero, count

    data = ragged_tokens(64, 8, seed=4)
    model = TinyLM(rngs=nnx.Rngs(1))
    plan = autoaccum.plan(model, data, effective_batch=32, budget="1GiB", log=None,
                          optimizer=optax.adam, learning_rate=1e-2,
                          loss_fn=token_loss,
                          search=autoaccum.Search(method="compile", remat="none"))
    plan = dataclasses.replace(plan, micro_batch=8, data_parallel=4, accum_steps=1)
    mesh = data_parallel_mesh()
    reference = TinyLM(rngs=nnx.Rngs(1))
    ref = flax_fit(reference, data, plan=plan, loss_fn=token_loss, tx=optax.adam(1e-2),
                   verbose=0, mesh=mesh, shuffle=False)
    result = flax_fit(model, data, plan=plan, loss_fn=failing_loss, tx=optax.adam(1e-2),
                      verbose=0, stream=io.StringIO(), mesh=mesh, shuffle=False)
    diff = _max_relative_error(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param))
    return {"plan": [plan.micro_batch, plan.data_parallel, plan.accum_steps],
            "end": [result.micro_batch, result.accum_steps], "events": result.events,
            "steps": result.steps, "losses": result.losses, "ref_losses": ref.losses,
            "params_error": diff, "noise": result.noise_scale}


def flax_uneven(devices: int = 4, per_device: int = 7, micro: int = 3) -> dict:
    """One DP step whose per-device batch ends with a smaller micro-batch (7 = 3 + 3 + 1 on
    each device) against the single-device full-batch step."""
    from autoaccum.training._epoch_batches import split_micro_batches

    effective = devices * per_device
    data = ragged_tokens(effective, 10, seed=5)
    tx = optax.adam(1e-2)
    model = TinyLM(rngs=nnx.Rngs(2))
    graphdef, params, frozen, other = split_model(model, nnx.Param)
    full = jax.jit(make_flax_step(graphdef, loss_fn=token_loss, tx=tx, trainable=nnx.Param))
    ref_state, ref_metrics = full((params, other, tx.init(params)),
                                  jax.tree.map(lambda a: a[None], data), frozen)
    mesh = data_parallel_mesh(jax.devices()[:devices])
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    program = flax_program(model, spec, loss_fn=token_loss, tx=tx, mesh=mesh)
    batches = split_micro_batches(data, micro_batch=micro, data_parallel=devices)
    placed = shard_batches(batches, mesh)
    state = replicate((params, other, tx.init(params)), mesh)
    new_state, metrics = jax.jit(program.step, donate_argnums=0)(state, placed,
                                                                 replicate(frozen, mesh))
    return {
        "params_error": _max_relative_error(new_state[0], ref_state[0]),
        "loss": float(metrics.loss), "ref_loss": float(ref_metrics.loss),
        "count": float(metrics.count), "ref_count": float(ref_metrics.count),
        "full_shape": list(placed.full["tokens"].shape),
        "last_shape": list(placed.last["tokens"].shape),
        "last_sharding": str(placed.last["tokens"].sharding.spec),
    }


def flax_stream(devices: int = 4) -> dict:
    """autoaccum.fit over 4 devices on a generator of batches of 5 (36 examples, effective
    batch 8: four steps and a leftover of 4, one example per device) against the same
    examples in memory on one device."""
    import autoaccum

    data = ragged_tokens(36, 10, seed=3)
    options = dict(effective_batch=8, optimizer=optax.sgd(0.1, momentum=0.9),
                   loss_fn=token_loss, training=autoaccum.Training(shuffle=False),
                   budget="256MiB", verbose=0, log=None)

    def batches():
        for start in range(0, 36, 5):
            yield {k: v[start:start + 5] for k, v in data.items()}

    ref = TinyLM(rngs=nnx.Rngs(4))
    ref_result = autoaccum.fit(ref, data, **options,
                               target=autoaccum.Target(data_parallel=1))
    model = TinyLM(rngs=nnx.Rngs(4))
    result = autoaccum.fit(model, batches(), **options,
                           target=autoaccum.Target(data_parallel=devices))
    return {
        "params_error": _max_relative_error(nnx.state(model, nnx.Param),
                                            nnx.state(ref, nnx.Param)),
        "steps": [result.steps, ref_result.steps],
        "leftover": result.leftover_examples,
        "data_parallel": result.plan.data_parallel,
    }


MODES = {"flax_exact": flax_exact, "flax_uneven": flax_uneven, "carry_policy": carry_policy,
         "keras_exact": keras_exact, "plans": plans, "elastic": elastic,
         "keras_train_step": keras_train_step, "flax_stream": flax_stream}


if __name__ == "__main__":
    results = {name: MODES[name]() for name in sys.argv[1:]}
    print("RESULT " + json.dumps(results), flush=True)
