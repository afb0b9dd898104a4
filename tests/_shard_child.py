"""Child process for tests/training/test_strategies.py: sharding strategies on several
host-platform CPU devices.

Usage: ``python -m tests._shard_child MODE...`` under
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (set by the parent). Prints one JSON line
``RESULT {...}`` that the parent asserts on.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from autoaccum.adapters.flax._nnx_program import flax_program, make_flax_step, split_model
from autoaccum.devices._mesh import data_parallel_mesh, place, replicate, shard_batches
from autoaccum.internal import STRATEGIES
from autoaccum.planning._measure import measure_program
from autoaccum.training._epoch_batches import split_micro_batches
from tests._models import TinyLM, ragged_tokens, token_loss


def _max_relative_error(a, b) -> float:
    """Largest relative error over the floating leaves (RNG keys and counters skipped)."""
    def one(x, y):
        if not jnp.issubdtype(jnp.asarray(y).dtype, jnp.floating):
            return 0.0
        return float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - y))
                     / (jnp.max(jnp.abs(jnp.asarray(y, jnp.float32))) + 1e-30))

    return max(jax.tree.leaves(jax.tree.map(one, a, b)))


def _specs(tree) -> list[str]:
    return sorted({str(x.sharding.spec) for x in jax.tree.leaves(tree)})


def _lm() -> TinyLM:
    # Every weight matrix has >= 1024 elements and a dimension 4 and 8 divide: all are split.
    return TinyLM(vocab=64, dim=32, hidden=64, rngs=nnx.Rngs(1))


def _sharded_step(model, data, tx, loss_fn, mesh, strategy, batches):
    """One step of ``strategy`` on ``mesh``; returns (new state, metrics, HLO text)."""
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    program = flax_program(model, spec, loss_fn=loss_fn, tx=tx, mesh=mesh, strategy=strategy)
    _, params, frozen, other = split_model(model, nnx.Param)
    state = (params, other, tx.init(params))
    state = (replicate(state, mesh) if program.state_shardings is None
             else place(state, program.state_shardings))
    placed = shard_batches(batches, mesh)
    step = jax.jit(program.step, donate_argnums=0)
    compiled = step.lower(state, placed, replicate(frozen, mesh)).compile()
    new_state, metrics = compiled(state, placed, replicate(frozen, mesh))
    return new_state, metrics, compiled.as_text()


def _full_batch_step(model, data, tx):
    """(new state, metrics) of one single-device step of ``model`` on all of ``data``."""
    graphdef, params, frozen, other = split_model(model, nnx.Param)
    full = jax.jit(make_flax_step(graphdef, loss_fn=token_loss, tx=tx, trainable=nnx.Param))
    return full((params, other, tx.init(params)), jax.tree.map(lambda a: a[None], data), frozen)


def exact(strategies=STRATEGIES, splits=(("even", 4, 2), ("uneven", 7, 3), ("one", 2, 2)),
          needs: bool = True) -> dict:
    """Every strategy's step (N devices x micro 2 x accum 2, an uneven 7 = 3 + 3 + 1 per
    device, and one micro-batch of 2 per device: nothing accumulated) against the
    single-device full-batch step; shardings of the new state; the per-device need of each
    strategy."""
    devices = len(jax.devices())
    mesh = data_parallel_mesh()
    tx = optax.adam(1e-2)
    out: dict = {"devices": devices}
    for name, per_device, micro in splits:
        data = ragged_tokens(devices * per_device, 10, seed=3)
        ref_state, ref_metrics = _full_batch_step(_lm(), data, tx)
        batches = split_micro_batches(data, micro_batch=micro, data_parallel=devices)
        for strategy in strategies:
            state, metrics, hlo = _sharded_step(_lm(), data, tx, token_loss, mesh, strategy,
                                                batches)
            out[f"{name}/{strategy}"] = {
                "params_error": _max_relative_error(state[0], ref_state[0]),
                "opt_error": _max_relative_error(state[2], ref_state[2]),
                "loss_error": abs(float(metrics.loss) - float(ref_metrics.loss))
                / abs(float(ref_metrics.loss)),
                "count": [float(metrics.count), float(ref_metrics.count)],
                "param_specs": _specs(state[0]), "opt_specs": _specs(state[2]),
                "reduce_scatters": hlo.count("reduce-scatter"),
                "all_gathers": hlo.count("all-gather"),
            }
    spec = {"tokens": jax.ShapeDtypeStruct((10,), jnp.int32),
            "mask": jax.ShapeDtypeStruct((10,), jnp.int32)}
    for strategy in strategies if needs else ():
        program = flax_program(_lm(), spec, loss_fn=token_loss, tx=tx, mesh=mesh,
                               strategy=strategy)
        est = measure_program(program, 2, 4)
        out[f"need/{strategy}"] = est.need_bytes
    return out


def batchnorm() -> dict:
    """A BatchNorm model: each strategy over 4 devices equals one device running the same
    micro-batches (weights, optimizer state, and the effective batch statistics)."""
    from tests.adapters.flax._stateful import NormMLP, mse_loss, regression

    devices = len(jax.devices())
    mesh = data_parallel_mesh()
    data = regression(devices * 6, features=32, seed=2)
    tx = optax.adam(1e-2)
    make = lambda: NormMLP(features=32, hidden=64, dropout=0.0, rngs=nnx.Rngs(3))  # noqa: E731
    micro = 2
    batches = split_micro_batches(data, micro_batch=micro, data_parallel=devices)
    # One device, the same micro-batches ([accum, devices * micro] -> [accum * devices, micro]).
    single = jax.tree.map(lambda a: a.reshape(-1, micro, *a.shape[2:]), batches)
    model = make()
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    one = flax_program(model, spec, loss_fn=mse_loss, tx=tx)
    _, params, frozen, other = split_model(model, nnx.Param)
    ref_state, _ = jax.jit(one.step)((params, other, tx.init(params)), single, frozen)
    out = {}
    for strategy in STRATEGIES:
        state, _, _ = _sharded_step(make(), data, tx, mse_loss, mesh, strategy, batches)
        out[strategy] = {"params_error": _max_relative_error(state[0], ref_state[0]),
                         "stats_error": _max_relative_error(state[1], ref_state[1]),
                         "stats_changed": _max_relative_error(state[1], other) > 1e-3}
    return out


def planned() -> dict:
    """A budget the replicated step exceeds on every device: the planner picks the cheapest
    strategy that fits, fit trains with it exactly as one device does, and the trained
    weights keep the strategy's sharding."""
    import autoaccum

    # SGD with momentum: linear in the gradients, so two runs that sum in another order agree
    # to float32 rounding after several steps (Adam's g / sqrt(v) turns rounding noise of
    # near-zero gradients into whole learning-rate steps). Its state is a weight-sized tree.
    def tx_factory(rate):
        return optax.sgd(rate, momentum=0.9)

    data = ragged_tokens(64, 10, seed=7)
    mesh = data_parallel_mesh()
    spec = {"tokens": jax.ShapeDtypeStruct((10,), jnp.int32),
            "mask": jax.ShapeDtypeStruct((10,), jnp.int32)}
    per_device = 32 // mesh.size
    needs = {}
    for strategy in STRATEGIES:  # micro-batch 1, what the planner asks of each strategy
        program = flax_program(_lm(), spec, loss_fn=token_loss, tx=tx_factory(0.1),
                               mesh=mesh, strategy=strategy)
        needs[strategy] = measure_program(program, 1, per_device).need_bytes
    best = min(needs.values())
    # Over what replicated, zero1 and zero2 need, above the least: the answer is the most
    # sharded strategy when it needs the least.
    budget = int((best + min(v for k, v in needs.items() if needs[k] > best)) / 2)
    expected = next(s for s in STRATEGIES if needs[s] <= budget)
    options = dict(effective_batch=32, optimizer=tx_factory, learning_rate=0.1,
                   loss_fn=token_loss, log=None, search=autoaccum.Search(cache=False))
    model = _lm()
    result = autoaccum.fit(model, data, budget=budget, epochs=1, verbose=0,
                           **options, training=autoaccum.Training(shuffle=False))
    plan = result.plan
    ref = _lm()
    ref_result = autoaccum.fit(ref, data, budget="1GiB", epochs=1,
                               verbose=0, **options,
                               target=autoaccum.Target(data_parallel=1),
                               training=autoaccum.Training(shuffle=False))
    return {
        "needs": needs, "budget": budget, "expected": expected,
        "strategy": plan.strategy, "fit_strategy": result.plan.strategy,
        "micro_batch": plan.micro_batch, "need": plan.need_bytes,
        "json": {k: plan.to_dict()[k] for k in ("strategy", "devices", "mesh_shape")},
        "probe_strategies": sorted({p.strategy for p in plan.probes}),
        "report_has_strategy": f"{plan.strategy}:" in plan.report(),
        "params_error": _max_relative_error(nnx.state(model, nnx.Param),
                                            nnx.state(ref, nnx.Param)),
        "steps": [result.steps, ref_result.steps],
        "param_specs": _specs(nnx.state(model, nnx.Param)),
    }


