"""The Keras adapter's advisor hooks: another optimizer, LoRA, int8 frozen weights under LoRA
(QLoRA) and bfloat16 weights, each planned on an abstract copy of the model (the user's model
is never touched and the copy allocates no weight); every advised row fits when the user
applies its change to the model and plans it."""

import os
import resource
import warnings

import jax
import keras
import numpy as np
import pytest
from keras.src.backend.common import global_state

import autoaccum
from autoaccum.adapters import adapter_for
from autoaccum.adapters.keras._internals import variable_buffer
from autoaccum.adapters.keras._keras_advice import keras_apply_change
from autoaccum.planning._plan_options import ProgramOptions

OPTIMIZERS = {"adafactor": keras.optimizers.Adafactor, "sgd": keras.optimizers.SGD,
              "lion": keras.optimizers.Lion}

VOCAB, SEQ = 1024, 8


def sequential_model(dtype=None, optimizer=None, lora_rank=None, quantize=None):
    """Embedding -> five Dense(256) -> pooling -> Dense: 460k weights (1.8 MB in float32)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((SEQ,), dtype="int32"), keras.layers.Embedding(VOCAB, 128, dtype=dtype),
        *[keras.layers.Dense(256, activation="relu", dtype=dtype) for _ in range(5)],
        keras.layers.GlobalAveragePooling1D(dtype=dtype), keras.layers.Dense(128, dtype=dtype)])
    return compiled_as_user_would(model, optimizer, lora_rank, quantize)


def functional_model(dtype=None, optimizer=None, lora_rank=None, quantize=None):
    """Embedding -> three residual Dense(256)/Dense(64) blocks -> pooling -> Dense: 173k
    weights."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 64, dtype=dtype)(tokens)
    for _ in range(3):
        inner = keras.layers.Dense(256, activation="relu", dtype=dtype)(h)
        h = keras.layers.Add(dtype=dtype)([h, keras.layers.Dense(64, dtype=dtype)(inner)])
    pooled = keras.layers.GlobalAveragePooling1D(dtype=dtype)(h)
    model = keras.Model(tokens, keras.layers.Dense(128, dtype=dtype)(pooled))
    return compiled_as_user_would(model, optimizer, lora_rank, quantize)


def compiled_as_user_would(model, optimizer, lora_rank, quantize):
    """``model.quantize("int8")``, then ``layer.enable_lora(rank)`` on every layer that has
    it, then ``compile``: the changes of the advisor's rows, applied by hand."""
    if quantize:
        with warnings.catch_warnings():  # "Layer InputLayer does not have a quantize method"
            warnings.simplefilter("ignore", UserWarning)
            model.quantize(quantize)
    if lora_rank:
        for layer in model.layers:
            if hasattr(layer, "enable_lora") and layer.weights:
                layer.enable_lora(lora_rank)
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy")
    return model


def token_data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, VOCAB, (16, SEQ)).astype("int32"),
            rng.integers(0, 128, (16,)).astype("int32"))


BUDGETS = {sequential_model: 6_500_000,  # full fine-tune needs 7.6 MB, bfloat16 6.2 MB
           functional_model: 2_600_000}  # full fine-tune needs 2.9 MB, bfloat16 2.3 MB


def the_change_by_hand(build, change):
    optimizer = OPTIMIZERS[change["optimizer"]]() if "optimizer" in change else None
    return build(dtype=change.get("dtype"), optimizer=optimizer,
                 lora_rank=change.get("lora_rank"), quantize=change.get("quantize"))


def snapshot(model):
    return {"weights": [np.array(w) for w in model.get_weights()],
            "trainable": len(model.trainable_variables),
            "lora": [getattr(layer, "lora_enabled", False) for layer in model.layers],
            "policies": [layer.dtype_policy.name for layer in model.layers],
            "optimizer": model.optimizer, "built": model.optimizer.built}


