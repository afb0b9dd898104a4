"""Uneven micro-batches for Keras (13 = 5 + 5 + 3): planned where the largest fitting
micro-batch does not divide the batch, and one step equals Keras's own step on all of it."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json

import keras
import numpy as np
import pytest

import autoaccum
from autoaccum.adapters import adapter_for
from autoaccum.adapters.keras import keras_fit
from autoaccum.internal import split_sizes
from autoaccum.planning._measure import measure_program
from autoaccum.planning._plan_model import prepare
from autoaccum.planning._plan_options import ProgramOptions

from ._models import dense_model, regression_data
from .test_accumulation import padded_data, token_model
from .test_keras_batch_norm import _moving
from .test_metrics import two_heads

# effective batch -> the split of a plan whose micro-batch 5 fits and 6 does not
SPLITS = {7: (5, 2), 13: (5, 5, 3), 96: (5,) * 19 + (1,)}
# ... and the split planned there: as few micro-steps, the smallest micro-batch that takes
# that many (7 in two micro-steps: 4 + 3, not 5 + 2; the same steps, less memory)
PLANNED = {7: (4, 3), 13: (5, 5, 3), 96: (5,) * 19 + (1,)}


def _weights(model):
    return [np.asarray(w, np.float64) for w in model.get_weights()]


def update_error(ours, native, before) -> float:
    """``|update_ours - update_native| / |update_native|`` over all weights (L2 norms; the
    float32 rounding of the weights themselves is the floor)."""
    diff = sum(float(np.sum(np.square(a - b))) for a, b in zip(_weights(ours), _weights(native),
                                                              strict=True))
    moved = sum(float(np.sum(np.square(b - w))) for b, w in zip(_weights(native), before,
                                                               strict=True))
    assert moved > 1e-8  # the step changed the weights
    return (diff / moved) ** 0.5


def fit_one_step(model, data, effective, **options):
    """One ``keras_fit`` step of ``effective`` examples at micro-batch 5 (the plan's split)."""
    accum, last = split_sizes(effective, 5)
    return keras_fit(model, data, micro_batch=5, accum_steps=accum, last_micro_batch=last,
                     shuffle=False, verbose=0, **options)


def _token_model(reduction, *, mask_zero=True):
    return token_model(mask_zero=mask_zero, reduction=reduction,
                       optimizer=keras.optimizers.SGD(0.5))


# -- exactness: one uneven step equals Keras's step on the whole batch ----------------------


REDUCTIONS = ("sum_over_batch_size", "mean_with_sample_weight", "sum")
# Every pair of (split, reduction, mask) is covered, not every triple (12 rows of 18, about 4 CPU
# s each): a reduction and a mask decide how each micro-batch's loss is weighed, a split only
# how many full micro-batches precede the smaller last one (13 = 5 + 5 + 3, the uneven case,
# takes every reduction with and without a mask; 7 = 5 + 2, one full micro-batch, and
# 96 = 19 x 5 + 1, a last micro-batch of one, take every reduction, the mask alternating).
UNEVEN_ROWS = (
    [(13, reduction, mask) for reduction in REDUCTIONS for mask in (False, True)]
    + [(7, r, mask) for r, mask in zip(REDUCTIONS, (False, True, False), strict=True)]
    + [(96, r, mask) for r, mask in zip(REDUCTIONS, (True, False, True), strict=True)])


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("effective, reduction, mask_zero", UNEVEN_ROWS)
def test_uneven_step_of_padded_weighted_tokens_equals_keras_big_batch(effective, reduction,
                                                                      mask_zero):
    """Padded tokens weigh 0 by sample weight (divided by every position, as keras-hub's
    CausalLM) or by a Keras mask too (divided by the real tokens)."""
    x, y, w = padded_data(effective)
    ours = _token_model(reduction, mask_zero=mask_zero)
    native = _token_model(reduction, mask_zero=mask_zero)
    before = _weights(native)
    native_logs = native.train_on_batch(x, y, sample_weight=w, return_dict=True)
    history = fit_one_step(ours, (x, y, w), effective)
    assert (history.autoaccum_micro_batch, history.autoaccum_accum_steps,
            history.autoaccum_last_micro_batch) == (5, len(SPLITS[effective]),
                                                    SPLITS[effective][-1])
    assert int(ours.optimizer.iterations) == 1
    assert update_error(ours, native, before) <= 1e-5
    assert history.history["loss"][0] == pytest.approx(native_logs["loss"], rel=1e-5)
    assert history.history["sparse_categorical_accuracy"][0] == pytest.approx(
        native_logs["sparse_categorical_accuracy"], rel=1e-6)


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_weighting_micro_batches_equally_would_be_visibly_wrong():
    """The 5 + 5 + 3 split discriminates: the mean of the micro-batch losses is not the big
    batch's loss, so equal weights would fail the exactness tests above."""
    x, y, w = padded_data(13)
    model = token_model(mask_zero=False, reduction="sum_over_batch_size")
    big = model.evaluate(x, y, sample_weight=w, batch_size=13, verbose=0)[0]
    parts = [model.evaluate(x[a:b], y[a:b], sample_weight=w[a:b], batch_size=5, verbose=0)[0]
             for a, b in ((0, 5), (5, 10), (10, 13))]
    assert abs(big - np.mean(parts)) > 1e-3


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_loss_that_reduces_itself_and_activity_regularization_weigh_by_examples():
    """A loss function returning its own mean (no per-example values for Keras to reduce) and
    an activity regularizer (Keras divides it by the batch size) weigh each micro-batch by its
    examples, as in one big batch of 13."""
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2",
                               activity_regularizer=keras.regularizers.L1(0.05)),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=lambda y, p: keras.ops.mean(keras.ops.square(y - p)),
                      metrics=["mae"])
        return model

    x, y = regression_data(13)
    ours, native = build(), build()
    before = _weights(native)
    native_logs = native.train_on_batch(x, y, return_dict=True)
    history = fit_one_step(ours, (x, y), 13)
    assert update_error(ours, native, before) <= 1e-5
    assert history.history["loss"][0] == pytest.approx(native_logs["loss"], rel=1e-5)
    assert history.history["mae"][0] == pytest.approx(native_logs["mae"], rel=1e-5)