def train_step_and_elastic() -> dict:
    """``autoaccum.train_step`` with ``strategy="fsdp"`` equals one device; an out-of-memory
    in a sharded fit is redone at a smaller micro-batch from the restored sharded state."""
    import autoaccum
    from autoaccum.adapters.flax._nnx_fit import flax_fit

    data = ragged_tokens(64, 10, seed=4)
    def sgd(rate):  # linear in the gradients (see planned())
        return optax.sgd(rate, momentum=0.9)

    options = dict(effective_batch=32, optimizer=sgd, learning_rate=0.1,
                   loss_fn=token_loss, log=None, search=autoaccum.Search(cache=False),
                   budget="1GiB")
    model, ref = _lm(), _lm()
    step = autoaccum.train_step(model, data, **options,
                                target=autoaccum.Target(strategy="fsdp", data_parallel=4))
    ref_step = autoaccum.train_step(ref, data, **options,
                                    target=autoaccum.Target(data_parallel=1))
    for start in (0, 32):
        batch = {k: v[start:start + 32] for k, v in data.items()}
        out, ref_out = step(batch), ref_step(batch)
    train_step = {
        "strategy": step.plan.strategy, "steps": [out.step, ref_out.step],
        "loss_error": abs(out.loss - ref_out.loss) / abs(ref_out.loss),
        "params_error": _max_relative_error(nnx.state(model, nnx.Param),
                                            nnx.state(ref, nnx.Param)),
        "param_specs": _specs(nnx.state(model, nnx.Param)),
        "opt_specs": _specs(step.opt_state),
    }

    def check(tokens):
        if tokens.shape[0] > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1234 bytes (fake)")
        return np.float32(0)

    def failing_loss(model, batch):
        total, count = token_loss(model, batch)
        zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), batch["tokens"])
        return total + zero, count

    plan = autoaccum.plan(_lm(), data,
                          **{k: v for k, v in options.items() if k not in ("log", "search")},
                          log=None,
                          target=autoaccum.Target(strategy="zero2"),
                          search=autoaccum.Search(method="compile", remat="none", cache=False))
    # The fake out-of-memory is raised by a callback on each device's own micro-batch: a
    # shard_map step's (under XLA's partitioning one device would raise while the others
    # wait in an all-reduce).
    plan = dataclasses.replace(plan, micro_batch=8, accum_steps=1, partitioner="autoaccum")
    mesh = data_parallel_mesh()
    model, ref = _lm(), _lm()
    ref_result = flax_fit(ref, data, plan=plan, loss_fn=token_loss, tx=sgd(0.1),
                          verbose=0, mesh=mesh, shuffle=False)
    result = flax_fit(model, data, plan=plan, loss_fn=failing_loss, tx=sgd(0.1),
                      verbose=0, stream=io.StringIO(), mesh=mesh, shuffle=False)
    elastic = {
        "strategy": plan.strategy, "end": [result.micro_batch, result.accum_steps],
        "events": len(result.events), "steps": [result.steps, ref_result.steps],
        "params_error": _max_relative_error(nnx.state(model, nnx.Param),
                                            nnx.state(ref, nnx.Param)),
    }
    return {"train_step": train_step, "elastic": elastic}


def exact_uneven_sharded() -> dict:
    """The sharded strategies on an uneven split (for 8 devices: one compile each)."""
    return exact(strategies=("zero2", "fsdp"), splits=(("uneven", 7, 3),), needs=False)


