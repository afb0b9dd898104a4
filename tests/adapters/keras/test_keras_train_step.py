"""``autoaccum.train_step(keras_model, ...)``: a hand-written Keras loop gets fit's exact,
planned, accumulating step; the model, its optimizer and metrics are updated in place."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np
import pytest

import autoaccum
from tests.adapters.keras._models import dense_model, max_diff, regression_data

# The module's fixtures are built once: its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("adapters.keras.test_keras_train_step")

EFFECTIVE = 13
_rng = np.random.default_rng(3)
X = _rng.normal(size=(39, 32, 4)).astype("float32")  # 32 positions: activations dominate
Y = (X.sum(axis=-1, keepdims=True) + _rng.normal(size=(39, 32, 1))).astype("float32")
W = _rng.uniform(0.2, 2.0, size=(39, 32)).astype("float32")  # per position
# The rate was tuned for this batch: never changed.
NO_SCALING = dict(learning_rate=autoaccum.LearningRate(base_batch=EFFECTIVE))


def _adam_model(seed: int = 0) -> keras.Model:
    """Per-position ``Dense(64, relu) -> Dense(1)``, Adam, MSE and ``mae``."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((32, 4)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def _batches(*arrays: np.ndarray, size: int = EFFECTIVE):
    for start in range(0, len(arrays[0]), size):
        yield tuple(a[start:start + size] for a in arrays)


@pytest.fixture(scope="module")
def plan() -> autoaccum.Plan:
    """An accumulating, uneven plan for 13 examples (micro-batches of about 5)."""
    one = autoaccum.measure(_adam_model(), (X, Y, W), micro_batch=5, effective_batch=EFFECTIVE,
                            **NO_SCALING)
    the_plan = autoaccum.plan(_adam_model(), (X, Y, W), effective_batch=EFFECTIVE,
                              budget=int(one.need_bytes * 1.02), log=None,
                              **NO_SCALING, search=autoaccum.Search(method="compile"))
    assert the_plan.accum_steps > 1
    return the_plan