@pytest.mark.parametrize(("token_reduction", "value_reduction"), [
    ("sum", "sum_over_batch_size"),
    ("sum_over_batch_size", "sum"),
])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_per_term_loss_metrics_of_an_uneven_step_are_logged_as_keras_big_batch(
        token_reduction, value_reduction):
    x, y, _ = padded_data(13)
    targets = {"tok": y, "val": np.random.default_rng(2).normal(size=(13, 1)).astype("float32")}
    ours = two_heads(token_reduction, value_reduction)
    native = two_heads(token_reduction, value_reduction)
    native_logs = native.train_on_batch(x, targets, return_dict=True)
    history = fit_one_step(ours, (x, targets), 13)
    assert {"tok_loss", "val_loss"} <= set(native_logs)
    for name, value in native_logs.items():
        assert history.history[name][0] == pytest.approx(value, rel=2e-5, abs=1e-6), name


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.parametrize("effective", [7, 13])
def test_batchnorm_effective_statistics_of_an_uneven_step_equal_keras_big_batch(effective):
    x, y = regression_data(effective)
    ours, native = dense_model(batch_norm=True), dense_model(batch_norm=True)
    native.train_on_batch(x, y)
    fit_one_step(ours, (x, y), effective)
    for got, want in zip(_moving(ours), _moving(native), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


# -- leftover and validation batches -------------------------------------------------------


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_epoch_of_uneven_steps_and_uneven_last_step_equals_keras_fit():
    """70 examples, effective batch 13 (5 + 5 + 3): five steps, then 5 examples as one step;
    validation batches of 13 split the same way."""
    x, y, w = padded_data(70)
    xv, yv, wv = padded_data(20, seed=5)
    ours, native = _token_model("sum_over_batch_size"), _token_model("sum_over_batch_size")
    history = fit_one_step(ours, (x, y, w), 13, epochs=2, validation_data=(xv, yv, wv))
    native_history = native.fit(x, y, sample_weight=w, batch_size=13, epochs=2, shuffle=False,
                                verbose=0, validation_data=(xv, yv, wv))
    assert int(ours.optimizer.iterations) == int(native.optimizer.iterations) == 12
    assert history.autoaccum_remainder == {"policy": "train", "examples": 5}
    for name, values in native_history.history.items():
        assert history.history[name] == pytest.approx(values, rel=2e-5), name
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(_weights(ours), _weights(native),
                                                            strict=True)) < 1e-5


