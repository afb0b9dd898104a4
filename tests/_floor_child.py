"""Child process for tests/training/test_sharded_floor.py: what a sharded step holds per
device against its floor, on several host-platform CPU devices.

Usage: ``python -m tests._floor_child MODE...`` under
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set by the parent). Prints one JSON
line ``RESULT {...}`` that the parent asserts on.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.planning._measure import compile_lowered, lower_step


class DotReluDot(nnx.Module):
    """Flax's "Scale up on multiple devices" model: two square kernels split over the
    'model' axis of a ('data', 'model') mesh (column- then row-wise)."""

    def __init__(self, dim: int, rngs: nnx.Rngs, *, annotate: bool = True):
        init = nnx.initializers.lecun_normal()

        def part(spec):
            return nnx.with_partitioning(init, spec) if annotate else init

        self.w1 = nnx.Param(part((None, "model"))(rngs.params(), (dim, dim)))
        self.w2 = nnx.Param(part(("model", None))(rngs.params(), (dim, dim)))

    def __call__(self, x):
        return jax.nn.relu(x @ self.w1) @ self.w2


def square_loss(model, batch):
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["x"].shape[0]


def _compiled(program, micro_batch: int, accum_steps: int):
    compiled = compile_lowered(lower_step(program, micro_batch, accum_steps))
    m = compiled.memory_analysis()
    need = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    gathers = [line.strip()[:200] for line in compiled.as_text().splitlines()
               if " all-gather(" in line]
    return {"need": int(need), "temp": int(m.temp_size_in_bytes), "all_gathers": gathers}


def kept() -> dict:
    """A model whose kernels are split over a ('data', 'model') mesh, kept as laid out:
    the compiled step at micro-batch 1 and 64 (2 micro-batches each)."""
    dim = 256
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = DotReluDot(dim, nnx.Rngs(0))
    spec = {"x": jax.ShapeDtypeStruct((dim,), jnp.float32),
            "y": jax.ShapeDtypeStruct((dim,), jnp.float32)}
    program = flax_program(model, spec, loss_fn=square_loss, tx=optax.adamw(1e-3))
    return {"strategy": program.placement is not None and "own",
            "weight_shard_bytes": dim * dim * 4 // 2,
            "micro": {str(b): _compiled(program, b, 2) for b in (1, 64)}}


class EmbedProject(nnx.Module):
    """A model of a few large matrices: an embedding and an output projection."""

    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.project = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        return self.project(jnp.tanh(self.embed(tokens)))


def next_token_loss(model, batch):
    tokens = batch["tokens"]
    losses = optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]),
                                                            tokens[:, 1:])
    return jnp.sum(losses), losses.size


def _max_relative_error(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def fsdp_few_large() -> dict:
    """An embedding + projection model with AdamW on 4 devices, planned under a per-device
    budget of 2.5x its weights, fit for two steps against the same fit on one device."""
    import autoaccum

    vocab, dim = 2048, 128
    make = lambda: EmbedProject(vocab, dim, nnx.Rngs(0))  # noqa: E731
    weights = 2 * vocab * dim * 4
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, vocab, size=(32, 9)).astype(np.int32)}
    options = dict(effective_batch=16, optimizer=optax.adamw, learning_rate=1e-3,
                   loss_fn=next_token_loss, log=None, search=autoaccum.Search(cache=False))
    budget = int(2.5 * weights)
    plan = autoaccum.plan(make(), data, budget=budget, **options)
    model, ref = make(), make()
    result = autoaccum.fit(model, data, plan=plan, epochs=1, verbose=0,
                           **{k: v for k, v in options.items() if k != "search"},
                           training=autoaccum.Training(shuffle=False))
    ref_result = autoaccum.fit(ref, data, budget="1GiB", epochs=1, verbose=0, **options,
                               target=autoaccum.Target(data_parallel=1),
                               training=autoaccum.Training(shuffle=False))
    return {"weights": weights, "budget": budget, "strategy": plan.strategy,
            "partitioner": plan.partitioner, "devices": plan.data_parallel,
            "need": plan.need_bytes, "floor": plan.floor_bytes,
            "json_floor": plan.to_dict()["floor_bytes"],
            "report_floor": "floor" in plan.report(),
            "steps": [result.steps, ref_result.steps],
            "params_error": _max_relative_error(nnx.state(model, nnx.Param),
                                                nnx.state(ref, nnx.Param))}


def explicit() -> dict:
    """Models built and fit inside ``jax.set_mesh`` of an ``Explicit`` mesh (what
    ``jax.make_mesh`` makes): one split over its 'model' axis, one not split; each against
    one full-batch SGD step of its own on one device."""
    import autoaccum

    dim = 64
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(16, dim)).astype(np.float32),
            "y": rng.normal(size=(16, dim)).astype(np.float32)}
    options = dict(effective_batch=16, optimizer=optax.sgd, learning_rate=0.1,
                   loss_fn=square_loss, log=None, budget="1GiB",
                   search=autoaccum.Search(cache=False))

    def own_step(params, graphdef):
        def mean_loss(p):
            total, count = square_loss(nnx.merge(graphdef, p), data)
            return total / count

        return jax.tree.map(lambda w, g: w - 0.1 * g, params, jax.grad(mean_loss)(params))

    out = {}
    for name, annotate in (("split", True), ("unsplit", False)):
        with jax.set_mesh(mesh):
            model = DotReluDot(dim, nnx.Rngs(0), annotate=annotate)
            result = autoaccum.fit(model, data, epochs=1, verbose=0, **options,
                                   training=autoaccum.Training(shuffle=False))
        graphdef, params = nnx.split(DotReluDot(dim, nnx.Rngs(0), annotate=False))
        ref = jax.jit(own_step, static_argnums=1)(params, graphdef)
        out[name] = {"strategy": result.plan.strategy, "steps": result.steps,
                     "specs": sorted({str(v.sharding.spec) for v in
                                      jax.tree.leaves(nnx.state(model, nnx.Param))}),
                     "error": _max_relative_error(
                         jax.tree.leaves(nnx.state(model, nnx.Param)),
                         jax.tree.leaves(ref))}
    return out


def _keras_mlp(inputs: int, hidden: int, optimizer: Any) -> tuple:
    """32 random regression examples ``(x, y)`` and ``make()``: a seeded, compiled two-layer
    Keras MLP (``inputs -> hidden -> 1``) with ``optimizer()``, MSE."""
    import keras

    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, inputs)).astype(np.float32)
    y = rng.normal(size=(32, 1)).astype(np.float32)

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(hidden),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=optimizer(), loss="mse")
        return model

    return x, y, make


def keras_data_parallel_fsdp() -> dict:
    """A Keras model fit with ``strategy="fsdp"`` under ``keras.distribution.DataParallel``
    (every variable replicated, Keras's rule) and with no distribution: the variables'
    shardings after each fit, and the first against ``model.fit`` on one device."""
    import keras

    import autoaccum

    x, y, make = _keras_mlp(32, 64, lambda: keras.optimizers.SGD(0.05, momentum=0.9))

    def specs(model):
        return sorted({str(v.value.sharding.spec) for v in model.trainable_variables})

    options = dict(effective_batch=16, epochs=1, verbose=0, log=None, budget="1GiB",
                   search=autoaccum.Search(cache=False),
                   training=autoaccum.Training(shuffle=False),
                   target=autoaccum.Target(strategy="fsdp"))
    ref = make()
    ref.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        under = make()
        history = autoaccum.fit(under, (x, y), **options)
    finally:
        keras.distribution.set_distribution(None)
    plain = make()
    plain_history = autoaccum.fit(plain, (x, y), **options)
    return {"strategies": [history.autoaccum_strategy, plain_history.autoaccum_strategy],
            "under_distribution": specs(under), "without": specs(plain),
            "error": _max_relative_error([v.value for v in under.trainable_variables],
                                         [v.value for v in ref.trainable_variables])}


def _flax_partitioners() -> dict:
    """The few-large model planned zero2 and fsdp on 4 devices: who the planner chose, both
    steps' needs at the plan's split, and each partitioner's fit against one device's."""
    import dataclasses

    import autoaccum

    vocab, dim = 2048, 128
    make = lambda: EmbedProject(vocab, dim, nnx.Rngs(0))  # noqa: E731
    weights = 2 * vocab * dim * 4
    data = {"tokens": np.random.default_rng(0).integers(0, vocab, size=(32, 9)).astype(
        np.int32)}
    options = dict(effective_batch=16, optimizer=optax.adamw, learning_rate=1e-3,
                   loss_fn=next_token_loss, log=None)
    training = autoaccum.Training(shuffle=False)
    ref = make()
    autoaccum.fit(ref, data, budget="1GiB", epochs=1, verbose=0, **options, training=training,
                  target=autoaccum.Target(data_parallel=1))
    out: dict = {}
    for strategy in ("zero2", "fsdp"):
        plan = autoaccum.plan(make(), data, budget="1GiB", search=autoaccum.Search(cache=False),
                              target=autoaccum.Target(strategy=strategy), **options)
        at_split = [p for p in plan.probes if (p.micro_batch, p.accum_steps)
                    == (plan.micro_batch, plan.accum_steps) and p.strategy == strategy]
        row = {"partitioner": plan.partitioner, "split": plan.split_text(),
               "need": plan.need_bytes, "json": plan.to_dict()["partitioner"],
               "needs": {p.partitioner: p.need_bytes for p in at_split},
               "notes": [n for n in plan.notes if n.startswith("partitioner")], "fits": {}}
        for partitioner in ("autoaccum", "xla"):
            model = make()
            result = autoaccum.fit(model, data, plan=dataclasses.replace(
                plan, partitioner=partitioner), epochs=1, verbose=0, **options,
                training=training)
            row["fits"][partitioner] = {
                "steps": result.steps,
                "error": _max_relative_error(nnx.state(model, nnx.Param),
                                             nnx.state(ref, nnx.Param)),
                "specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(
                    nnx.state(model, nnx.Param))})}
        out[strategy] = row
    # autoaccum's zero2 step does not fit 2.7x the weights at any split; XLA's fits at 4 x 1.
    try:
        plan = autoaccum.plan(make(), data, budget=int(2.7 * weights),
                              search=autoaccum.Search(cache=False),
                              target=autoaccum.Target(strategy="zero2"), **options)
        out["fallback"] = {"partitioner": plan.partitioner, "split": plan.split_text(),
                           "ratio": plan.need_bytes / weights,
                           "probes": [p.partitioner for p in plan.probes],
                           "notes": [n for n in plan.notes if n.startswith("partitioner")]}
    except autoaccum.DoesNotFitError as error:
        out["fallback"] = {"error": str(error).splitlines()[0]}
    out.update(_xla_beyond_autoaccums_split(make, weights, options))
    return out


def _xla_beyond_autoaccums_split(make, weights: int, options: dict) -> dict:
    """The few-large model on 33-token rows, where the need grows with the micro-batch:
    zero2 under 3x its weights (autoaccum's step fits micro-batch 1, XLA's a larger one) and
    under 2.3x (neither fits)."""
    import autoaccum

    vocab = 2048
    data = {"tokens": np.random.default_rng(1).integers(0, vocab, size=(64, 33)).astype(
        np.int32)}
    options = {**options, "effective_batch": 32}
    probes = lambda found: [{"partitioner": p.partitioner, "micro": p.micro_batch,  # noqa: E731
                             "need": p.need_bytes, "fits": p.fits} for p in found.probes]
    out: dict = {}
    for name, ratio in (("wider", 3.0), ("neither", 2.3)):
        try:
            plan = autoaccum.plan(make(), data, budget=int(ratio * weights),
                                  search=autoaccum.Search(cache=False),
                                  target=autoaccum.Target(strategy="zero2"), **options)
            out[name] = {"partitioner": plan.partitioner, "micro": plan.micro_batch,
                         "split": plan.split_text(), "need": plan.need_bytes,
                         "budget": int(ratio * weights), "probes": probes(plan),
                         "notes": [n for n in plan.notes if n.startswith("partitioner")]}
        except autoaccum.DoesNotFitError as error:
            out[name] = {"error": str(error), "probes": probes(error)}
    return out


def _keras_partitioners() -> dict:
    """A Keras model planned zero2 on 4 devices, fit with XLA's partitioning of the step and
    with autoaccum's, each against ``model.fit`` on one device."""
    import dataclasses

    import keras

    import autoaccum

    x, y, make = _keras_mlp(256, 128, lambda: keras.optimizers.Adam(1e-2))

    ref = make()
    ref.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    options = dict(effective_batch=16, log=None)
    plan = autoaccum.plan(make(), (x, y), search=autoaccum.Search(cache=False), budget="1GiB",
                          target=autoaccum.Target(strategy="zero2"), **options)
    out: dict = {"planned": plan.partitioner}
    for partitioner in ("autoaccum", "xla"):
        model = make()
        history = autoaccum.fit(model, (x, y), plan=dataclasses.replace(
            plan, partitioner=partitioner), epochs=1, verbose=0,
            training=autoaccum.Training(shuffle=False), **options)
        out[partitioner] = {
            "strategy": history.autoaccum_strategy,
            "partitioner": history.autoaccum_partitioner,
            "error": _max_relative_error([v.value for v in model.trainable_variables],
                                         [v.value for v in ref.trainable_variables])}
    return out


def partitioners() -> dict:
    """Both partitioners of a strategy's step (autoaccum's and XLA's): the planner's choice
    and the fits, Flax and Keras."""
    return {"flax": _flax_partitioners(), "keras": _keras_partitioners()}


MODES = {"kept": kept, "fsdp_few_large": fsdp_few_large, "explicit": explicit,
         "keras_data_parallel_fsdp": keras_data_parallel_fsdp, "partitioners": partitioners}


if __name__ == "__main__":
    results = {name: MODES[name]() for name in sys.argv[1:]}
    print("RESULT " + json.dumps(results), flush=True)
