"""Child process for tests/adapters/keras/test_distribution.py: a Keras model under Keras's own
distribution (``ModelParallel`` with a ``LayoutMap``, ``DataParallel``) on 4 host-platform CPU
devices, trained by autoaccum and by ``model.fit``.

Usage: ``python -m tests._layout_child MODE...`` under
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set by the parent, see
tests/training/test_data_parallel.py). Prints one JSON line ``RESULT {...}``.
"""

from __future__ import annotations

import io
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
import numpy as np

import autoaccum


def _data(n: int = 56) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 16)).astype("float32"),
            rng.normal(size=(n, 1)).astype("float32"))


def _model_parallel() -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices())
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*hidden/kernel"] = (None, "model")
    layout[".*hidden/bias"] = ("model",)
    layout[".*out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")


def _build(distribution, *, batch_norm: bool = True) -> keras.Model:
    with distribution.scope():
        keras.utils.set_random_seed(0)
        norm = [keras.layers.BatchNormalization()] if batch_norm else []
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(64, activation="tanh", name="hidden"),
            *norm,
            keras.layers.Dense(1, name="out"),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def _specs(variables) -> list[str]:
    return [f"{v.path} {v.value.sharding.spec} {dict(v.value.sharding.mesh.shape)}"
            for v in variables]


def _error(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))
                     / (np.max(np.abs(np.asarray(v))) + 1e-30))
               for u, v in zip(a.variables, b.variables, strict=True))


def _versus_keras(distribution, *, budget: str, batch_norm: bool = True) -> dict:
    """autoaccum.fit against model.fit(batch_size=effective_batch) under ``distribution``."""
    x, y = _data()
    keras.distribution.set_distribution(distribution)
    try:
        ref = _build(distribution, batch_norm=batch_norm)
        model = _build(distribution, batch_norm=batch_norm)
        before = _specs(model.variables)
        shardings = [v.value.sharding for v in model.variables]
        validation = (x[:20], y[:20])
        ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                validation_data=validation)
        log = io.StringIO()
        history = autoaccum.fit(model, (x, y), effective_batch=16, epochs=2, verbose=0,
                                budget=budget, log=log, validation_data=validation,
                                training=autoaccum.Training(shuffle=False))
        plan = history.autoaccum_plan
        return {
            "before": before, "after": _specs(model.variables),
            "equal": [v.value.sharding == s for v, s in zip(model.variables, shardings,
                                                            strict=True)],
            "equivalent": [v.value.sharding.is_equivalent_to(s, len(v.shape))
                           for v, s in zip(model.variables, shardings, strict=True)],
            "optimizer": _specs(model.optimizer.variables),
            "error": _error(model, ref),
            "optimizer_error": max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
                                   for u, v in zip(model.optimizer.variables,
                                                   ref.optimizer.variables, strict=True)),
            "history": history.history, "ref_history": ref.history.history,
            "plan": [plan.micro_batch, plan.accum_steps, plan.data_parallel,
                     plan.last_micro_batch],
            "report": plan.report(),
            "partitioner": [plan.partitioner, history.autoaccum_partitioner,
                            history.autoaccum_strategy],
        }
    finally:
        keras.distribution.set_distribution(None)


def model_parallel() -> dict:
    """ModelParallel: the plan's compiled step keeps the layout; fit equals model.fit."""
    from autoaccum.adapters.keras._keras_adapter import KerasAdapter
    from autoaccum.planning._measure import lower_step, measure_program
    from autoaccum.planning._plan_options import ProgramOptions

    distribution = _model_parallel()
    out = _versus_keras(distribution, budget="120KiB")
    keras.distribution.set_distribution(distribution)
    try:
        model = _build(distribution)
        x, y = _data()
        prepared = KerasAdapter().prepare(model, (x, y), effective_batch=16,
                                          options=ProgramOptions(), remat="none",
                                          remat_layers=None)
        program = prepared.program
        compiled = lower_step(program, 2, 4).compile()
        state_in = compiled.input_shardings[0][0][0]
        state_out = compiled.output_shardings[0][0]
        out["compiled_in"] = [str(s.spec) for s in state_in]
        out["compiled_out"] = [str(s.spec) for s in state_out]
        out["program_dp"] = program.data_parallel
        sharded = measure_program(program, 2, 4)
        out["sharded_trainable_bytes"] = sharded.trainable_bytes
        out["sharded_need"] = sharded.need_bytes
        # Accumulated and uneven (8 per device = 3 + 3 + 2): keras_fit against model.fit.
        from autoaccum.adapters.keras import keras_fit

        ref = _build(distribution, batch_norm=False)
        model = _build(distribution, batch_norm=False)
        ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        history = keras_fit(model, (x, y), micro_batch=3, accum_steps=3, last_micro_batch=2,
                            shuffle=False, verbose=0)
        out["uneven_error"] = _error(model, ref)
        out["uneven_loss"] = [history.history["loss"], ref.history.history["loss"]]
        out["uneven_equal"] = [str(v.value.sharding.spec) for v in model.variables]
        # autoaccum.train_step (a loop the user writes) keeps the layout too.
        ref = _build(distribution, batch_norm=False)
        model = _build(distribution, batch_norm=False)
        ref.train_on_batch(x[:16], y[:16])
        step = autoaccum.train_step(model, (x[:16], y[:16]), effective_batch=16, log=None,
                                    budget="120KiB")
        step((x[:16], y[:16]))
        out["train_step_error"] = _error(model, ref)
        out["train_step_specs"] = [str(v.value.sharding.spec) for v in model.variables]
    finally:
        keras.distribution.set_distribution(None)
    return out


