"""Small real plans shared by the report, plot and CLI tests (tiny Flax model, CPU compiles)."""

from __future__ import annotations

import functools

import optax
from flax import nnx

import autoaccum
from tests._models import TinyLM, ragged_tokens, token_loss


def _inputs() -> dict:
    return {"model": TinyLM(vocab=64, dim=32, hidden=256, rngs=nnx.Rngs(0)),
            "data": ragged_tokens(64, 64, vocab=64), "optimizer": optax.adam,
            "learning_rate": 1e-3, "loss_fn": token_loss}


@functools.cache
def accumulating_plan() -> autoaccum.Plan:
    """Effective batch 16 under a budget where micro-batch 2 fits and 4 does not, divisors
    only (an even split: 2 x 8)."""
    inputs = _inputs()
    two = autoaccum.measure(inputs["model"], inputs["data"], micro_batch=2, effective_batch=16,
                            optimizer=inputs["optimizer"], learning_rate=1e-3,
                            loss_fn=token_loss)
    return autoaccum.plan(inputs.pop("model"), inputs.pop("data"), effective_batch=16,
                          budget=int(two.need_bytes * 1.3), log=None, **inputs,
                          search=autoaccum.Search(method="compile", uneven=False))


@functools.cache
def uneven_plan() -> autoaccum.Plan:
    """Effective batch 13 under the budget of :func:`accumulating_plan`: the step ends with a
    smaller micro-batch."""
    inputs = _inputs()
    two = autoaccum.measure(inputs["model"], inputs["data"], micro_batch=2, effective_batch=16,
                            optimizer=inputs["optimizer"], learning_rate=1e-3,
                            loss_fn=token_loss)
    return autoaccum.plan(inputs.pop("model"), inputs.pop("data"), effective_batch=13,
                          budget=int(two.need_bytes * 1.3), log=None, **inputs,
                          search=autoaccum.Search(method="compile"))


@functools.cache
def whole_batch_plan() -> autoaccum.Plan:
    """Effective batch 8 under a large budget: no accumulation, capped by the batch itself."""
    inputs = _inputs()
    return autoaccum.plan(inputs.pop("model"), inputs.pop("data"), effective_batch=8,
                          budget="1GiB", log=None, **inputs,
                          search=autoaccum.Search(method="compile"))


def builder() -> dict:
    """``autoaccum plan --model tests._plans:builder``."""
    return _inputs()


def builder_with_unknown_option() -> dict:
    return {**_inputs(), "batch_sise": 4}


def builder_needing_an_argument(size: int) -> dict:
    return _inputs()


def builder_that_raises() -> dict:
    config = {"layers": 2}
    return {**_inputs(), "depth": config["depth"]}


def builder_that_cannot_import() -> dict:
    import autoaccum_no_such_package  # noqa: F401

    return _inputs()


def builder_with_flag_options() -> dict:
    """Returns options a flag also sets: ``budget``, ``remat`` (in its Search),
    ``effective_batch``."""
    import autoaccum

    return {**_inputs(), "budget": "64MiB", "search": autoaccum.Search(remat="none"),
            "effective_batch": 8}


def builder_with_an_old_option() -> dict:
    """Returns ``remat=`` as ``autoaccum.plan`` took it before the option specs."""
    return {**_inputs(), "remat": "none", "effective_batch": 8}


def keras_builder() -> dict:
    """``autoaccum plan --model tests._plans:keras_builder``: a small compiled Keras model."""
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    data = (np.ones((16, 32), "float32"), np.zeros((16, 1), "float32"))
    return {"model": model, "data": data, "effective_batch": 16}