class _AnnotatedLM(nnx.Module):
    """TinyLM's layers with FSDP annotations (``nnx.with_partitioning``), as the JAX AI stack
    tutorials write them; built under ``jax.set_mesh`` the weights arrive split."""

    def __init__(self, rngs: nnx.Rngs, *, annotate: bool = True):
        normal, lecun = nnx.initializers.normal(), nnx.initializers.lecun_normal()

        def part(init, spec):
            return nnx.with_partitioning(init, spec) if annotate else init

        self.embed = nnx.Embed(64, 32, embedding_init=part(normal, ("fsdp", None)), rngs=rngs)
        self.up = nnx.Linear(32, 64, kernel_init=part(lecun, (None, "fsdp")), rngs=rngs)
        self.down = nnx.Linear(64, 64, kernel_init=part(lecun, ("fsdp", None)), rngs=rngs)

    def __call__(self, tokens):
        return self.down(jax.nn.gelu(self.up(self.embed(tokens))))


def _runs_under(mesh, model) -> str:
    """"" when ``model.up`` (a Linear split over the mesh) runs under ``jax.set_mesh(mesh)``
    (the user's mesh, ``Explicit`` axes), else the error."""
    with jax.set_mesh(mesh):
        try:
            nnx.jit(lambda m, x: m.up(x))(model, jnp.ones((4, 32), jnp.float32))
            return ""
        except Exception as error:  # reported to the test
            return f"{type(error).__name__}: {error}"[:300]


def own_sharding() -> dict:
    """A model whose weights arrive split over a one-axis ('fsdp',) mesh keeps that sharding
    through plan and fit, and trains as the same model on one device; a one-device plan,
    and a ('batch', 'model') mesh over other devices than asked for, are refused with a
    clear error."""
    import autoaccum

    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))
    with jax.set_mesh(mesh):
        model = _AnnotatedLM(nnx.Rngs(0))
    before = {k: _spec_text(v) for k, v in _weights(model).items()}
    runs_before = _runs_under(mesh, model)
    ref = _AnnotatedLM(nnx.Rngs(0), annotate=False)
    data = ragged_tokens(64, 10, seed=1)

    def sgd(rate):
        return optax.sgd(rate, momentum=0.9)

    opts = dict(effective_batch=32, optimizer=sgd, learning_rate=0.1, loss_fn=token_loss,
                log=None, search=autoaccum.Search(cache=False), budget="1GiB")
    plan = autoaccum.plan(model, data, **opts)
    result = autoaccum.fit(model, data, verbose=0, plan=plan,
                           **{k: v for k, v in opts.items() if k not in ("budget", "search")},
                           training=autoaccum.Training(shuffle=False))
    ref_result = autoaccum.fit(ref, data, verbose=0, **opts,
                               target=autoaccum.Target(data_parallel=1),
                               training=autoaccum.Training(shuffle=False))
    after = {k: _spec_text(v) for k, v in _weights(model).items()}
    axes = sorted({str(v.sharding.mesh.axis_names) for v in _weights(model).values()})
    on_users_mesh = all(v.sharding.mesh == mesh for v in _weights(model).values())
    runs_after = _runs_under(mesh, model)
    errors = {}
    try:
        autoaccum.plan(model, data, **opts,
                       target=autoaccum.Target(data_parallel=1))
    except ValueError as error:
        errors["one_device"] = str(error)
    with jax.set_mesh(jax.make_mesh((2, len(jax.devices()) // 2), ("batch", "model"))):
        tp = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "model")), rngs=nnx.Rngs(0))

    def mse(m, b):
        return jnp.sum(m(b["x"]) ** 2), b["x"].shape[0]

    try:  # kept over a ('batch', 'model') mesh, but not on the devices asked for
        autoaccum.plan(tp, {"x": np.ones((16, 32), np.float32)}, effective_batch=8,
                       optimizer=optax.sgd, learning_rate=0.1, loss_fn=mse, log=None,
                       budget="1GiB", target=autoaccum.Target(data_parallel=2))
    except ValueError as error:
        errors["other_devices"] = str(error)
    return {
        "before": before, "after": after, "axes": axes,
        "on_users_mesh": on_users_mesh, "runs_under_users_mesh": [runs_before, runs_after],
        "plan_devices": plan.data_parallel, "notes": [n for n in plan.notes if "own" in n],
        "steps": [result.steps, ref_result.steps],
        # (leaves: the annotated model's variables carry sharding metadata the plain one lacks)
        "params_error": _max_relative_error(jax.tree.leaves(nnx.state(model, nnx.Param)),
                                            jax.tree.leaves(nnx.state(ref, nnx.Param))),
        "errors": errors,
    }


class _PartlySplitLM(nnx.Module):
    """Some weights split over 'fsdp' by the model itself, others (``up``: a 32 x 1024 kernel
    and a 1024 bias) left whole for the strategy to lay out."""

    def __init__(self, rngs: nnx.Rngs, *, annotate: bool = True):
        normal, lecun = nnx.initializers.normal(), nnx.initializers.lecun_normal()

        def part(init, spec):
            return nnx.with_partitioning(init, spec) if annotate else init

        self.embed = nnx.Embed(64, 32, embedding_init=part(normal, ("fsdp", None)), rngs=rngs)
        self.up = nnx.Linear(32, 1024, rngs=rngs)
        self.down = nnx.Linear(1024, 64, kernel_init=part(lecun, ("fsdp", None)), rngs=rngs)

    def __call__(self, tokens):
        return self.down(jax.nn.gelu(self.up(self.embed(tokens))))


def own_split_strategies() -> dict:
    """A model that splits some weights over its one-axis ('fsdp',) mesh and leaves others
    whole: autoaccum's step under every strategy (accumulating, and one micro-batch: the
    gradients of whole weights split under zero2, and zero1 with one micro-batch) equals the
    same model's full-batch step on one device."""
    from jax.sharding import Mesh

    devices = len(jax.devices())
    users = jax.make_mesh((devices,), ("fsdp",))
    mesh = Mesh(users.devices, ("fsdp",))  # the automatic-axes copy autoaccum runs on
    tx = optax.sgd(0.1, momentum=0.9)  # (Adam's update of a near-zero gradient is its sign)
    out: dict = {}
    for name, per_device, micro in (("accumulated", 4, 2), ("one", 2, 2)):
        data = ragged_tokens(devices * per_device, 10, seed=3)
        ref_state, ref_metrics = _full_batch_step(_PartlySplitLM(nnx.Rngs(0), annotate=False),
                                                  data, tx)
        batches = split_micro_batches(data, micro_batch=micro, data_parallel=devices)
        for strategy in STRATEGIES:
            with jax.set_mesh(users):
                model = _PartlySplitLM(nnx.Rngs(0))
            state, metrics, _ = _sharded_step(model, data, tx, token_loss, mesh, strategy,
                                              batches)
            out[f"{name}/{strategy}"] = {
                # (leaves: the annotated model's variables carry sharding metadata)
                "params_error": _max_relative_error(jax.tree.leaves(state[0]),
                                                    jax.tree.leaves(ref_state[0])),
                "loss_error": abs(float(metrics.loss) - float(ref_metrics.loss))
                / abs(float(ref_metrics.loss))}
    return out


