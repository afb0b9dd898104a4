"""Rematerialization of a Keras model's blocks: every policy Flax models get, exact, and
state the blocks write (dropout seeds, BatchNorm statistics) carried out of the checkpoint."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import autoaccum
from autoaccum.adapters.keras._keras_program import KERAS_REMAT_POLICIES, keras_rematerialized
from autoaccum.planning import REMAT_POLICIES

from ._models import TEXTS, max_diff, tiny_gpt2


def test_keras_models_offer_every_remat_policy():
    assert tuple(REMAT_POLICIES) == KERAS_REMAT_POLICIES


def test_the_blocks_the_layer_filter_picks_are_rematerialized_and_counted():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    dense = lambda layer: isinstance(layer, keras.layers.Dense)  # noqa: E731
    with keras_rematerialized(model, "nothing", layers=dense) as n:
        assert n == 1


def test_no_blocks_to_checkpoint_names_the_search_option_that_finds_them():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    with (pytest.raises(ValueError, match=r"no `transformer_layers`.*search=autoaccum\."
                                          r"Search\(remat_layers=lambda layer"),
          keras_rematerialized(model, "nothing")):
        pass
    with (pytest.raises(ValueError, match=r"remat_layers=\.\.\.\) chose none.*Received"),
          keras_rematerialized(model, "nothing", layers=lambda layer: False)):
        pass


@pytest.mark.slow
def test_a_keras_hub_decoder_called_with_training_true_trains_under_remat_as_without():
    """keras-hub's ``TransformerDecoder`` branches on ``training``: Keras's own full-block
    remat traces that flag and fails (``'str' object has no attribute '_error_repr'``);
    autoaccum's keeps it a Python value, and the trained weights match remat='none'."""
    texts = TEXTS * 2
    plain, remat_model = tiny_gpt2(), tiny_gpt2()
    for model, policy in ((plain, "none"), (remat_model, "dots")):
        autoaccum.fit(model, texts, effective_batch=8, budget="1GiB",
                      verbose=0, log=None,
                      search=autoaccum.Search(remat=policy),
                      training=autoaccum.Training(shuffle=False))
    assert max_diff(plain, remat_model) < 1e-5


class _Block(keras.layers.Layer):
    """A residual block with dropout and BatchNorm: both write state while it runs."""

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(width, activation="relu")
        self.norm = keras.layers.BatchNormalization()
        self.drop = keras.layers.Dropout(0.25, seed=3)

    def call(self, x, training=None):
        return x + self.drop(self.norm(self.dense(x), training=training), training=training)


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    x = _Block(8)(inputs)
    x = _Block(8)(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_dropout_and_batchnorm_state_written_inside_a_checkpointed_block_is_kept():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    blocks = lambda layer: isinstance(layer, _Block)  # noqa: E731
    models = {}
    for policy in ("none", "nothing"):
        model = _model()
        autoaccum.fit(model, x, y, effective_batch=16, budget="1GiB", verbose=0, log=None,
                      epochs=2,
                      search=autoaccum.Search(remat=policy, remat_layers=blocks),
                      training=autoaccum.Training(shuffle=False))
        models[policy] = model
    plain, remat = models["none"], models["nothing"]
    assert max_diff(plain, remat) < 1e-5  # the same dropout masks, the same BatchNorm updates
    norm = plain.layers[1].norm
    assert not np.allclose(keras.ops.convert_to_numpy(norm.moving_mean), 0.0)