def assert_untouched(model, before):
    after = snapshot(model)
    assert all(np.array_equal(a, b) for a, b in zip(before["weights"], after["weights"],
                                                     strict=True))
    assert after["trainable"] == before["trainable"]
    assert after["lora"] == before["lora"] and not any(after["lora"])
    assert after["policies"] == before["policies"]
    assert after["optimizer"] is before["optimizer"] and after["built"] == before["built"]


def pending_variables() -> int:
    return len(global_state.get_global_attribute("uninitialized_variables") or [])


@pytest.mark.slow  # about 17 s: every row compiled, then each planned again by hand
@pytest.mark.parametrize("build", [sequential_model, functional_model],
                         ids=["sequential", "functional"])
def test_every_advised_row_fits_when_the_user_applies_its_change(build, tmp_path):
    # One need cache for the advisor and the re-plans: the cache is keyed by the lowered
    # program's text, so a re-plan whose every probe is found there compiled the very
    # programs the advisor measured (a change applied by hand that differed would miss).
    model, budget = build(), BUDGETS[build]
    before = snapshot(model)
    advice = autoaccum.advise(model, token_data(), effective_batch=2, budget=budget, log=None,
                              search=autoaccum.Search(cache=str(tmp_path)))
    assert not advice.fits
    changes = [a.change for a in advice.alternatives]
    assert {"lora_rank": 16} in changes and {"dtype": "bfloat16"} in changes
    assert {"lora_rank": 16, "quantize": "int8"} in changes
    assert any("optimizer" in c for c in changes)
    assert_untouched(model, before)
    for row in advice.alternatives:
        if "device" in row.change:
            continue
        assert "remat" not in row.change
        replanned = autoaccum.plan(the_change_by_hand(build, row.change), token_data(),
                                   effective_batch=2, budget=budget, log=None,
                                   search=autoaccum.Search(cache=str(tmp_path), method="compile",
                                   remat="none"))
        assert replanned.need_bytes <= budget, row.change
        assert (replanned.micro_batch, replanned.accum_steps) == (row.micro_batch,
                                                                  row.accum_steps)
        assert replanned.need_bytes == row.need_bytes, row.change
        # the same programs: every probe's figures were found under its lowered text
        assert {p.estimate.source for p in replanned.probes} == {"cache"}, row.change


@pytest.mark.parametrize("change", [{"lora_rank": 4}, {"dtype": "bfloat16"},
                                    {"lora_rank": 4, "quantize": "int8"},
                                    {"lora_rank": 4, "optimizer": "sgd"}],
                         ids=["lora", "bfloat16", "qlora", "lora-sgd"])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_planned_copy_allocates_no_weight_and_leaves_the_model_untouched(change):
    model = functional_model()
    before, pending = snapshot(model), pending_variables()
    copy, options = adapter_for(model).apply_change(model, {}, change)
    plan = autoaccum.plan(copy, token_data(), effective_batch=2, log=None, **options,
                          search=autoaccum.Search(cache=False, method="compile", remat="none"))
    assert plan.micro_batch == 2
    assert copy is not model and copy.weights
    assert all(v._value is None for v in copy.weights)  # deferred: no buffer, ever
    assert pending_variables() == pending  # nothing left for Keras to initialize later
    assert_untouched(model, before)
    if "optimizer" in change:
        assert isinstance(copy.optimizer, keras.optimizers.SGD)