def own_abstract_and_deviceless() -> dict:
    """A model built abstractly (``nnx.eval_shape``) on an ``AbstractMesh`` plans as the same
    model built on real devices does (one-axis and ('data', 'model') meshes); a model split
    over a one-axis mesh of its own plans for a TPU slice (deviceless) over the slice's
    axis; what cannot be kept is refused with a clear error."""
    import importlib.util

    from jax.sharding import AbstractMesh

    import autoaccum

    data = ragged_tokens(64, 10, seed=1)
    opts = dict(effective_batch=32, optimizer=optax.adamw, learning_rate=1e-3,
                loss_fn=token_loss, log=None, search=autoaccum.Search(cache=False),
                budget="1GiB")

    def planned(model, **more):
        p = autoaccum.plan(model, data, **opts, **more)
        return {"strategy": p.strategy, "data_parallel": p.data_parallel,
                "micro_batch": p.micro_batch, "need": p.estimate.need_bytes}

    out: dict = {}
    for name, shape, axes in (("one_axis", (4,), ("fsdp",)),
                              ("two_axes", (2, 2), ("data", "fsdp"))):
        with jax.sharding.use_abstract_mesh(AbstractMesh(shape, axes)):
            abstract = nnx.eval_shape(lambda: _AnnotatedLM(nnx.Rngs(0)))
        with jax.set_mesh(jax.make_mesh(shape, axes, devices=jax.devices()[:4])):
            real = _AnnotatedLM(nnx.Rngs(0))
        out[name] = {"abstract": planned(abstract), "real": planned(real)}
    with jax.set_mesh(jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])):
        real = _AnnotatedLM(nnx.Rngs(0))
        narrow = nnx.Linear(8, 20, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "fsdp")), rngs=nnx.Rngs(0))
    errors = {}
    if importlib.util.find_spec("libtpu") is not None:
        plan = autoaccum.plan(real, data, **{**opts, "budget": None}, device="v5e-4")
        out["v5e_4"] = {"data_parallel": plan.data_parallel,
                        "notes": [n for n in plan.notes if "own sharding" in n]}
        with jax.set_mesh(jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4])):
            kept = _AnnotatedLM(nnx.Rngs(0))  # a ('data', 'fsdp') layout, kept as it is
        for key, model, device in (("one_chip", real, "v5e-1"),
                                   ("kept_one_chip", kept, "v5e-1"),
                                   ("indivisible", narrow, "v5e-8")):
            try:
                data_ = data if model is not narrow else {"x": np.ones((32, 8), np.float32)}
                loss = token_loss if model is not narrow else (
                    lambda m, b: (jnp.sum(m(b["x"]) ** 2), b["x"].shape[0]))
                autoaccum.plan(model, data_, **{**opts, "budget": None, "loss_fn": loss},
                               device=device)
            except ValueError as error:
                errors[key] = str(error)
    with jax.sharding.use_abstract_mesh(AbstractMesh((8,), ("fsdp",))):
        too_big = nnx.eval_shape(lambda: _AnnotatedLM(nnx.Rngs(0)))
    try:
        autoaccum.plan(too_big, data, **opts)
    except ValueError as error:
        errors["too_few_devices"] = str(error)
    out["errors"] = errors
    return out


