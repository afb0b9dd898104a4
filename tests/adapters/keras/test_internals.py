"""The Keras behaviour behind each name of ``autoaccum.adapters.keras._internals``, on the
installed Keras (real layers, models, optimizers and scopes): when a Keras release changes one
of them, the test named after it fails, and the fix goes into that one module."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from autoaccum.adapters.keras import _internals as door

from ._models import dense_model, regression_data


def _weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


def _trained_once() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """A small model after one Keras train step (``train_on_batch``)."""
    model = dense_model(features=4)
    x, y = regression_data(8, 4)
    model.train_on_batch(x, y)
    return model, x, y


# -- the JAX trainer's state and fit bookkeeping ---------------------------------------------


@pytest.mark.slow  # the first Keras compile of a worker: about 5 s
def test_a_stale_jax_state_is_written_into_the_variables_by_a_callbacks_model_until_cleared():
    model, _, _ = _trained_once()
    before = _weights(model)
    zeros = [jnp.zeros(v.shape, v.dtype) for v in model.trainable_variables]
    callback = keras.callbacks.Callback()
    callback.set_model(model)

    door.set_jax_state(model, {"trainable_variables": zeros}, synced=False)
    assert callback.model is model  # a callback's `model` syncs the trainer's state
    assert all(not np.any(w) for w in _weights(model)[:len(zeros)])

    model.set_weights(before)
    door.set_jax_state(model, {"trainable_variables": zeros}, synced=False)
    door.set_jax_state(model, None, synced=True)  # what keras_fit does before training
    assert callback.model is model
    assert all(np.array_equal(a, b) for a, b in zip(_weights(model), before, strict=True))


def test_set_jax_state_without_synced_leaves_the_synced_flag_as_it_was():
    model, _, _ = _trained_once()
    zeros = [jnp.zeros(v.shape, v.dtype) for v in model.trainable_variables]
    door.set_jax_state(model, None, synced=False)
    door.set_jax_state(model, {"trainable_variables": zeros})  # still "not synced"
    model.jax_state_sync()
    assert not np.any(np.array(model.trainable_variables[0].value))


def test_take_initial_epoch_returns_the_epoch_backup_and_restore_restored_once(tmp_path):
    model = dense_model(features=4)
    x, y = regression_data(8, 4)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)])
    assert door.take_initial_epoch(model) is None  # nothing restored by that fit
    restore = keras.callbacks.BackupAndRestore(str(tmp_path))
    restore.set_model(model)
    restore.on_train_begin()
    assert door.take_initial_epoch(model) == 2
    assert door.take_initial_epoch(model) is None


def test_pythonify_logs_flattens_nested_logs_into_python_floats():
    logs = door.pythonify_logs({"loss": jnp.float32(1.5), "outputs": {"mae": np.float32(2.0)},
                                "note": "text"})
    assert logs == {"loss": 1.5, "mae": 2.0, "note": "text"}
    assert type(logs["loss"]) is float and type(logs["mae"]) is float


def test_metrics_result_or_logs_reads_the_metric_variables_when_the_names_match():
    model, _, _ = _trained_once()
    result = {k: float(v) for k, v in model.get_metrics_result().items()}
    assert set(result) == {"loss", "mae"}
    got = door.metrics_result_or_logs(model, {"loss": 123.0, "mae": 456.0})
    assert {k: float(v) for k, v in got.items()} == result
    other = {"something_else": 1.0}
    assert door.metrics_result_or_logs(model, other) is other


# -- layers, compile configuration, compiled loss -------------------------------------------


def test_flatten_layers_lists_every_nested_layer_once():
    inner = keras.Sequential([keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")],
                             name="inner")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="first"), inner])
    layers = door.flatten_layers(model, include_self=False)
    names = [layer.name for layer in layers if not isinstance(layer, keras.layers.InputLayer)]
    assert sorted(names) == ["a", "b", "first", "inner"]
    assert len({id(layer) for layer in layers}) == len(layers) and model not in layers
    assert door.flatten_layers(model)[0] is model
    assert door.flatten_layers(keras.layers.Dense(1), include_self=False) == []


def test_compile_arguments_are_the_objects_compile_was_given():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    loss, metric, optimizer = keras.losses.MeanSquaredError(), keras.metrics.MeanAbsoluteError(), \
        keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss=loss, metrics=[metric], loss_weights=0.5)
    arguments = door.compile_arguments(model)
    assert arguments["loss"] is loss and arguments["metrics"][0] is metric
    assert arguments["optimizer"] is optimizer and arguments["loss_weights"] == 0.5
    arguments["loss"] = None  # a copy: the model's compile config is untouched
    assert door.compile_arguments(model)["loss"] is loss


def test_flat_losses_are_the_compiled_terms_and_replacing_them_changes_the_loss():
    model = dense_model(features=4)
    x, y = regression_data(8, 4)
    assert door.compiled_loss(keras.Sequential([keras.layers.Dense(1)])) is None
    compile_loss = door.compiled_loss(model)
    assert door.flat_losses(compile_loss) is None  # not built before the first batch
    assert door.flat_losses(None) is None
    model.train_on_batch(x, y)
    flat = door.flat_losses(compile_loss)
    assert len(flat) == 1 and isinstance(flat[0].loss, keras.losses.Loss)
    assert flat[0].name == "mse"
    assert flat[0].loss_weights is None or float(flat[0].loss_weights) == 1.0

    seen = []

    def seven(y_true, y_pred, sample_weight=None):
        seen.append(tuple(y_pred.shape))
        return jnp.float32(7.0)

    door.set_flat_losses(compile_loss, [door.with_loss(flat[0], seven)])
    try:
        assert door.flat_losses(compile_loss)[0].loss is seven
        assert door.flat_losses(compile_loss)[0].loss_weights == flat[0].loss_weights
        total = model.compute_loss(x, y, model(x))
    finally:
        door.set_flat_losses(compile_loss, flat)
    assert float(total) == pytest.approx(7.0) and seen == [(8, 1)]
    assert float(model.compute_loss(x, y, model(x))) != pytest.approx(7.0)


def test_a_compiled_loss_of_several_terms_keeps_one_mean_metric_per_flat_term():
    inputs = keras.Input((3,))
    outputs = [keras.layers.Dense(1, name="first")(inputs),
               keras.layers.Dense(2, name="second")(inputs)]
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss=["mse", "mae"], loss_weights=[1.0, 0.5])
    x = np.ones((4, 3), "float32")
    logs = model.train_on_batch(x, [np.zeros((4, 1)), np.zeros((4, 2))], return_dict=True)
    compile_loss = door.compiled_loss(model)
    flat = door.flat_losses(compile_loss)
    assert [float(entry.loss_weights) for entry in flat] == [1.0, 0.5]
    assert len(compile_loss.metrics) == len(flat) == 2  # what _loss_metrics pairs up
    assert [m.name for m in compile_loss.metrics] == ["first_loss", "second_loss"]
    assert {"first_loss", "second_loss"} <= set(logs)


def test_loss_tracker_is_the_loss_mean_that_keras_step_updates():
    model, x, y = _trained_once()
    tracker = door.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss"
    assert tracker in model.metrics
    logs = model.train_on_batch(x, y, return_dict=True)
    assert float(tracker.result()) == pytest.approx(logs["loss"])
    assert door.loss_tracker(object()) is None


def test_trainer_compute_loss_is_the_default_every_model_has_unless_overridden():
    class Own(keras.Model):
        def compute_loss(self, *args, **kwargs):
            return 0.0

    default = door.trainer_compute_loss()
    inputs = keras.Input((2,))
    functional = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert keras.Sequential.compute_loss is default
    assert type(functional).compute_loss is default
    assert Own.compute_loss is not default


# -- how keras.losses.Loss.__call__ reduces a loss ------------------------------------------


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_get_keras_mask_reads_the_mask_a_masking_layer_attached():
    tokens = np.array([[3, 1, 0, 0]], "int32")
    out = keras.layers.Embedding(5, 2, mask_zero=True)(tokens)
    np.testing.assert_array_equal(np.array(door.get_keras_mask(out)), tokens != 0)
    assert door.get_keras_mask(jnp.ones(3)) is None


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight",
                                       "none"])
def test_reduce_weighted_values_is_how_a_keras_loss_reduces(reduction):
    y_true = np.array([[0.0], [1.0], [2.0], [4.0]], "float32")
    y_pred = np.array([[1.0], [1.0], [0.0], [1.0]], "float32")
    weights = np.array([1.0, 0.0, 2.0, 0.5], "float32")
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    values = loss.call(y_true, y_pred)
    ours = door.reduce_weighted_values(values, sample_weight=weights, reduction=reduction,
                                       dtype=loss.dtype)
    np.testing.assert_allclose(np.array(ours), np.array(loss(y_true, y_pred, weights)),
                               rtol=1e-6)


def test_apply_mask_rescales_a_mask_for_a_batch_mean_only():
    mask = np.array([True, True, False, False])
    batch_mean = door.apply_mask(None, mask, dtype="float32", reduction="sum_over_batch_size")
    np.testing.assert_allclose(np.array(batch_mean), [2.0, 2.0, 0.0, 0.0])
    weighted = door.apply_mask(np.array([1.0, 3.0, 5.0, 7.0]), mask, dtype="float32",
                               reduction="mean_with_sample_weight")
    np.testing.assert_allclose(np.array(weighted), [1.0, 3.0, 0.0, 0.0])
    assert door.apply_mask(None, None, dtype="float32", reduction="sum") is None


def _ranked(a: tuple, b: tuple) -> tuple[tuple, tuple]:
    first, second = door.squeeze_or_expand_to_same_rank(jnp.zeros(a), jnp.ones(b))
    return tuple(first.shape), tuple(second.shape)


def test_squeeze_or_expand_to_same_rank_matches_ranks_through_a_last_axis_of_one():
    assert _ranked((4, 3), (4, 3, 1)) == ((4, 3), (4, 3))  # a trailing 1 squeezed
    assert _ranked((4, 3, 1), (4, 3)) == ((4, 3), (4, 3))
    assert _ranked((4,), (4, 1)) == ((4, 1), (4, 1))  # rank 1 expanded instead
    assert _ranked((4, 1), (4,)) == ((4, 1), (4, 1))
    assert _ranked((4, 3), (4, 3)) == ((4, 3), (4, 3))


# -- optimizers -------------------------------------------------------------------------------


def test_own_learning_rate_is_the_rate_as_the_optimizer_holds_it():
    held = door.own_learning_rate(keras.optimizers.SGD(0.1))
    assert isinstance(held, keras.Variable) and float(held.value) == pytest.approx(0.1)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert door.own_learning_rate(keras.optimizers.Adam(schedule)) is schedule
    rate = lambda: 0.01  # noqa: E731
    assert door.own_learning_rate(keras.optimizers.SGD(rate)) is rate


def test_a_shadowed_current_learning_rate_is_what_updates_and_learning_rate_read():
    optimizer = keras.optimizers.SGD(1.0)
    weight = keras.Variable(np.array([1.0], "float32"))
    optimizer.build([weight])
    original = door.current_learning_rate_function(optimizer)
    assert float(original()) == pytest.approx(1.0)

    door.shadow_current_learning_rate(optimizer, lambda: keras.ops.multiply(original(), 0.25))
    try:
        assert float(optimizer.learning_rate) == pytest.approx(0.25)
        optimizer.apply([np.array([1.0], "float32")], [weight])
    finally:
        door.unshadow_current_learning_rate(optimizer)
    np.testing.assert_allclose(np.array(weight.value), [0.75])
    assert float(optimizer.learning_rate) == pytest.approx(1.0)
    assert float(door.own_learning_rate(optimizer).value) == pytest.approx(1.0)
    door.unshadow_current_learning_rate(optimizer)  # nothing to drop: no error


def test_current_learning_rate_function_evaluates_a_schedule_at_the_optimizers_step():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)
    optimizer = keras.optimizers.SGD(schedule)
    weight = keras.Variable(np.zeros(1, "float32"))
    optimizer.build([weight])
    optimizer.apply([np.zeros(1, "float32")], [weight])
    assert float(door.current_learning_rate_function(optimizer)()) == pytest.approx(0.5)


# -- attributes set on the instance, past Keras's __setattr__ -----------------------------


def test_an_instance_attribute_shadows_an_adam_hyperparameter_its_update_reads():
    def step(optimizer: keras.optimizers.Optimizer) -> float:
        weight = keras.Variable(np.array([0.0], "float32"))
        optimizer.build([weight])
        optimizer.apply([np.array([1e-3], "float32")], [weight])
        return float(np.array(weight.value)[0])

    plain = step(keras.optimizers.Adam(0.1))
    optimizer = keras.optimizers.Adam(0.1)
    assert door.instance_attribute(optimizer, "epsilon") == optimizer.epsilon
    door.set_instance_attribute(optimizer, "epsilon", 1.0)  # dwarfs the gradient
    assert optimizer.epsilon == 1.0
    shadowed = step(optimizer)
    assert abs(shadowed) < abs(plain) / 100
    assert door.instance_attribute(optimizer, "no_such_name", "missing") == "missing"


def test_an_instance_attribute_set_on_a_layer_is_not_tracked_and_drops_back_to_the_class():
    class Holder(keras.layers.Layer):
        def call(self, x):
            return x

    holder = Holder()
    tracked, untracked = keras.layers.Dense(2), keras.layers.Dense(2)
    tracked.build((None, 3))
    untracked.build((None, 3))
    door.set_instance_attribute(holder, "hidden", untracked)
    assert holder.hidden is untracked and holder.weights == []
    holder.shown = tracked  # Keras's __setattr__ tracks it
    assert len(holder.weights) == 2

    door.set_instance_attribute(holder, "call", lambda x: x * 2)
    np.testing.assert_allclose(np.array(holder(np.ones((1, 3), "float32"))), 2.0)
    door.drop_instance_attribute(holder, "call")
    np.testing.assert_allclose(np.array(holder(np.ones((1, 3), "float32"))), 1.0)
    door.drop_instance_attribute(holder, "call")  # nothing to drop: no error


def test_a_models_optimizer_is_an_instance_attribute_that_can_be_swapped():
    model = dense_model(features=4)
    own, other = model.optimizer, keras.optimizers.Adam()
    assert door.instance_attribute(model, "optimizer") is own
    door.set_instance_attribute(model, "optimizer", other)
    assert model.optimizer is other
    door.set_instance_attribute(model, "optimizer", own)
    assert model.optimizer is own


# -- BatchNormalization ---------------------------------------------------------------------


def _batch_norm() -> keras.layers.BatchNormalization:
    layer = keras.layers.BatchNormalization(momentum=0.5)
    layer.build((None, 3, 4))
    return layer


def test_batch_norm_reduction_axes_are_every_axis_but_the_channels():
    assert door.batch_norm_reduction_axes(_batch_norm()) == (0, 1)


def test_batch_norm_moments_are_the_batch_mean_and_variance():
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
    mean, variance = door.batch_norm_moments(_batch_norm())(x, None)
    np.testing.assert_allclose(np.ravel(mean), x.mean(axis=(0, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.ravel(variance), x.var(axis=(0, 1)), rtol=1e-4, atol=1e-6)


def test_shadowed_batch_norm_moments_are_what_a_training_call_normalises_and_updates_with():
    layer = _batch_norm()
    x = np.random.default_rng(1).normal(size=(2, 3, 4)).astype("float32")
    calls = []

    def moments(inputs, mask):
        calls.append(mask)
        return jnp.full((4,), 1.0), jnp.full((4,), 4.0)

    door.shadow_batch_norm_moments(layer, moments)
    try:
        out = layer(x, training=True)
        assert door.batch_norm_moments(layer) is not moments  # the class's, not the shadow
    finally:
        door.unshadow_batch_norm_moments(layer)
    assert calls == [None]
    np.testing.assert_allclose(np.array(out), (x - 1.0) / np.sqrt(4.0 + layer.epsilon),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(layer.moving_mean.value), 0.5)  # 0 * .5 + 1 * .5
    layer(x, training=True)
    assert len(calls) == 1  # unshadowed: the class's moments again
    door.unshadow_batch_norm_moments(layer)  # nothing to drop: no error


# -- rematerialization and stateless scopes -------------------------------------------------


def test_remat_mode_is_what_keras_remat_scope_gives_a_layer():
    assert door.remat_mode(keras.layers.Dense(2)) is None
    with keras.RematScope(mode="full"):
        layer = keras.layers.Dense(2)
    assert door.remat_mode(layer).mode == "full"
    assert door.remat_mode(object()) is None


def test_with_full_remat_mode_a_layer_call_runs_its_rematerialized_call():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    x = np.ones((1, 3), "float32")
    wrapped = []

    def rematerialized_call(layer_call, *args, **kwargs):
        wrapped.append(layer_call)
        return lambda *a, **k: layer_call(*a, **k) * 0.0

    door.set_remat_mode(layer, door.full_remat_mode())
    layer.rematerialized_call = rematerialized_call
    try:
        assert door.full_remat_mode().mode == "full"
        assert door.instance_attribute(layer, "rematerialized_call") is rematerialized_call
        assert not np.any(np.array(layer(x))) and len(wrapped) == 1
    finally:
        door.set_remat_mode(layer, None)
        door.drop_instance_attribute(layer, "rematerialized_call")
    assert np.any(np.array(layer(x))) and len(wrapped) == 1
    assert door.instance_attribute(layer, "rematerialized_call") is None


def test_has_keras_history_tells_a_symbolic_tensor_from_an_array():
    symbolic = keras.layers.Dense(2)(keras.Input((3,)))
    assert door.has_keras_history(symbolic)
    assert not door.has_keras_history(jnp.zeros(3))
    assert not door.has_keras_history(np.zeros(3))


def test_stateless_scope_is_the_open_scope_that_collects_writes_and_losses():
    class Adds(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            return x

    variable = keras.Variable(np.zeros(2, "float32"))
    assert door.stateless_scope() is None
    with keras.StatelessScope(collect_losses=True) as scope:
        assert door.stateless_scope() is scope
        with keras.StatelessScope() as inner:
            assert door.stateless_scope() is inner
        assert door.stateless_scope() is scope
        variable.assign(np.ones(2, "float32"))
        Adds()(np.full((1, 2), 3.0, "float32"))
        np.testing.assert_allclose(np.array(scope.state_mapping[id(variable)]), 1.0)
        assert [float(loss) for loss in scope.losses] == [6.0]
    assert door.stateless_scope() is None
    np.testing.assert_allclose(np.array(variable.value), 0.0)  # the write stayed in the scope


# -- variables and deferred initialization ------------------------------------------------


def test_a_variable_made_in_a_stateless_scope_is_deferred_until_initialized():
    layer = keras.layers.Dense(2)
    with keras.StatelessScope(initialize_variables=False):
        layer.build((None, 3))
    kernel = layer.kernel
    pending = door.uninitialized_variables()
    assert door.variable_buffer(kernel) is None
    assert door.variable_initializer(kernel) is not None
    assert any(v is kernel for v in pending)
    door.initialize_deferred(kernel)
    assert isinstance(door.variable_buffer(kernel), jax.Array)
    assert door.variable_buffer(kernel).shape == (3, 2)
    assert door.variable_initializer(kernel) is None
    door.set_uninitialized_variables([v for v in door.uninitialized_variables()
                                      if v is not kernel and v is not layer.bias])


def test_a_live_variable_has_a_buffer_and_no_initializer():
    variable = keras.Variable(np.ones(3, "float32"))
    assert isinstance(door.variable_buffer(variable), jax.Array)
    assert door.variable_initializer(variable) is None
    assert door.variable_buffer(object()) is None


def test_leaving_a_top_level_stateless_scope_initializes_only_the_listed_variables():
    kept, forgotten = keras.layers.Dense(2), keras.layers.Dense(2)
    with keras.StatelessScope(initialize_variables=False):
        kept.build((None, 3))
        forgotten.build((None, 3))
    ours = {id(v) for v in (*kept.weights, *forgotten.weights)}
    others = [v for v in door.uninitialized_variables() if id(v) not in ours]
    door.set_uninitialized_variables(list(kept.weights))
    try:
        with keras.StatelessScope():
            pass
    finally:
        door.set_uninitialized_variables([*others, *door.uninitialized_variables()])
    assert all(door.variable_buffer(v) is not None for v in kept.weights)
    assert all(door.variable_buffer(v) is None for v in forgotten.weights)
    assert all(id(v) not in ours for v in door.uninitialized_variables())


def test_variable_layout_is_the_layout_a_variable_was_made_with():
    mesh = keras.distribution.DeviceMesh((1,), ["batch"],
                                         devices=keras.distribution.list_devices()[:1])
    layout = keras.distribution.TensorLayout([None, None], mesh)
    with keras.StatelessScope(initialize_variables=False):
        variable = keras.Variable("zeros", shape=(2, 2), layout=layout)
    assert door.variable_layout(variable) is layout
    assert door.variable_layout(keras.Variable(np.zeros(2, "float32"))) is None
    door.set_uninitialized_variables([v for v in door.uninitialized_variables()
                                      if v is not variable])


def test_build_symbolically_builds_the_model_its_compiled_loss_and_an_unhidden_optimizer():
    x_spec = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    y_spec = jax.ShapeDtypeStruct((4, 1), jnp.float32)

    def fresh() -> keras.Model:
        model = keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse", metrics=["mae"])
        return model

    model = fresh()
    door.build_symbolically(model, (x_spec, y_spec))
    assert model.built and door.flat_losses(door.compiled_loss(model))
    assert model.optimizer.built and len(model.optimizer.variables) > 2

    hidden = fresh()
    hidden.optimizer.built = True  # Keras skips building an optimizer marked built
    door.build_symbolically(hidden, (x_spec, y_spec))
    hidden.optimizer.built = False
    assert hidden.built and len(hidden.optimizer.variables) == 2  # iterations, learning rate


def test_a_keras_optimizer_module_makes_its_variables_with_the_backend_the_door_replaces():
    backend = door.keras_backend()
    optimizer = keras.optimizers.Adafactor()
    module = door.optimizer_backend_module(optimizer)
    assert module is not None and module.backend is backend

    class Plain(keras.optimizers.SGD):
        pass

    assert door.optimizer_backend_module(Plain()) is None  # this test's module has no backend

    namespace = door.backend_namespace()
    assert namespace.Variable is backend.Variable and namespace.numpy is backend.numpy
    made = []

    def variable(*args, **kwargs):
        made.append(args[:1])
        return backend.Variable(*args, **kwargs)

    namespace.Variable = variable
    door.set_module_backend(module, namespace)
    try:
        optimizer.build([keras.Variable(np.zeros(3, "float32"))])  # rank 1: not factored
    finally:
        door.set_module_backend(module, backend)
    assert module.backend is backend
    assert (0,) in made  # Adafactor's scalar placeholders: backend.Variable(0)


# -- data -------------------------------------------------------------------------------------


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return np.full((3, 2), index, "float32"), np.full((3, 1), index, "float32")


def test_data_adapter_reads_a_py_dataset_batch_by_batch_as_numpy():
    adapter = door.data_adapter(_Batches(), shuffle=False)
    adapter.on_epoch_begin()
    try:
        batches = list(adapter.get_numpy_iterator())
    finally:
        adapter.on_epoch_end()
    assert len(batches) == 2
    assert all(isinstance(a, np.ndarray) for batch in batches for a in batch)
    assert [int(batch[0][0, 0]) for batch in batches] == [0, 1]


def test_the_stream_tests_refuse_in_memory_data_and_a_py_dataset():
    for data in (np.zeros((3, 2)), (np.zeros(3), np.zeros(3)), _Batches(), iter([1])):
        assert not door.is_tf_dataset(data)
        assert not door.is_torch_dataloader(data)
        assert not door.is_grain_dataset(data)


def test_torch_and_grain_loaders_are_recognised_by_class_name_and_module():
    # torch and grain are not installed here: classes named and placed as theirs stand in,
    # which is all Keras's tests read (the class's name and module, without importing them).
    loader = type("DataLoader", (), {"__module__": "torch.utils.data.dataloader"})()
    grain = type("MapDataset", (), {"__module__": "grain._src.python.dataset.dataset"})()
    assert door.is_torch_dataloader(loader) and not door.is_grain_dataset(loader)
    assert door.is_grain_dataset(grain) and not door.is_torch_dataloader(grain)
    assert not door.is_tf_dataset(loader) and not door.is_tf_dataset(grain)


@pytest.mark.slow  # imports TensorFlow
def test_is_tf_dataset_recognises_a_tf_data_dataset():
    tf = pytest.importorskip("tensorflow")
    dataset = tf.data.Dataset.from_tensor_slices(np.zeros((4, 2), "float32")).batch(2)
    assert door.is_tf_dataset(dataset)
    assert not door.is_torch_dataloader(dataset) and not door.is_grain_dataset(dataset)


# -- keras-hub ----------------------------------------------------------------------------------


@pytest.mark.slow  # imports keras-hub (and TensorFlow)
def test_backbone_lora_layers_and_rank_are_what_enable_lora_recorded():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=16, num_layers=1, num_heads=1, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=8)
    assert not door.backbone_lora_layers(backbone)
    backbone.enable_lora(2)
    indices = door.backbone_lora_layers(backbone)
    assert door.backbone_lora_rank(backbone) == 2
    weighted = [layer for layer in door.flatten_layers(backbone, include_self=False)
                if layer.weights]
    chosen = [weighted[i] for i in indices]
    assert chosen and all(layer.lora_enabled for layer in chosen)
    assert {layer.name for layer in chosen} <= set(backbone.default_lora_layer_names())
    assert door.backbone_lora_layers(keras.layers.Dense(2)) is None
