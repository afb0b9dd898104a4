"""A fit runs the step its plan compiled instead of compiling the same program again."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning._cache import keep_compiled, kept_count, reuse_or_compile


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.a = nnx.Linear(16, 64, rngs=rngs)
        self.b = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def mse(model, batch):
    errors = (model(batch["x"]) - batch["y"]) ** 2
    return jnp.sum(errors), jnp.asarray(errors.size, jnp.float32)


DATA = {"x": np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32),
        "y": np.zeros((32, 16), np.float32)}


@pytest.fixture
def compiled_programs(monkeypatch):
    """The text of every program compiled while the test runs."""
    texts = []
    compile_ = jax.stages.Lowered.compile

    def counting(self, *args, **kwargs):
        texts.append(self.as_text())
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counting)
    return texts


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_flax_fit_compiles_its_planned_step_once(compiled_programs):
    reused = kept_count()
    result = autoaccum.fit(MLP(rngs=nnx.Rngs(0)), DATA, effective_batch=8, budget="1GiB",
                           optimizer=optax.adam, learning_rate=1e-3, loss_fn=mse, epochs=1,
                           log=None, verbose=0, search=autoaccum.Search(cache=False))
    assert result.steps == 4
    assert kept_count() == reused + 1
    steps = [t for t in compiled_programs if "while" in t or "dot_general" in t]
    assert steps and len(steps) == len(set(steps))  # no program compiled twice


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_flax_fit_trains_with_the_trace_of_its_planned_step():
    traced = []

    def counted_mse(model, batch):
        traced.append(batch["x"].shape)
        return mse(model, batch)

    class AtTrainBegin(autoaccum.Callback):
        def on_train_begin(self, logs):
            self.before = len(traced)

    begin = AtTrainBegin()
    result = autoaccum.fit(MLP(rngs=nnx.Rngs(0)), DATA, effective_batch=8, budget="1GiB",
                           optimizer=optax.adam, learning_rate=1e-3, loss_fn=counted_mse,
                           epochs=1, log=None, verbose=0, search=autoaccum.Search(cache=False),
                           callbacks=[begin])
    assert result.steps == 4 and begin.before > 0
    assert len(traced) == begin.before  # the loop's step is the planner's trace: no new one


def test_a_step_kept_for_the_same_program_is_reused_instead_of_compiled():
    x = jnp.ones(3)
    lowered = jax.jit(lambda a: a * 2).lower(x)
    keep_compiled(lowered, lowered.compile())
    before = kept_count()
    step = reuse_or_compile(jax.jit(lambda a: a * 2).lower(x), (x,))
    assert (step(x).tolist(), kept_count() - before) == ([2.0, 2.0, 2.0], 1)


def test_the_same_program_for_other_compiler_options_is_compiled_again():
    x = jnp.ones(4)
    lowered = jax.jit(lambda a: a + 1).lower(x)
    keep_compiled(lowered, lowered.compile(), {"xla_cpu_enable_fast_math": True})
    reused = kept_count()
    assert reuse_or_compile(jax.jit(lambda a: a + 1).lower(x), (x,))(x).tolist() == [2.0] * 4
    assert kept_count() == reused


def test_a_kept_step_for_arguments_placed_elsewhere_is_compiled_again():
    x = jnp.ones(4)
    lowered = jax.jit(lambda a: a - 1).lower(x)
    keep_compiled(lowered, lowered.compile())
    reused = kept_count()
    # The same program, to be called with an array the kept executable was not compiled for
    # (in pinned host memory, not the device's): compiled again rather than called with it.
    pinned = jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                                 memory_kind="pinned_host"))
    assert reuse_or_compile(jax.jit(lambda a: a - 1).lower(x), (pinned,))
    assert kept_count() == reused
    # A host NumPy array goes where jit would put it, on the default device: kept one used.
    compiled = reuse_or_compile(jax.jit(lambda a: a - 1).lower(x), (np.ones(4, np.float32),))
    assert kept_count() == reused + 1
    assert compiled(np.ones(4, np.float32)).tolist() == [0.0] * 4


def test_a_program_that_calls_back_into_python_is_never_reused():
    # Two programs that read the same but call different Python functions: the second must
    # call its own (the text names a callback by an index, not by the function).
    x = jnp.ones(4)

    def with_callback(function):
        return jax.jit(lambda a: jax.pure_callback(
            function, jax.ShapeDtypeStruct((4,), jnp.float32), a))

    first = with_callback(lambda a: np.asarray(a) * 2).lower(x)
    keep_compiled(first, first.compile())
    reused = kept_count()
    second = with_callback(lambda a: np.asarray(a) * 3).lower(x)
    assert reuse_or_compile(second, (x,))(x).tolist() == [3.0] * 4
    assert kept_count() == reused


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_keras_fit_compiles_its_planned_step_once(compiled_programs):
    # The plan measures the step the fit runs (Keras's logs included), so the fit runs the
    # probe the plan compiled instead of compiling that program again.
    import keras

    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(16)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    reused = kept_count()
    history = autoaccum.fit(model, (DATA["x"], DATA["y"]), effective_batch=8, budget="1GiB",
                            epochs=1, log=None, verbose=0, search=autoaccum.Search(cache=False))
    assert int(model.optimizer.iterations) == 4
    assert set(history.history) == {"loss", "mae"}
    assert kept_count() == reused + 1
    steps = [t for t in compiled_programs if "while" in t or "dot_general" in t]
    assert steps and len(steps) == len(set(steps))  # no program compiled twice