class _Block(nnx.Module):
    """A transformer block written as the JAX AI stack's miniGPT tutorial writes it:
    attention and MLP kernels split over the mesh's 'model' axis with
    ``nnx.with_partitioning``, layer norms replicated (no dropout, for exact comparisons)."""

    def __init__(self, dim: int, heads: int, ff: int, *, rngs: nnx.Rngs, annotate: bool):
        xavier, zeros = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init()

        def part(init, spec):
            return nnx.with_partitioning(init, spec) if annotate else init

        self.mha = nnx.MultiHeadAttention(
            num_heads=heads, in_features=dim, kernel_init=part(xavier, (None, "model")),
            bias_init=part(zeros, ("model",)), decode=False, rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, epsilon=1e-6, rngs=rngs)
        self.linear1 = nnx.Linear(dim, ff, kernel_init=part(xavier, (None, "model")),
                                  bias_init=part(zeros, ("model",)), rngs=rngs)
        self.linear2 = nnx.Linear(ff, dim, kernel_init=part(xavier, ("model", None)),
                                  rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, epsilon=1e-6, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = self.norm1(x + self.mha(x, mask=mask))
        return self.norm2(x + self.linear2(nnx.relu(self.linear1(x))))


class _MiniGPT(nnx.Module):
    """A tiny miniGPT (token and position embeddings split (None, 'model'), blocks, an
    output layer split (None, 'model')); built under ``jax.set_mesh`` its weights arrive
    split over a ('batch', 'model') mesh."""

    def __init__(self, rngs: nnx.Rngs, *, annotate: bool = True, vocab: int = 32,
                 maxlen: int = 16, dim: int = 16, heads: int = 4, ff: int = 32,
                 blocks: int = 1):
        normal = nnx.initializers.normal()

        def part(init, spec):
            return nnx.with_partitioning(init, spec) if annotate else init

        self.tokens = nnx.Embed(vocab, dim, embedding_init=part(normal, (None, "model")),
                                rngs=rngs)
        self.positions = nnx.Embed(maxlen, dim, embedding_init=part(normal, (None, "model")),
                                   rngs=rngs)
        self.blocks = nnx.List([_Block(dim, heads, ff, rngs=rngs, annotate=annotate)
                                for _ in range(blocks)])
        self.out = nnx.Linear(dim, vocab, kernel_init=part(nnx.initializers.xavier_uniform(),
                                                           (None, "model")), rngs=rngs)

    def __call__(self, tokens):
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1])[None])
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _tree_relative_error(a, b) -> float:
    """max |a - b| / max |b| over all the leaves together. (Per leaf it would divide by the
    attention key bias's update, which is 0 up to rounding: softmax ignores it.)"""
    diff = max(float(jnp.max(jnp.abs(jnp.asarray(x) - jnp.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return diff / max(float(jnp.max(jnp.abs(jnp.asarray(y)))) for y in jax.tree.leaves(b))


def _full_batch_sgd(model, data, rate):
    """One full-batch optax step (SGD with momentum) on one device: the reference (one
    compiled program: op by op, its few hundred operations each compiled on their own for
    the split weights took 5 s)."""
    tx = optax.sgd(rate, momentum=0.9)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def step(params, rest, data):
        def mean_loss(p):
            total, count = token_loss(nnx.merge(graphdef, p, rest), data)
            return total / count

        grads = jax.grad(mean_loss)(params)
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    return step(params, rest, data)


def own_mesh() -> dict:
    """A miniGPT-like model split over a 2 x 2 ('batch', 'model') mesh keeps its layout
    through plan and fit (batches split over 'batch'), and one accumulated step (even and
    uneven micro-batches) equals one full-batch step on one device; a (1, 4) mesh plans
    tensor parallelism alone; a named strategy and an ambiguous data axis are refused."""
    import autoaccum
    from autoaccum.adapters.flax._nnx_program import flax_program

    mesh = jax.make_mesh((2, 2), ("batch", "model"))
    data = ragged_tokens(8, 10, seed=5)
    opts = dict(effective_batch=8, optimizer=lambda r: optax.sgd(r, momentum=0.9),
                learning_rate=0.1, loss_fn=token_loss, log=None,
                search=autoaccum.Search(cache=False), budget="1GiB")
    with jax.set_mesh(mesh):
        probe = _MiniGPT(nnx.Rngs(0))
    plan = autoaccum.plan(probe, data, **opts)
    out: dict = {"plan": {k: plan.to_dict()[k] for k in ("strategy", "devices", "mesh_shape",
                                                         "mesh_axes", "data_parallel")},
                 "report": "own: the model's own layout" in plan.report(),
                 "groups": [x for x in plan.report().splitlines() if "group" in x],
                 "notes": [n for n in plan.notes if n.startswith("layout:")]}
    expected = _full_batch_sgd(_MiniGPT(nnx.Rngs(0), annotate=False), data, 0.1)
    fit_opts = {k: v for k, v in opts.items() if k not in ("budget", "search")}
    for name, micro, accum, last in (("even", 2, 2, None), ("uneven", 3, 2, 1)):
        with jax.set_mesh(mesh):
            model = _MiniGPT(nnx.Rngs(0))
        before = {k: v.sharding for k, v in _weights(model).items()}
        forced = dataclasses.replace(plan, micro_batch=micro, accum_steps=accum,
                                     last_micro_batch=last)
        result = autoaccum.fit(model, data, plan=forced, verbose=0, **fit_opts,
                               training=autoaccum.Training(shuffle=False))
        after = {k: v.sharding for k, v in _weights(model).items()}
        out[name] = {
            "steps": result.steps, "split": [result.micro_batch, result.accum_steps],
            "params_error": _tree_relative_error(nnx.state(model, nnx.Param), expected),
            "same_shardings": after == before,
            "specs": {k: _spec_text(v) for k, v in _weights(model).items()
                      if k in ("tokens.embedding", "blocks.0.linear1.kernel",
                               "blocks.0.linear2.kernel", "blocks.0.norm1.scale")},
        }
    # autoaccum.train_step (your own loop) runs the same kept-layout step.
    with jax.set_mesh(mesh):
        model = _MiniGPT(nnx.Rngs(0))
    step = autoaccum.train_step(model, data, **opts,
                                target=autoaccum.Target(data_parallel="auto"))
    output = step(data)
    out["train_step"] = {
        "step": output.step, "strategy": step.plan.strategy,
        "params_error": _tree_relative_error(nnx.state(model, nnx.Param), expected),
        "specs": sorted({_spec_text(x) for x in jax.tree.leaves(step.opt_state)
                         if getattr(x, "ndim", 0) == 2}),
    }
    # The optimizer moments and the per-device need: the placed program's own view.
    spec = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in data.items()}
    program = flax_program(probe, spec, loss_fn=token_loss, tx=optax.adam(1e-3))
    shardings = jax.tree.map(lambda s: s.spec, program.placement.state)
    mu = jax.tree.leaves(shardings[2][0].mu, is_leaf=lambda x: isinstance(x, P))
    weights = jax.tree.leaves(shardings[0], is_leaf=lambda x: isinstance(x, P))
    est = measure_program(program, 2, 2)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.abstract_state)
                if jnp.issubdtype(x.dtype, jnp.floating))
    out["moments_like_weights"] = mu == weights
    measured = autoaccum.measure(probe, data, micro_batch=2, effective_batch=8,
                                 **{k: v for k, v in opts.items()
                                    if k not in ("effective_batch", "budget", "log")})
    out["measure"] = [measured.micro_batch, measured.accum_steps,
                      measured.need_bytes > 0]
    out["argument_bytes"], out["whole_state_bytes"] = est.argument_bytes, whole
    # Tensor parallelism alone: every device reads the whole batch.
    with jax.set_mesh(jax.make_mesh((1, 4), ("batch", "model"))):
        tp = _MiniGPT(nnx.Rngs(0))
    tp_plan = autoaccum.plan(tp, data, **opts)
    out["tp"] = {k: tp_plan.to_dict()[k] for k in ("strategy", "devices", "mesh_shape",
                                                   "data_parallel")}
    errors = {}
    try:
        autoaccum.plan(probe, data, **opts,
                       target=autoaccum.Target(strategy="fsdp"))
    except ValueError as error:
        errors["strategy"] = str(error)
    try:
        autoaccum.plan(probe, data, **opts,
                       target=autoaccum.Target(data_parallel=1))
    except ValueError as error:
        errors["one_device"] = str(error)
    with jax.set_mesh(jax.make_mesh((2, 2), ("data", "batch"))):
        both = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "batch")), rngs=nnx.Rngs(0))
    try:
        autoaccum.plan(both, {"x": np.ones((8, 16), np.float32)}, effective_batch=8,
                       optimizer=optax.sgd, learning_rate=0.1, log=None, budget="1GiB",
                       loss_fn=lambda m, b: (jnp.sum(m(b["x"]) ** 2), b["x"].shape[0]))
    except ValueError as error:
        errors["ambiguous"] = str(error)
    out["errors"] = errors
    return out


