"""A fit runs the step its plan compiled instead of compiling the same program again."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.planning import _cache
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


@pytest.fixture
def compile_options(monkeypatch):
    """The ``compiler_options`` of every step program compiled while the test runs."""
    options = []
    compile_ = jax.stages.Lowered.compile

    def recording(self, *args, **kwargs):
        if "while" in self.as_text():
            options.append(dict(kwargs.get("compiler_options") or {}))
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    return options


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_fit_compiles_its_first_fit_point_for_memory_alone_and_trains_on_the_answer(
        compile_options):
    # 48 rows, effective batch 16 under a budget that micro-batch 2 (46 KB) fits and the
    # whole batch (49 KB) does not: the first fit point (2) is compiled with its machine code
    # unoptimised and not kept; the others in full, and the loop runs the answer's.
    options = dict(optimizer=optax.adam, learning_rate=1e-3, loss_fn=mse, log=None,
                   search=autoaccum.Search(cache=False))
    data = {k: np.concatenate([v, v[:16]]) for k, v in DATA.items()}
    reused = kept_count()
    result = autoaccum.fit(MLP(rngs=nnx.Rngs(0)), data, effective_batch=16, budget=47_000,
                           epochs=1, verbose=0, **options)
    accumulating = {p.micro_batch for p in result.plan.probes if p.accum_steps > 1}
    assert result.plan.probes[0].micro_batch == 2 and result.plan.micro_batch > 2
    first, *rest = compile_options
    assert first == {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True}
    assert rest and all(o == {} for o in rest)
    assert kept_count() == reused + 1
    assert len(compile_options) == len(accumulating)  # the loop compiled nothing
    assert result.steps == 3


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_first_fit_point_that_is_the_answer_is_compiled_in_full_to_train(compile_options,
                                                                          monkeypatch):
    # A budget a quarter of the way from micro-batch 2's need to 4's: 2 fits and 3 does not,
    # so the plan's answer was compiled for its memory alone and the loop compiles it once
    # more, in full.
    options = dict(optimizer=optax.adam, learning_rate=1e-3, loss_fn=mse,
                   search=autoaccum.Search(cache=False))
    two, four = (autoaccum.measure(MLP(rngs=nnx.Rngs(0)), DATA, micro_batch=b,
                                   effective_batch=8, **options).need_bytes for b in (2, 4))
    compile_options.clear()
    monkeypatch.setattr(_cache, "_KEPT", collections.OrderedDict())  # measure kept its steps
    result = autoaccum.fit(MLP(rngs=nnx.Rngs(0)), DATA, effective_batch=8,
                           budget=two + (four - two) // 4, epochs=1, verbose=0, log=None,
                           **options)
    assert result.plan.micro_batch == 2 and result.steps == 4
    assert compile_options[0] == {"xla_backend_optimization_level": 0,
                                  "xla_llvm_disable_expensive_passes": True}
    assert compile_options[-1] == {}  # the loop's own compile of micro-batch 2
    assert len(compile_options) == len(
        {p.micro_batch for p in result.plan.probes if p.accum_steps > 1}) + 1


def test_a_step_compiled_for_its_memory_alone_reports_the_same_figures():
    from autoaccum.planning._measure import MEASURING_OPTIONS

    def step(w, x):
        return jax.lax.fori_loop(0, 3, lambda i, w: w - 0.1 * jnp.tanh(x @ w), w)

    lowered = jax.jit(step).lower(jnp.ones((64, 64)), jnp.ones((64, 64)))
    full = lowered.compile().memory_analysis()
    alone = lowered.compile(compiler_options=dict(MEASURING_OPTIONS["cpu"])).memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes")
    assert [getattr(alone, f) for f in fields] == [getattr(full, f) for f in fields]


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


def _counting_keras_model(traced: list, optimizer):
    """``Input(16) -> Dense(64, relu) -> Dense(16)`` (biases of 1, which weight decay would
    move) behind a layer that records the batch shape of every trace of the model (not
    Keras's symbolic build)."""
    import keras

    class Counted(keras.layers.Layer):
        def call(self, x):
            if not isinstance(x, keras.KerasTensor):
                traced.append(tuple(x.shape))
            return x

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), Counted(),
                              keras.layers.Dense(64, activation="relu", bias_initializer="ones"),
                              keras.layers.Dense(16, bias_initializer="ones")])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _keras_fit(model, traced, monkeypatch, **search):
    """``autoaccum.fit``; returns its history and how many times its training loop traced
    the model (from the loop's start on)."""
    from autoaccum.adapters.keras import _keras_fit as fit_module

    at_loop = []
    runner = fit_module.keras_runner

    def starting(*args, **kwargs):
        at_loop.append(len(traced))
        return runner(*args, **kwargs)

    monkeypatch.setattr(fit_module, "keras_runner", starting)
    history = autoaccum.fit(model, (DATA["x"], DATA["y"]), effective_batch=8, budget="1GiB",
                            epochs=1, log=None, verbose=0,
                            search=autoaccum.Search(cache=False, **search),
                            training=autoaccum.Training(shuffle=False))
    return history, len(traced) - at_loop[0]


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_keras_fit_trains_with_the_trace_of_its_planned_step(monkeypatch):
    import keras

    traced = []
    model = _counting_keras_model(traced, keras.optimizers.AdamW(1e-2))
    _, loop_traces = _keras_fit(model, traced, monkeypatch)
    assert int(model.optimizer.iterations) == 4
    assert loop_traces == 0  # the loop's step is the planner's trace


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_keras_fit_whose_optimizer_differs_from_its_config_trains_with_its_own(monkeypatch):
    # AdamW's exclude_from_weight_decay() is kept outside its config, so the plan's clone of
    # the unbuilt optimizer decays every weight: the loop traces its step with the model's
    # own optimizer, and the biases are not decayed, as in Keras's model.fit.
    import keras

    def optimizer():
        adamw = keras.optimizers.AdamW(1e-2, weight_decay=0.5)
        adamw.exclude_from_weight_decay(var_names=["bias"])
        return adamw

    traced = []
    ours = _counting_keras_model(traced, optimizer())
    _, loop_traces = _keras_fit(ours, traced, monkeypatch)
    assert loop_traces == 1
    theirs = _counting_keras_model([], optimizer())
    theirs.fit(DATA["x"], DATA["y"], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_within_a_fit_a_keras_step_is_one_function_per_rematerialization():
    import keras

    from autoaccum.adapters.keras._keras_program import find_layout, keras_rematerialized
    from autoaccum.adapters.keras._keras_step import keras_train_step
    from autoaccum.planning._cache import functions_of_one_fit

    model = _counting_keras_model([], "sgd")
    layout = find_layout(model, (jax.ShapeDtypeStruct((16,), jnp.float32),
                                 jax.ShapeDtypeStruct((16,), jnp.float32)))
    dense = lambda layer: isinstance(layer, keras.layers.Dense)  # noqa: E731
    assert keras_train_step(model, layout) is not keras_train_step(model, layout)  # no fit
    with functions_of_one_fit():
        plain = keras_train_step(model, layout)
        assert keras_train_step(model, layout) is plain
        with keras_rematerialized(model, "nothing", layers=dense):
            nothing = keras_train_step(model, layout)
            assert nothing is not plain and keras_train_step(model, layout) is nothing
        with keras_rematerialized(model, "dots", layers=dense):
            assert keras_train_step(model, layout) not in (plain, nothing)
        assert keras_train_step(model, layout) is plain
        assert keras_train_step(model, layout, batch_stats="micro") is not plain


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_rematerialized_keras_fit_trains_with_the_trace_of_its_planned_step(monkeypatch):
    import keras

    traced = []
    model = _counting_keras_model(traced, keras.optimizers.Adam(1e-2))
    dense = lambda layer: isinstance(layer, keras.layers.Dense)  # noqa: E731
    history, loop_traces = _keras_fit(model, traced, monkeypatch, remat="nothing",
                                      remat_layers=dense)
    assert history.autoaccum_plan.remat == "nothing"
    assert int(model.optimizer.iterations) == 4 and loop_traces == 0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_throughput_fit_compiles_each_timed_step_once_and_the_loop_none(compiled_programs,
                                                                          monkeypatch):
    # Throughput times 8, 4 and 3 (3 + 3 + 2) and may choose any of them: each is compiled
    # once, donating and kept (the search's own, or its timing's), so the loop runs its
    # choice as compiled.
    # Before, a choice the search had not compiled was compiled three times: to be timed
    # (not donating), for its memory figure, and by the loop.
    monkeypatch.setattr(_cache, "_KEPT", collections.OrderedDict())
    result = autoaccum.fit(MLP(rngs=nnx.Rngs(0)), DATA, effective_batch=8, budget="1GiB",
                           optimizer=optax.adam, learning_rate=1e-3, loss_fn=mse, epochs=1,
                           log=None, verbose=0,
                           search=autoaccum.Search(cache=False, objective="throughput"))
    assert sorted(c.micro_batch for c in result.plan.candidates) == [3, 4, 8]
    steps = [t for t in compiled_programs if "while" in t or "dot_general" in t]
    assert len(steps) == len(set(steps)) == result.plan.compiles.full


def test_a_plan_verified_by_a_real_step_runs_its_compiled_step_on_a_copy(compiled_programs):
    # method="auto" on this machine checks the choice with one real step: the plan's own
    # compiled step, which donates its state, run on a copy; no step compiled for the check,
    # and the model's weights are neither deleted nor changed.
    model = MLP(rngs=nnx.Rngs(0))
    before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    reused = kept_count()
    plan = autoaccum.plan(model, DATA, effective_batch=8, budget="1GiB", optimizer=optax.adam,
                          learning_rate=1e-3, loss_fn=mse, log=None,
                          search=autoaccum.Search(cache=False))
    assert plan.probes[-1].kind == "real step" and plan.probes[-1].fits
    assert kept_count() == reused + 1
    steps = [t for t in compiled_programs if "while" in t or "dot_general" in t]
    assert plan.compiles.full == len(steps) == len(set(steps))
    after = nnx.state(model, nnx.Param)
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(after))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, after))


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_keras_plan_verified_by_a_real_step_compiles_no_step_for_it(compiled_programs):
    import keras

    model = _counting_keras_model([], keras.optimizers.Adam(1e-2))
    before = [np.array(w) for w in model.get_weights()]
    reused = kept_count()
    plan = autoaccum.plan(model, (DATA["x"], DATA["y"]), effective_batch=8, budget="1GiB",
                          log=None, search=autoaccum.Search(cache=False))
    assert plan.probes[-1].kind == "real step" and kept_count() == reused + 1
    steps = [t for t in compiled_programs if "while" in t or "dot_general" in t]
    assert plan.compiles.full == len(steps)
    assert not model.optimizer.built
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