def resident_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's statm")
def test_copies_of_a_large_model_allocate_none_of_its_weights():
    from autoaccum.adapters.keras._keras_step import keras_lowering_scope

    warm = keras.Sequential([keras.Input((SEQ,), dtype="int32"), keras.layers.Embedding(8, 4),
                             keras.layers.Dense(4)])  # JAX and Keras set up first
    warm.compile(optimizer="adam", loss="mse")
    adapter_for(warm).apply_change(warm, {}, {"lora_rank": 4, "quantize": "int8"})
    with keras_lowering_scope():  # 270M weights, deferred themselves (1.1 GB in float32)
        model = keras.Sequential([
            keras.Input((SEQ,), dtype="int32"), keras.layers.Embedding(256_000, 1024),
            keras.layers.Dense(4096), keras.layers.Dense(1024)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    embedding_kib = 256_000 * 1024 * 4 // 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    if peak - resident_kib() > embedding_kib // 2:
        pytest.skip("this process peaked too high before: making the embedding would not "
                    "move the peak")
    for change in ({"lora_rank": 16}, {"dtype": "bfloat16"},
                   {"lora_rank": 16, "quantize": "int8"}):
        copy, _ = adapter_for(model).apply_change(model, {}, change)
        assert all(v._value is None for v in copy.weights)
    jax.block_until_ready(jax.live_arrays())  # work dispatched, not yet run, counts too
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown < embedding_kib // 10, f"the peak memory grew by {grown} KiB"


def test_the_copy_holds_the_change_as_a_user_would_make_it():
    model = sequential_model()
    adapter = adapter_for(model)
    lora, _ = adapter.apply_change(model, {}, {"lora_rank": 4})
    names = lambda variables: {v.path.split("/")[-1] for v in variables}  # noqa: E731
    assert names(lora.trainable_variables) == {"lora_embeddings_a", "lora_embeddings_b",
                                               "lora_kernel_a", "lora_kernel_b", "bias"}
    assert {v.shape[-1] for v in lora.trainable_variables if v.path.endswith("_a")} == {4}
    assert names(lora.non_trainable_variables) == {"embeddings", "kernel"}
    qlora, _ = adapter.apply_change(model, {}, {"lora_rank": 4, "quantize": "int8"})
    assert {v.dtype for v in qlora.non_trainable_variables} == {"int8", "float32"}  # scales
    assert all(v.dtype == "int8" for v in qlora.non_trainable_variables
               if v.path.endswith(("kernel", "embeddings")))
    assert names(qlora.trainable_variables) == names(lora.trainable_variables)
    half, _ = adapter.apply_change(model, {}, {"dtype": "bfloat16"})
    assert {v.dtype for v in half.weights} == {"bfloat16"}
    assert len(half.trainable_variables) == len(model.trainable_variables)


def _dense_8_to_4():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    return model


def test_a_lora_change_gives_a_copy_training_lora_kernels_with_no_weight_allocated():
    model = _dense_8_to_4()
    copy, _ = keras_apply_change(model, ProgramOptions(), {"lora_rank": 2})
    assert [v.path.split("/")[-1] for v in copy.trainable_variables] == [
        "bias", "lora_kernel_a", "lora_kernel_b"]
    assert model.layers[0].lora_enabled is False
    assert all(variable_buffer(v) is None for v in copy.weights)


def test_a_dtype_change_gives_a_copy_in_that_dtype_and_leaves_the_model_in_its_own():
    model = _dense_8_to_4()
    copy, _ = keras_apply_change(model, ProgramOptions(), {"dtype": "bfloat16"})
    assert (copy.layers[0].kernel.dtype, model.layers[0].kernel.dtype) == (
        "bfloat16", "float32")


def test_a_model_with_lora_is_advised_a_smaller_rank_and_planned_at_it():
    model = sequential_model(lora_rank=8)
    changes = adapter_for(model).advice_changes(model, {})
    assert {"lora_rank": 2} in changes and {"lora_rank": 16} not in changes
    assert {"lora_rank": 8, "quantize": "int8"} in changes
    copy, _ = adapter_for(model).apply_change(model, {}, {"lora_rank": 2})
    assert {layer.lora_rank for layer in copy.layers if getattr(layer, "lora_enabled", False)
            } == {2}
    assert {layer.lora_rank for layer in model.layers if layer.weights} == {8}


def gpt2_by_hand(change, *, rank=8):
    """The tiny keras-hub GPT-2 with LoRA at ``rank`` on its backbone's default targets,
    then ``change`` applied as a keras-hub user would."""
    from ._models import tiny_gpt2

    model = tiny_gpt2()
    if "dtype" in change:
        config = {**model.backbone.get_config(), "dtype": change["dtype"]}
        model = type(model)(backbone=type(model.backbone).from_config(config),
                            preprocessor=model.preprocessor)
    if change.get("quantize"):
        with warnings.catch_warnings():  # "Layer Add does not have a quantize method"
            warnings.simplefilter("ignore", UserWarning)
            model.backbone.quantize(change["quantize"])
    model.backbone.enable_lora(change.get("lora_rank", rank))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model


@pytest.mark.slow  # keras-hub builds and six compiles: about 20 s
def test_a_keras_hub_model_with_lora_is_planned_as_each_change_applied_by_hand(tmp_path):
    pytest.importorskip("keras_hub")
    pytest.importorskip("tensorflow")
    from ._models import TEXTS

    model = gpt2_by_hand({})
    before, pending = snapshot(model), pending_variables()
    adapter = adapter_for(model)
    changes = adapter.advice_changes(model, {})
    assert {"lora_rank": 2} in changes and {"lora_rank": 8, "quantize": "int8"} in changes
    for change in ({"lora_rank": 2}, {"lora_rank": 8, "quantize": "int8"},
                   {"dtype": "bfloat16"}):
        copy, _ = adapter.apply_change(model, {}, change)
        assert all(v._value is None for v in copy.weights)
        planned = autoaccum.plan(copy, TEXTS, effective_batch=4, log=None,
                                 search=autoaccum.Search(cache=str(tmp_path), method="compile",
                                 remat="none"))
        by_hand = autoaccum.plan(gpt2_by_hand(change), TEXTS, effective_batch=4, log=None,
                                 search=autoaccum.Search(cache=str(tmp_path), method="compile",
                                 remat="none"))
        assert planned.need_bytes == by_hand.need_bytes, change
        # the same programs: the change by hand lowers to the text the copy was compiled from
        assert {p.estimate.source for p in by_hand.probes} == {"cache"}, change
    assert pending_variables() == pending
    after = snapshot(model)
    assert after["trainable"] == before["trainable"] and after["lora"] == before["lora"]
    assert all(np.array_equal(a, b) for a, b in zip(before["weights"], after["weights"],
                                                     strict=True))


class Scaled(keras.Model):
    """A subclassed model made from an object Keras cannot serialize: no config."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale
        self.body = keras.layers.Dense(256, activation="relu")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.body(x) * self.scale.factor)


class Factor:
    factor = 2.0


def scaled_model():
    keras.utils.set_random_seed(0)
    model = Scaled(Factor())
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def regression():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 64)).astype("float32"), np.zeros((16, 1), np.float32)


def test_a_model_without_a_config_is_refused_with_the_reason():
    model = scaled_model()
    model(regression()[0][:2])
    with pytest.raises(ValueError, match=r"rebuilt from its config.*Scaled has none.*"
                                         r"get_config"):
        adapter_for(model).apply_change(model, {}, {"lora_rank": 4})


@pytest.mark.slow  # about 3 s: the model and the optimizer rows compiled
def test_a_model_without_a_config_gets_no_copied_rows_and_the_advice_says_why():
    model = scaled_model()
    x, y = regression()  # x and y apart, as model.fit (and autoaccum.plan) take them
    advice = autoaccum.advise(model, x, y, effective_batch=2, budget=250_000,
                              log=None, search=autoaccum.Search(cache=False))
    assert not advice.fits
    copied = ("lora_rank", "dtype", "quantize")
    assert not [a for a in advice.alternatives if set(a.change) & set(copied)]
    why = [why for change, why in advice.tried if set(change) & set(copied)]
    assert why and all("rebuilt from its config" in w and "Scaled has none" in w for w in why)
    assert any("optimizer" in a.change for a in advice.alternatives)


def test_a_change_keras_cannot_take_is_refused_by_name():
    model = sequential_model()
    with pytest.raises(ValueError, match="mu_dtype"):
        adapter_for(model).apply_change(model, {}, {"mu_dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"Received: change=\{'quantize': 'int8'\}"):
        adapter_for(model).apply_change(model, {}, {"quantize": "int8"})