def _spec_text(array) -> str:
    """The array's PartitionSpec without trailing ``None`` (``P('fsdp', None)`` is
    ``P('fsdp',)``), as text."""
    spec = list(array.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return str(jax.sharding.PartitionSpec(*spec))


def _weights(model) -> dict:
    return {".".join(map(str, path)): v.get_value()
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _keras_dense(features: int = 16, hidden: int = 64, *, batch_norm: bool = False,
                 optimizer: str = "adam"):
    """A tiny Keras regression model (every kernel >= 1024 elements, split by 4 devices)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((features,)), keras.layers.Dense(hidden, activation="tanh")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Dense(hidden // 2, activation="tanh"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    # SGD with momentum for the BatchNorm model: the bias before a BatchNorm has a gradient
    # that is zero up to rounding, which Adam's g / sqrt(v) would turn into whole steps.
    opt = (keras.optimizers.Adam(1e-2) if optimizer == "adam"
           else keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    return model


def _keras_error(variables, reference) -> float:
    """Largest relative error over two lists of Keras variables (or arrays)."""
    def value(v):
        return np.asarray(getattr(v, "value", v), np.float32)

    return max((float(np.max(np.abs(value(a) - value(b))) / (np.max(np.abs(value(b))) + 1e-30))
                for a, b in zip(variables, reference, strict=True)), default=0.0)


def _keras_specs(variables) -> list[str]:
    return sorted({str(v.value.sharding.spec) for v in variables})


def _moving(model) -> list:
    return [v for v in model.non_trainable_variables if "moving" in v.path]


def keras_exact() -> dict:
    """Every strategy's accumulated Keras step over 4 devices against ``model.fit`` on the
    whole batch on one device: 16 = 2 x 4 devices x 2, and an uneven 28 = (3 + 3 + 1) x 4;
    a BatchNorm model against one device scanning the same micro-batches (its moving
    statistics against ``model.fit``'s)."""
    from autoaccum.adapters.keras import keras_fit

    devices = len(jax.devices())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7 * devices, 16)).astype(np.float32)
    y = rng.normal(size=(7 * devices, 1)).astype(np.float32)
    out: dict = {"devices": devices}
    # Adam on the even split (its two moments split); SGD with momentum on the uneven one:
    # there Adam's g / sqrt(v) turns the rounding noise of near-zero gradients (another
    # summation order, as plain data parallelism or one device's uneven split has too)
    # into 1e-5 of a kernel, whatever the strategy.
    splits = (("even", 4 * devices, dict(micro_batch=2, accum_steps=2), "adam"),
              ("uneven", 7 * devices, dict(micro_batch=3, accum_steps=3, last_micro_batch=1),
               "sgd"))
    for name, n, split, optimizer in splits:
        ref = _keras_dense(optimizer=optimizer)
        ref_history = ref.fit(x[:n], y[:n], batch_size=n, shuffle=False, verbose=0)
        for strategy in STRATEGIES:
            model = _keras_dense(optimizer=optimizer)
            history = keras_fit(model, (x[:n], y[:n]), data_parallel=devices,
                                strategy=strategy, shuffle=False, verbose=0, **split)
            out[f"{name}/{strategy}"] = {
                "params_error": _keras_error(model.trainable_variables,
                                             ref.trainable_variables),
                "opt_error": _keras_error(model.optimizer.variables, ref.optimizer.variables),
                "loss_error": abs(history.history["loss"][0] - ref_history.history["loss"][0])
                / abs(ref_history.history["loss"][0]),
                "mae_error": abs(history.history["mae"][0] - ref_history.history["mae"][0])
                / abs(ref_history.history["mae"][0]),
                "history_strategy": history.autoaccum_strategy,
                "param_specs": _keras_specs(model.trainable_variables),
                "opt_specs": _keras_specs(model.optimizer.variables),
            }
    n = 4 * devices
    same_micro = _keras_dense(batch_norm=True, optimizer="sgd")  # one device, 8 x 2
    keras_fit(same_micro, (x[:n], y[:n]), micro_batch=2, accum_steps=n // 2, data_parallel=1,
              shuffle=False, verbose=0)
    native = _keras_dense(batch_norm=True, optimizer="sgd")
    native.fit(x[:n], y[:n], batch_size=n, shuffle=False, verbose=0)
    for strategy in STRATEGIES:
        model = _keras_dense(batch_norm=True, optimizer="sgd")
        keras_fit(model, (x[:n], y[:n]), micro_batch=2, accum_steps=2, data_parallel=devices,
                  strategy=strategy, shuffle=False, verbose=0)
        out[f"batchnorm/{strategy}"] = {
            "params_error": _keras_error(model.trainable_variables,
                                         same_micro.trainable_variables),
            "opt_error": _keras_error(model.optimizer.variables,
                                      same_micro.optimizer.variables),
            "moving_error": _keras_error(_moving(model), _moving(native)),
            "moving_changed": _keras_error(_moving(model), [np.zeros(v.shape) if "mean" in
                                                            v.path else np.ones(v.shape)
                                                            for v in _moving(model)]) > 1e-3,
            "param_specs": _keras_specs(model.trainable_variables),
        }
    return out


def keras_planned() -> dict:
    """A Keras model whose replicated step exceeds a per-device budget on 4 devices: the
    planner picks the cheapest strategy that fits, fit trains with it as ``model.fit`` does
    on one device, the variables keep the strategy's layout, and Keras and a second fit run
    on them; ``strategy=`` names one for plan and train_step."""
    import autoaccum
    from autoaccum.adapters.keras._keras_program import keras_program

    devices = len(jax.devices())
    mesh = data_parallel_mesh()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    y = rng.normal(size=(64, 1)).astype(np.float32)

    def make():
        return _keras_dense(32, 256, optimizer="sgd")

    needs = {}
    for strategy in STRATEGIES:  # micro-batch 1, what the planner asks of each strategy
        program = keras_program(make(), (x, y), mesh=mesh, strategy=strategy)
        needs[strategy] = measure_program(program, 1, 32 // devices).need_bytes
    best = min(needs.values())
    budget = int((best + min(v for v in needs.values() if v > best)) / 2)
    expected = next(s for s in STRATEGIES if needs[s] <= budget)
    model, ref = make(), make()
    history = autoaccum.fit(model, (x, y), effective_batch=32, budget=budget, epochs=1,
                            verbose=0, log=None,
                            search=autoaccum.Search(cache=False),
                            training=autoaccum.Training(shuffle=False))
    plan = history.autoaccum_plan
    ref.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    first = {"params_error": _keras_error(model.trainable_variables, ref.trainable_variables),
             "opt_error": _keras_error(model.optimizer.variables, ref.optimizer.variables),
             "param_specs": _keras_specs(model.trainable_variables),
             "opt_specs": _keras_specs(model.optimizer.variables)}
    predict_error = _keras_error([model.predict(x[:8], verbose=0)],
                                 [ref.predict(x[:8], verbose=0)])
    # A second fit lays the variables out afresh (they are autoaccum's layout, not the user's).
    again = autoaccum.fit(model, (x, y), effective_batch=32, budget=budget, epochs=1,
                          verbose=0, log=None,
                          search=autoaccum.Search(cache=False),
                          training=autoaccum.Training(shuffle=False))
    ref.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    named = autoaccum.plan(make(), (x, y), effective_batch=32, budget="1GiB", log=None,
                           target=autoaccum.Target(strategy="fsdp"),
                           search=autoaccum.Search(cache=False))
    stepped, ref_step = make(), make()
    step = autoaccum.train_step(stepped, (x, y), effective_batch=32, budget="1GiB",
                                log=None,
                                target=autoaccum.Target(data_parallel=devices, strategy="zero2"),
                                search=autoaccum.Search(cache=False))
    for start in (0, 32):
        out = step((x[start:start + 32], y[start:start + 32]))
        ref_out = ref_step.train_on_batch(x[start:start + 32], y[start:start + 32],
                                          return_dict=True)
    return {
        "needs": needs, "budget": budget, "expected": expected,
        "strategy": plan.strategy, "need": plan.need_bytes, "micro_batch": plan.micro_batch,
        "json": {k: plan.to_dict()[k] for k in ("strategy", "devices", "mesh_shape")},
        "probe_strategies": sorted({p.strategy for p in plan.probes}),
        "report_line": next((line.strip() for line in plan.report().splitlines()
                             if line.strip().startswith("sharding")), ""),
        "history_strategy": history.autoaccum_strategy,
        "first": first, "predict_error": predict_error,
        "again_strategy": again.autoaccum_plan.strategy,
        "again_error": _keras_error(model.trainable_variables, ref.trainable_variables),
        "steps": int(model.optimizer.iterations),
        "named": [named.strategy, named.data_parallel],
        "train_step": {"strategy": step.plan.strategy, "steps": step.steps,
                       "loss_error": abs(out.loss - ref_out["loss"]) / abs(ref_out["loss"]),
                       "params_error": _keras_error(stepped.trainable_variables,
                                                    ref_step.trainable_variables),
                       "opt_specs": _keras_specs(stepped.optimizer.variables)},
    }


def keras_elastic() -> dict:
    """An out-of-memory in a Keras fit under fsdp (a layer that fails above 2 examples per
    device) is redone at a smaller micro-batch from the restored split state, and the run
    equals ``model.fit`` on one device."""
    import keras

    from autoaccum.adapters.keras import keras_fit

    def check(x):
        if x.shape[0] > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1234 bytes (fake)")
        return np.zeros((), np.float32)

    class FailsAboveTwo(keras.layers.Layer):
        def call(self, x):
            zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32),
                                     jax.lax.stop_gradient(x))
            return x + zero

    def make(failing: bool):
        model = _keras_dense(optimizer="sgd")
        if failing:
            model = keras.Sequential([keras.Input((16,)), FailsAboveTwo(), *model.layers])
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                          metrics=["mae"])
        return model

    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = rng.normal(size=(64, 1)).astype(np.float32)
    model, ref = make(True), make(False)
    history = keras_fit(model, (x, y), micro_batch=8, accum_steps=1, data_parallel=4,
                        strategy="fsdp", shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    return {"events": len(history.autoaccum_events),
            "end": [history.autoaccum_micro_batch, history.autoaccum_accum_steps],
            "steps": int(model.optimizer.iterations),
            "params_error": _keras_error(model.trainable_variables, ref.trainable_variables),
            "param_specs": _keras_specs(model.trainable_variables)}


class _DeepMLP(nnx.Module):
    """Eight 256 x 256 layers (2 MiB of float32 weights): the weights, not the activations,
    decide what a device needs at small micro-batches."""

    def __init__(self, width: int = 256, depth: int = 8, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def _square_loss(model, batch):
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), batch["x"].shape[0]


def _regression(n: int, width: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, width)).astype(np.float32),
            "y": rng.normal(size=(n, width)).astype(np.float32)}