def model_parallel_accumulator() -> dict:
    """ModelParallel, a model of two 512 x 1024 kernels split over 'model' (AdamW): the
    compiled step's need against its floor, whose float32 accumulator is split over the
    'batch' axis too (a device keeps its share of the sum; 1.50x the floor when XLA laid it
    out like the weights)."""
    from autoaccum.adapters.keras._keras_adapter import KerasAdapter
    from autoaccum.planning._measure import measure_program
    from autoaccum.planning._plan_options import ProgramOptions

    distribution = _model_parallel()
    keras.distribution.set_distribution(distribution)
    try:
        with distribution.scope():
            model = keras.Sequential([
                keras.Input((512,)),
                keras.layers.Dense(1024, activation="tanh", name="hidden"),
                keras.layers.Dense(512, name="out"),
            ])
            model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
        data = (np.zeros((16, 512), "float32"), np.zeros((16, 512), "float32"))
        program = KerasAdapter().prepare(model, data, effective_batch=16,
                                         options=ProgramOptions(), remat="none",
                                         remat_layers=None).program
        out = {}
        for micro, accum in ((1, 4), (4, 1)):  # per device; 2 devices on the 'batch' axis
            est = measure_program(program, 2 * micro, accum)
            out[f"{micro} x {accum}"] = est.need_bytes / est.floor_bytes
        return out
    finally:
        keras.distribution.set_distribution(None)


def data_parallel() -> dict:
    """DataParallel over the 4 devices: replicated variables stay so; fit equals model.fit
    (no BatchNormalization: autoaccum's data-parallel step normalizes each device's
    micro-batch, Keras's DataParallel the whole batch)."""
    return _versus_keras(keras.distribution.DataParallel(), budget="120KiB", batch_norm=False)


def errors() -> dict:
    """Where the layout cannot be kept, the error names the variable or the option."""
    out = {}
    distribution = _model_parallel()
    x, y = _data()
    keras.distribution.set_distribution(distribution)
    try:
        model = _build(distribution)
        try:
            autoaccum.fit(model, (x, y), effective_batch=16, log=None,
                          verbose=0, target=autoaccum.Target(data_parallel=2))
        except ValueError as error:
            out["data_parallel"] = str(error)
        model = _build(distribution)
        other = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
        model.layers[-1].kernel._value = jax.device_put(
            np.asarray(model.layers[-1].kernel.value),
            jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec()))
        try:
            autoaccum.plan(model, (x, y), effective_batch=16, log=None)
        except ValueError as error:
            out["other_mesh"] = str(error)
        model = _build(distribution)
        try:
            autoaccum.plan(model, (x, y), effective_batch=15, log=None)
        except ValueError as error:
            out["effective_batch"] = str(error)
    finally:
        keras.distribution.set_distribution(None)
    return out


def keras_hub_layout_map() -> dict:
    """A keras-hub backbone laid out by its own ``get_layout_map`` (Gemma: weights split over
    both mesh axes), trained with accumulation: the same as ``model.fit``."""
    import keras_hub

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices())
    distribution = keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch")

    def build():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=128, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=32, intermediate_dim=64, head_dim=8)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["accuracy"])
        return model

    rng = np.random.default_rng(0)
    ids = rng.integers(1, 128, size=(16, 12)).astype("int32")
    mask = np.ones((16, 12), bool)
    mask[::3, 8:] = False  # padded examples: unequal valid tokens per device
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y, w = ids[:, 1:], mask[:, 1:].astype("float32")
    keras.distribution.set_distribution(distribution)
    try:
        ref, model = build(), build()
        shardings = [v.value.sharding for v in model.variables]
        ref.fit(x, y, sample_weight=w, batch_size=8, epochs=1, shuffle=False, verbose=0)
        history = autoaccum.fit(model, x, y, sample_weight=w, effective_batch=8, epochs=1,
                                verbose=0, log=None, budget="256KiB",
                                training=autoaccum.Training(shuffle=False))
        plan = history.autoaccum_plan
        return {
            "specs": [str(s.spec) for s in shardings],
            "kept": all(v.value.sharding == s for v, s in zip(model.variables, shardings,
                                                              strict=True)),
            "error": _error(model, ref),
            "loss": [history.history["loss"][0], ref.history.history["loss"][0]],
            "plan": [plan.micro_batch, plan.accum_steps, plan.data_parallel],
        }
    finally:
        keras.distribution.set_distribution(None)


MODES = {"model_parallel": model_parallel, "model_parallel_accumulator": model_parallel_accumulator,
         "data_parallel": data_parallel, "errors": errors,
         "keras_hub_layout_map": keras_hub_layout_map}


if __name__ == "__main__":
    results = {mode: MODES[mode]() for mode in sys.argv[1:]}
    print("RESULT " + json.dumps(results))
