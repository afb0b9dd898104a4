"""The Keras adapter's advisor hooks: another optimizer, traced without touching the user's
model; every advised row fits when the model is compiled with that optimizer and planned."""

import keras
import numpy as np
import pytest

import autoaccum
from autoaccum.adapters import adapter_for

from ._models import regression_data

OPTIMIZERS = {"adafactor": keras.optimizers.Adafactor, "sgd": keras.optimizers.SGD,
              "lion": keras.optimizers.Lion}


def wide_model(optimizer=None) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(256)])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3), loss="mse")
    return model


def data():
    x, _ = regression_data(16, 256)
    return x, np.zeros((16, 256), np.float32)


BUDGET = 2_200_000  # 1.05 MB of weights + Adam's 2.1 MB do not fit; plain SGD does


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_every_advised_optimizer_fits_when_the_model_is_compiled_with_it():
    model = wide_model()
    advice = autoaccum.advise(model, data(), effective_batch=2, budget=BUDGET, log=None,
                              cache=False)
    assert not advice.fits and advice.resident.state_bytes > BUDGET
    assert isinstance(model.optimizer, keras.optimizers.Adam)  # untouched
    rows = [a for a in advice.alternatives if "optimizer" in a.change]
    assert rows and any(a.change == {"optimizer": "sgd"} for a in rows)
    for row in rows:
        replanned = autoaccum.plan(wide_model(OPTIMIZERS[row.change["optimizer"]]()), data(),
                                   effective_batch=2, budget=BUDGET, log=None, cache=False,
                                   method="compile", remat="none")
        assert replanned.need_bytes <= BUDGET
        assert (replanned.micro_batch, replanned.accum_steps) == (row.micro_batch,
                                                                  row.accum_steps)


def test_a_change_keras_cannot_take_is_refused_by_name():
    adapter = adapter_for(wide_model())
    with pytest.raises(ValueError, match="lora_rank"):
        adapter.apply_change(wide_model(), {}, {"lora_rank": 4})