def fsdp_at_use() -> dict:
    """A budget below one device's shards plus the whole weight tree (what a step that
    gathers every weight at once holds): fsdp, which gathers each weight where it is used,
    meets it, the planner picks it, and fit trains exactly as one device does."""
    import autoaccum

    mesh = data_parallel_mesh()
    make = lambda: _DeepMLP(rngs=nnx.Rngs(0))  # noqa: E731
    data = _regression(16 * mesh.size, 256, seed=4)
    spec = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in data.items()}
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(make(), nnx.Param)))
    needs, temps, args = {}, {}, {}
    for strategy in STRATEGIES:  # micro-batch 1, 2 micro-batches per device
        est = measure_program(flax_program(make(), spec, loss_fn=_square_loss,
                                           tx=optax.sgd(0.1), mesh=mesh, strategy=strategy),
                              1, 2)
        needs[strategy], temps[strategy] = est.need_bytes, est.temp_bytes
        args[strategy] = est.argument_bytes
    budget = args["fsdp"] + whole
    options = dict(effective_batch=8 * mesh.size, optimizer=optax.sgd, learning_rate=0.1,
                   loss_fn=_square_loss, log=None, search=autoaccum.Search(cache=False), epochs=1,
                   training=autoaccum.Training(shuffle=False), verbose=0)
    model, ref = make(), make()
    result = autoaccum.fit(model, data, budget=budget, **options)
    ref_result = autoaccum.fit(ref, data, budget="1GiB", **options,
                               target=autoaccum.Target(data_parallel=1))
    return {"needs": needs, "temps": temps, "args": args, "budget": budget, "whole": whole,
            "strategy": result.plan.strategy, "need": result.plan.need_bytes,
            "steps": [result.steps, ref_result.steps],
            "params_error": _max_relative_error(nnx.state(model, nnx.Param),
                                                nnx.state(ref, nnx.Param)),
            "param_specs": _specs(nnx.state(model, nnx.Param))}