def _step(model: keras.Model, plan: autoaccum.Plan, data=(X, Y, W), **options):
    return autoaccum.train_step(model, data, effective_batch=EFFECTIVE, plan=plan,
                                **{**NO_SCALING, **options})


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_each_step_equals_train_on_batch_on_the_same_big_batch(plan):
    native, ours = _adam_model(), _adam_model()
    step = _step(ours, plan)
    for i, (x, y, w) in enumerate(_batches(X, Y, W)):
        expected = native.train_on_batch(x, y, sample_weight=w, return_dict=True)
        out = step((x, y, w))
        assert max_diff(native, ours) < 1e-5
        assert out.logs.keys() == expected.keys() == {"loss", "mae"}
        for name, value in expected.items():
            assert out.logs[name] == pytest.approx(value, rel=1e-5)
        assert out.loss == pytest.approx(expected["loss"], rel=1e-5)
        assert out.applied and out.count == w.size  # Keras divides by the elements
        assert out.step == step.steps == int(ours.optimizer.iterations) == i + 1
    assert int(native.optimizer.iterations) == 3
    np.testing.assert_allclose(ours.predict(X, verbose=0), native.predict(X, verbose=0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_loop_of_steps_equals_model_fit_at_the_effective_batch_with_its_logs(plan):
    fitted, ours = _adam_model(), _adam_model()
    history = fitted.fit(X, Y, sample_weight=W, batch_size=EFFECTIVE, shuffle=False,
                         epochs=2, verbose=0)
    step = _step(ours, plan)
    for _ in range(2):
        ours.reset_metrics()  # an epoch's running logs, as model.fit keeps them
        for batch in _batches(X, Y, W):
            out = step(batch, reset_metrics=False)
    assert max_diff(fitted, ours) < 1e-5
    assert int(ours.optimizer.iterations) == int(fitted.optimizer.iterations) == 6
    for name in ("loss", "mae"):
        assert out.logs[name] == pytest.approx(history.history[name][-1], rel=1e-5)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_smaller_last_batch_is_one_step_normalised_by_its_own_count(plan):
    native, ours = _adam_model(), _adam_model()
    step = _step(ours, plan)
    for x, y, w in [(X[:EFFECTIVE], Y[:EFFECTIVE], W[:EFFECTIVE]),
                    (X[EFFECTIVE:20], Y[EFFECTIVE:20], W[EFFECTIVE:20])]:
        expected = native.train_on_batch(x, y, sample_weight=w, return_dict=True)
        out = step((x, y, w))
        assert out.loss == pytest.approx(expected["loss"], rel=1e-5)
    assert out.count == 7 * 32 and out.step == 2
    assert max_diff(native, ours) < 1e-5


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_dict_inputs_as_model_fit_takes_them():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    native = keras.models.clone_model(model)
    native.set_weights(model.get_weights())
    native.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(8, 3)).astype("float32"),
         "b": rng.normal(size=(8, 2)).astype("float32")}
    y = rng.normal(size=(8, 1)).astype("float32")
    step = autoaccum.train_step(model, (x, y), effective_batch=8, budget="1GiB", log=None,
                                learning_rate=autoaccum.LearningRate(base_batch=8))
    out = step((x, y))
    expected = native.train_on_batch(x, y, return_dict=True)
    assert out.logs["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert max_diff(native, model) < 1e-6


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_the_learning_rate_is_scaled_by_the_rule_given_as_fit_scales_it():
    x, y = regression_data(12)
    scaled = dense_model(learning_rate=0.01)
    step = autoaccum.train_step(scaled, (x, y), effective_batch=12, budget="1GiB", log=None,
                                learning_rate=autoaccum.LearningRate(base_batch=6, rule="linear"))
    assert step.plan.learning_rate == pytest.approx(0.02)
    step((x, y))
    native = dense_model(learning_rate=0.02)
    native.train_on_batch(x, y)
    assert max_diff(native, scaled) < 1e-6
    assert float(scaled.optimizer.learning_rate) == pytest.approx(0.01)  # the base stays

    given = dense_model(learning_rate=0.01)
    autoaccum.train_step(given, (x, y), effective_batch=12, budget="1GiB", log=None,
                         learning_rate=autoaccum.LearningRate(value=0.05, base_batch=12))
    assert float(given.optimizer.learning_rate) == pytest.approx(0.05)  # as fit sets it


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_weights_loaded_into_the_model_between_steps_are_what_the_next_step_trains(plan):
    model = _adam_model()
    start = model.get_weights()
    step = _step(model, plan)
    batch = (X[:EFFECTIVE], Y[:EFFECTIVE], W[:EFFECTIVE])
    step(batch)
    model.set_weights(start)
    for variable in model.optimizer.variables:  # a fresh Adam: step count and moments 0
        if variable is not model.optimizer._learning_rate:
            variable.assign(np.zeros(variable.shape, variable.dtype))
    step(batch)
    fresh = _adam_model()
    _step(fresh, plan)(batch)
    assert max_diff(fresh, model) < 1e-6


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_the_saved_model_is_the_checkpoint_and_resumes_exactly(plan, tmp_path):
    model = _adam_model()
    step = _step(model, plan)
    batches = list(_batches(X, Y, W))
    step(batches[0])
    model.save(tmp_path / "model.keras")
    step(batches[1])

    restored = keras.models.load_model(tmp_path / "model.keras")
    assert int(restored.optimizer.iterations) == 1
    again = _step(restored, plan)
    out = again(batches[1])
    assert out.step == 2 and max_diff(restored, model) < 1e-6


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_on_nonfinite_skip_changes_nothing_and_stop_raises(plan):
    model = _adam_model()
    before = model.get_weights()
    bad = X[:EFFECTIVE].copy()
    bad[3, 0] = np.nan
    skip = _step(model, plan, training=autoaccum.Training(on_nonfinite="skip"))
    out = skip((bad, Y[:EFFECTIVE], W[:EFFECTIVE]))
    assert not out.applied and out.step == 0 and max_diff(before, model) == 0.0
    stop = _step(model, plan)
    with pytest.raises(autoaccum.NonFiniteError, match="Optimizer step 1"):
        stop((bad, Y[:EFFECTIVE], W[:EFFECTIVE]))
    assert max_diff(before, model) == 0.0 and int(model.optimizer.iterations) == 0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_after_an_out_of_memory_shrink_gives_a_smaller_step_with_the_same_result(plan):
    native, ours = _adam_model(), _adam_model()
    step = _step(ours, plan)
    error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes")
    assert step.shrink(error) is step
    assert step.plan.micro_batch < plan.micro_batch
    assert sum(step.plan.micro_batches) == EFFECTIVE and "out of memory" in step.events[0]
    step((X[:EFFECTIVE], Y[:EFFECTIVE], W[:EFFECTIVE]))
    native.train_on_batch(X[:EFFECTIVE], Y[:EFFECTIVE], sample_weight=W[:EFFECTIVE])
    assert max_diff(native, ours) < 1e-5


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_bad_batches_are_refused_naming_the_type_and_the_fix(plan):
    step = _step(_adam_model(), plan)
    with pytest.raises(ValueError, match="one effective batch of 13 examples.*has 39"):
        step((X, Y, W))
    with pytest.raises(ValueError, match="sample weights"):
        step((X[:EFFECTIVE], Y[:EFFECTIVE]))  # planned with weights: every batch has them
    with pytest.raises(ValueError, match="Received: batch of type str"):
        step("not a batch")
    with pytest.raises(ValueError, match="Iterate your dataset.*type generator"):
        step(b for b in _batches(X, Y))
    with pytest.raises(ValueError, match=r"not shaped like.*float32\[32, 4\].*float32\[5, 4\]"):
        step((X[:EFFECTIVE, :5], Y[:EFFECTIVE], W[:EFFECTIVE]))
    assert int(step.model.optimizer.iterations) == 0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_flax_options_and_one_shot_iterators_are_refused_with_the_fix():
    model = dense_model()
    x, y = regression_data(26)
    with pytest.raises(ValueError, match="`optimizer=` is for Flax models"):
        autoaccum.train_step(model, (x, y), effective_batch=EFFECTIVE, optimizer="adam",
                             budget="1GiB", log=None)
    with pytest.raises(ValueError, match="one-shot iterator.*first 13 examples"):
        autoaccum.train_step(model, iter(list(_batches(x, y))), effective_batch=EFFECTIVE,
                             budget="1GiB", log=None)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux")
def test_a_real_out_of_memory_leaves_the_model_as_before_and_shrink_goes_on_exactly():
    from tests._oom_child import run_child

    # Micro-batch 32 needs ~60 MiB; after optimizer step 2 the cap drops to VmSize + 45 MiB.
    out = run_child("keras_train_step_oom", vocab=1024, length=128, n=128, batch=32,
                    fail_after=2, headroom_mib=45)
    assert out["failed_steps"] == [3] and out["kept"]  # weights and optimizer as before it
    assert out["micro_batch"] < 32 and out["micro_batch"] * out["accum_steps"] == 32
    assert "step 3: out of memory at micro_batch 32 x 1" in out["events"][0]
    assert out["iterations"] == 4 and out["max_abs_diff"] < 1e-5


@pytest.mark.slow
def test_a_data_parallel_step_over_four_devices_equals_train_on_batch_on_one():
    import json
    import subprocess

    from tests._paths import REPO, host_devices_env

    env = host_devices_env(4)
    done = subprocess.run([sys.executable, "-m", "tests._dp_child", "keras_train_step"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])["keras_train_step"]
    assert out["plan"][1] == 4 and out["plan"][0] * 4 * out["plan"][2] == 16
    np.testing.assert_allclose(out["losses"], out["ref_losses"], rtol=1e-5)
    assert out["weights_error"] <= 1e-5 and out["iterations"] == 2


@pytest.mark.slow
def test_a_keras_model_on_another_backend_is_refused_with_the_fix():
    import subprocess

    code = (
        "import os; os.environ['KERAS_BACKEND'] = 'numpy'\n"
        "import keras, numpy as np, autoaccum\n"
        "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
        "m.compile(optimizer='sgd', loss='mse')\n"
        "try:\n"
        "    autoaccum.train_step(m, (np.zeros((4, 3)), np.zeros((4, 1))), effective_batch=4)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "numpy"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    assert "JAX backend only" in done.stdout and "KERAS_BACKEND=jax" in done.stdout


@pytest.mark.slow
def test_a_keras_hub_task_takes_raw_strings_and_equals_fit():
    pytest.importorskip("keras_hub")
    from tests.adapters.keras._models import TEXTS, tiny_gpt2

    fitted, ours = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    autoaccum.fit(fitted, TEXTS, effective_batch=4, budget="1GiB", verbose=0, log=None,
                  training=autoaccum.Training(shuffle=False),
                  learning_rate=autoaccum.LearningRate(base_batch=4))
    step = autoaccum.train_step(ours, TEXTS, effective_batch=4, budget="1GiB",
                                log=None, learning_rate=autoaccum.LearningRate(base_batch=4))
    outs = [step(TEXTS[:4]), step(TEXTS[4:])]
    assert [o.step for o in outs] == [1, 2] and set(outs[0].logs) == {"loss", "accuracy"}
    assert max_diff(fitted, ours) < 1e-5
