"""The keras-hub path: raw prompt/response strings into a tiny Gemma3 with LoRA."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math

import numpy as np
import pytest

pytest.importorskip("keras_hub")
pytest.importorskip("tensorflow")

from autoaccum.adapters.keras import keras_fit
from autoaccum.internal import keras_program, to_keras_arrays
from autoaccum_demo._gemma_demo import build_demo_model, demo_data, load_qa

pytestmark = [
    pytest.mark.slow,  # subprocesses, keras-hub builds or large compiles
    pytest.mark.xdist_group("adapters.keras.test_keras_hub"),  # one worker builds the fixtures
]

SEQ = 32


@pytest.fixture(scope="module")
def raw():
    return demo_data(load_qa()[:8])


@pytest.fixture(scope="module")
def first():
    return build_demo_model(sequence_length=SEQ)


def test_raw_strings_are_preprocessed_to_static_arrays(raw, first):
    model = first
    arrays = to_keras_arrays(model, raw)
    assert arrays.num_examples == 8
    assert arrays.x["token_ids"].shape == (8, SEQ)
    assert arrays.y.shape == (8, SEQ) and arrays.sample_weight.shape == (8, SEQ)
    # keras-hub marks only the response tokens for the loss.
    assert 0 < arrays.sample_weight.sum() < arrays.x["padding_mask"].sum()


def test_lora_step_matches_native_big_batch(raw, first):
    # keras-hub's own `fit` cannot run this offline tokenizer through tf.data here
    # ("SentencepieceOp ... does not exist"), so the native reference step is
    # `train_on_batch` on the same preprocessed arrays.
    native = first
    ours = build_demo_model(sequence_length=SEQ, preprocessor=first.preprocessor)
    arrays = to_keras_arrays(native, raw)
    native.preprocessor = None
    native.train_on_batch(*arrays.packed)
    history = keras_fit(ours, raw, micro_batch=2, accum_steps=4, shuffle=False, verbose=0)
    loss = history.history["loss"][0]
    assert math.isfinite(loss)
    assert int(ours.optimizer.iterations) == 1
    diffs = [np.max(np.abs(np.asarray(a) - np.asarray(b)))
             for a, b in zip(native.get_weights(), ours.get_weights(), strict=True)]
    assert max(diffs) < 1e-5
    # LoRA: the base weights are frozen and passed to the step without donation.
    program = keras_program(ours, raw)
    assert len(program.parts["trainable"]) < len(program.frozen_args[0])


def test_a_keras_nlp_task_is_planned_and_trained_like_its_own_fit():
    """``keras_nlp.models...`` (what older guides and the seed's Colab lab import) is accepted
    everywhere a keras-hub task is: raw strings preprocessed, its blocks found for remat,
    planned, and trained exactly as its own ``fit`` trains it."""
    import keras_nlp

    import autoaccum
    from autoaccum.adapters.keras._keras_program import keras_blocks

    from ._models import TEXTS, max_diff, tiny_gpt2

    texts = TEXTS * 2
    ours, native = tiny_gpt2(hub="keras_nlp"), tiny_gpt2(hub="keras_nlp")
    assert isinstance(ours, keras_nlp.models.CausalLM)
    assert len(keras_blocks(ours)) == 2
    plan = autoaccum.plan(ours, texts, effective_batch=8, budget="1GiB", log=None)
    assert plan.micro_batch * plan.accum_steps == 8
    budget = autoaccum.measure(ours, texts, micro_batch=2, effective_batch=8).need_bytes
    history = autoaccum.fit(ours, texts, effective_batch=8, budget=budget, verbose=0, log=None,
                            training=autoaccum.Training(shuffle=False),
                            learning_rate=autoaccum.LearningRate(rule="none"))
    assert history.autoaccum_plan.accum_steps > 1
    expected = native.fit(texts, batch_size=8, shuffle=False, verbose=0)
    assert int(ours.optimizer.iterations) == 2
    assert max_diff(ours, native) < 1e-5
    assert history.history["loss"][0] == pytest.approx(expected.history["loss"][0], rel=1e-5)