class _LoRAMLP(nnx.Module):
    """Two LoRA layers over frozen 128 x 128 base kernels (rank 4)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.one = nnx.LoRA(128, 4, 128, base_module=nnx.Linear(128, 128, rngs=rngs),
                            b_initializer=nnx.initializers.normal(0.1), rngs=rngs)
        self.two = nnx.LoRA(128, 4, 128, base_module=nnx.Linear(128, 128, rngs=rngs),
                            b_initializer=nnx.initializers.normal(0.1), rngs=rngs)

    def __call__(self, x):
        return self.two(jnp.tanh(self.one(x)))


def fsdp_frozen() -> dict:
    """A LoRA model under fsdp: its frozen base kernels are split over the devices (in the
    planned step, and in the model after fit), and the adapters train exactly as on one
    device."""
    import autoaccum

    mesh = data_parallel_mesh()
    make = lambda: _LoRAMLP(rngs=nnx.Rngs(5))  # noqa: E731
    data = _regression(8 * mesh.size, 128, seed=6)
    spec = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in data.items()}
    frozen_bytes, args = {}, {}
    for strategy in ("replicated", "fsdp"):
        est = measure_program(flax_program(make(), spec, loss_fn=_square_loss,
                                           tx=optax.adam(1e-2), trainable=nnx.LoRAParam,
                                           mesh=mesh, strategy=strategy), 1, 2)
        frozen_bytes[strategy], args[strategy] = est.frozen_bytes, est.argument_bytes
    options = dict(effective_batch=4 * mesh.size, optimizer=optax.sgd, learning_rate=0.1,
                   loss_fn=_square_loss, trainable=nnx.LoRAParam, log=None,
                   search=autoaccum.Search(cache=False), epochs=1,
                   training=autoaccum.Training(shuffle=False), verbose=0, budget="1GiB")
    model, ref = make(), make()
    # Validated too: the evaluation reads the split frozen weights.
    result = autoaccum.fit(model, data, validation_data=data, **options,
                           target=autoaccum.Target(strategy="fsdp"))
    ref_result = autoaccum.fit(ref, data, validation_data=data, **options,
                               target=autoaccum.Target(data_parallel=1))
    base = nnx.state(model, nnx.Not(nnx.LoRAParam))
    return {"strategy": result.plan.strategy, "steps": [result.steps, ref_result.steps],
            "val_losses": [result.val_losses, ref_result.val_losses],
            "frozen_bytes": frozen_bytes, "args": args,
            "base_specs": {".".join(map(str, k)): _spec_text(v.get_value())
                           for k, v in nnx.to_flat_state(base) if "kernel" in k},
            "base_unchanged": _max_relative_error(base, nnx.state(make(),
                                                                  nnx.Not(nnx.LoRAParam))),
            "lora_error": _max_relative_error(nnx.state(model, nnx.LoRAParam),
                                              nnx.state(ref, nnx.LoRAParam)),
            "lora_changed": _max_relative_error(nnx.state(model, nnx.LoRAParam),
                                                nnx.state(make(), nnx.LoRAParam)) > 1e-3}


def users_other_axes() -> dict:
    """A model built whole under the user's ``("batch", "model")`` mesh (Explicit axes, JAX
    0.12's default) and fitted with fsdp, which splits it over a one-axis mesh of its own:
    afterwards every weight is back on the user's mesh, laid out as before, and the model
    runs under ``jax.set_mesh`` as before."""
    import autoaccum

    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("batch", "model"))
    with jax.set_mesh(mesh):
        model = _AnnotatedLM(nnx.Rngs(0), annotate=False)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
        before = {k: _spec_text(v) for k, v in _weights(model).items()}
        result = autoaccum.fit(model, ragged_tokens(16, 10, seed=2), effective_batch=8,
                               optimizer=optimizer, loss_fn=token_loss, log=None, verbose=0,
                               budget="1GiB", search=autoaccum.Search(cache=False),
                               target=autoaccum.Target(strategy="fsdp"))
    moments = [a for a in jax.tree.leaves(nnx.state(optimizer)) if isinstance(a, jax.Array)]
    with jax.set_mesh(mesh):  # the user's own step, the optimizer's state included
        try:
            nnx.jit(lambda m, o, x: o.update(m, nnx.grad(
                lambda m: jnp.sum(m(x) ** 2))(m)))(model, optimizer, jnp.ones((2, 10), int))
            user_step = ""
        except Exception as error:  # reported to the test
            user_step = f"{type(error).__name__}: {error}"[:300]
    return {"strategy": result.plan.strategy, "before": before,
            "after": {k: _spec_text(v) for k, v in _weights(model).items()},
            "on_users_mesh": all(v.sharding.mesh == mesh for v in _weights(model).values()),
            "moments_on_users_mesh": all(a.sharding.mesh == mesh for a in moments),
            "runs_under_users_mesh": _runs_under(mesh, model), "user_step": user_step}


MODES = {"exact": exact, "own_sharding": own_sharding, "own_mesh": own_mesh,
         "own_abstract_and_deviceless": own_abstract_and_deviceless,
         "own_split_strategies": own_split_strategies, "users_other_axes": users_other_axes,
         "keras_exact": keras_exact,
         "keras_planned": keras_planned, "keras_elastic": keras_elastic,
         "exact_uneven_sharded": exact_uneven_sharded, "batchnorm": batchnorm,
         "planned": planned,
         "train_step_and_elastic": train_step_and_elastic,
         "fsdp_at_use": fsdp_at_use, "fsdp_frozen": fsdp_frozen}


if __name__ == "__main__":
    results = {name: MODES[name]() for name in sys.argv[1:]}
    print("RESULT " + json.dumps(results), flush=True)