def test_smaller_steps_split_unevenly_at_the_fit_micro_batch_unless_uneven_is_false():
    uneven, divisors_only = _runner(uneven=True), _runner(uneven=False)
    assert uneven.effective_batch == divisors_only.effective_batch == 13
    assert uneven.split(13) == divisors_only.split(13) == (3, 5, 3)
    assert uneven.split(11) == (3, 5, 1) and divisors_only.split(11) == (11, 1, None)
    assert uneven.split(4) == divisors_only.split(4) == (1, 4, None)
    assert uneven.split(10) == divisors_only.split(10) == (2, 5, None)


def _runner(*, uneven):
    import jax

    from autoaccum.adapters.keras._keras_fit import KerasState, keras_runner
    from autoaccum.adapters.keras._keras_program import find_layout

    model = dense_model()
    spec = (jax.ShapeDtypeStruct((16,), np.float32), jax.ShapeDtypeStruct((1,), np.float32))
    return keras_runner(KerasState(model, find_layout(model, spec)), micro_batch=5,
                        accum_steps=3, last_micro_batch=3, backup="none", elastic=False,
                        uneven=uneven)


def test_last_micro_batch_that_is_not_smaller_is_refused():
    x, y = regression_data(16)
    with pytest.raises(ValueError, match="below `micro_batch`.*Received: last_micro_batch=5"):
        keras_fit(dense_model(), (x, y), micro_batch=5, accum_steps=3, last_micro_batch=5)
    with pytest.raises(ValueError, match="Received: last_micro_batch=2, micro_batch=5, "
                                         "accum_steps=1"):
        keras_fit(dense_model(), (x, y), micro_batch=5, accum_steps=1, last_micro_batch=2)
    with pytest.raises(ValueError, match="positive integer.*Received: last_micro_batch=0"):
        keras_fit(dense_model(), (x, y), micro_batch=5, accum_steps=3, last_micro_batch=0)


# -- planning: a budget that fits micro-batch 5 and not 6 -----------------------------------


