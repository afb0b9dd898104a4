"""Keras: the accumulated step needs at most one float32 copy of the trainable parameters
more than Keras's own (donating) train step at the same micro-batch. Compile-only."""

import jax
import keras
import numpy as np
import pytest

from autoaccum.adapters.keras._keras_program import (
    ensure_built,
    find_layout,
    keras_state,
    keras_train_step,
)
from autoaccum.adapters.keras._keras_step import materialize

SEQ, VOCAB, WIDTH = 32, 256, 64


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, WIDTH)(inputs)
    h = h + keras.layers.Dense(WIDTH)(keras.layers.Dense(4 * WIDTH, activation="gelu")(h))
    outputs = keras.layers.Dense(VOCAB)(keras.layers.LayerNormalization()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _need(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_accumulated_keras_step_needs_at_most_one_float32_copy_of_the_params_more():
    micro, accum = 2, 4
    x = np.random.default_rng(0).integers(0, VOCAB, (micro * accum, SEQ), dtype=np.int32)
    y = np.roll(x, -1, axis=1)
    plain_model = _model()
    plain_model._symbolic_build(data_batch=(x[:micro], y[:micro]))
    plain_state = plain_model._get_jax_state(
        trainable_variables=True, non_trainable_variables=True, optimizer_variables=True,
        metrics_variables=True)
    plain = _need(jax.jit(plain_model.train_step, donate_argnums=0).lower(
        plain_state, (x[:micro], y[:micro])).compile())

    model = _model()
    spec = (jax.ShapeDtypeStruct((SEQ,), np.int32), jax.ShapeDtypeStruct((SEQ,), np.int32))
    ensure_built(model, spec)
    materialize(model)
    layout = find_layout(model, spec)
    state, frozen = keras_state(model, layout)
    batches = (x.reshape(accum, micro, SEQ), y.reshape(accum, micro, SEQ))
    accumulated = _need(jax.jit(keras_train_step(model, layout), donate_argnums=0).lower(
        state, batches, frozen).compile())
    f32_params = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    over = accumulated - plain
    assert over <= f32_params, (over / f32_params, over, f32_params)