def _lm(seed=0):
    """Activations dominate its memory: 64 tokens x 256 hidden units per example."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((64,), dtype="int32"),
        keras.layers.Embedding(64, 32),
        keras.layers.Dense(256, activation="gelu"),
        keras.layers.Dense(64),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _lm_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 64, size=(n, 64)).astype("int32")
    y = rng.integers(0, 64, size=(n, 64)).astype("int32")
    w = (rng.random((n, 64)) < 0.7).astype("float32")  # padded tokens weigh 0
    return x, y, w


def _budget_between_5_and_6(effective):
    """Bytes above every compile of micro-batch 5 the search may make for ``effective`` (even
    shape, and the uneven step it verifies) and below every one of micro-batch 6."""
    model = _lm()
    program = prepare(adapter_for(model), model, _lm_data(effective), effective_batch=effective,
                      options=ProgramOptions()).program

    def needs(micro):
        accum, last = split_sizes(effective, micro)
        shapes = {(accum, None), (accum, last)}
        return [measure_program(program, micro, k, last=lst).need_bytes for k, lst in shapes]

    fits, fails = max(needs(5)), min(needs(6))
    assert fits < fails
    return (fits + fails) // 2


@pytest.mark.slow  # a dozen compiles per effective batch
@pytest.mark.parametrize("effective", sorted(SPLITS))
def test_budget_fitting_5_but_not_6_plans_uneven_split_that_trains_exactly(effective):
    budget = _budget_between_5_and_6(effective)
    data = _lm_data(effective)
    plan = autoaccum.plan(_lm(), data, effective_batch=effective, budget=budget,
                          log=None,
                          search=autoaccum.Search(method="compile", remat="none", cache=False),
                          learning_rate=autoaccum.LearningRate(rule="none"))
    assert plan.micro_batches == PLANNED[effective]
    assert (plan.micro_batch, plan.last_micro_batch) == (PLANNED[effective][0],
                                                         PLANNED[effective][-1])
    assert plan.need_bytes <= budget and "uneven split" in plan.report()

    ours, native = _lm(), _lm()
    before = _weights(native)
    native.train_on_batch(*data)
    history = autoaccum.fit(ours, data, effective_batch=effective, plan=plan, verbose=0, log=None,
                            training=autoaccum.Training(shuffle=False),
                            learning_rate=autoaccum.LearningRate(rule="none"))
    assert history.autoaccum_last_micro_batch == PLANNED[effective][-1]
    assert update_error(ours, native, before) <= 1e-5


@pytest.mark.slow  # a dozen compiles
def test_uneven_false_keeps_divisors():
    budget = _budget_between_5_and_6(13)
    plan = autoaccum.plan(_lm(), _lm_data(13), effective_batch=13, budget=budget,
                          log=None,
                          search=autoaccum.Search(method="compile", remat="none", cache=False,
                                                  uneven=False),
                          learning_rate=autoaccum.LearningRate(rule="none"))
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (1, 13, None)


# -- data parallel ---------------------------------------------------------------------------

_DATA_PARALLEL_CHILD = """
import json, keras, numpy as np
from autoaccum.adapters.keras import keras_fit
from tests.adapters.keras._models import dense_model, regression_data
from tests.adapters.keras.test_accumulation import padded_data
from tests.adapters.keras.test_keras_batch_norm import _moving
from tests.adapters.keras.test_uneven import _token_model, _weights, update_error
x, y, w = padded_data(20)  # 4 devices x (2 + 2 + 1)
ours, native = _token_model("sum_over_batch_size"), _token_model("sum_over_batch_size")
before = _weights(native)
logs = native.train_on_batch(x, y, sample_weight=w, return_dict=True)
history = keras_fit(ours, (x, y, w), micro_batch=2, accum_steps=3, last_micro_batch=1,
                    data_parallel=4, shuffle=False, verbose=0)
out = {"update_error": update_error(ours, native, before), "loss": history.history["loss"][0],
       "native_loss": logs["loss"], "data_parallel": history.autoaccum_data_parallel}
xb, yb = regression_data(20)
ours, native = dense_model(batch_norm=True), dense_model(batch_norm=True)
native.train_on_batch(xb, yb)
keras_fit(ours, (xb, yb), micro_batch=2, accum_steps=3, last_micro_batch=1, data_parallel=4,
          shuffle=False, verbose=0)
out["moving_errors"] = [float(np.max(np.abs(a - b))) for a, b in zip(_moving(ours),
                                                                    _moving(native))]
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow  # a child process with four host devices
def test_uneven_data_parallel_step_equals_keras_big_batch():
    import subprocess
    import sys

    from tests._paths import REPO, host_devices_env

    env = host_devices_env(4, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _DATA_PARALLEL_CHILD], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["data_parallel"] == 4
    assert out["update_error"] <= 1e-5
    assert out["loss"] == pytest.approx(out["native_loss"], rel=1e-5)
    mean_error, variance_error = out["moving_errors"]
    assert mean_error < 2e-6 and variance_error < 2e-5
