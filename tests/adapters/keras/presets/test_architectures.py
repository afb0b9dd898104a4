"""Shipped keras-hub architectures: they load, bad names get help, and 1B builds abstractly."""

from __future__ import annotations

import json
import math

import pytest

from autoaccum.adapters.keras.presets._architectures import (
    Architecture,
    architectures_dir,
    list_architectures,
    load_architecture,
)

REQUIRED = {
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma2_2b",
    "llama3.2_1b",
    "llama3.2_3b",
    "llama3.1_8b",
    "mistral_7b",
}


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return -1


def test_required_architectures_are_shipped() -> None:
    assert set(list_architectures()) >= REQUIRED


@pytest.mark.parametrize("name", list_architectures())
def test_every_architecture_loads(name: str) -> None:
    arch = load_architecture(name)
    assert isinstance(arch, Architecture)
    assert arch.name == name
    assert arch.keras_hub_preset in arch.keras_hub_presets
    assert arch.backbone_class.endswith("Backbone")
    assert arch.causal_lm_class.endswith("CausalLM")
    # The abstract count matches keras-hub's published preset size (within 2%; exact today).
    published = arch.published_parameter_count
    assert abs(arch.parameter_count - published) <= 0.02 * published
    # The config is read-only and the file holds nothing the dataclass does not know.
    with pytest.raises(TypeError):
        arch.backbone_config["num_layers"] = 1  # type: ignore[index]
    raw = json.loads((architectures_dir() / f"{name}.json").read_text())
    assert raw["backbone_config"] == arch.backbone_kwargs()


def test_multimodal_gemma3_is_text_only_with_note() -> None:
    for name in ("gemma3_4b", "gemma3_12b"):
        arch = load_architecture(name)
        assert arch.backbone_config["vision_encoder"] is None
        assert "text" in arch.keras_hub_preset
        assert "multimodal" in arch.note


def test_preset_names_and_spellings_resolve() -> None:
    assert load_architecture("gemma3_instruct_4b_text").name == "gemma3_4b"
    assert load_architecture("Gemma3-1B").name == "gemma3_1b"
    assert load_architecture("mistral_instruct_7b_en").name == "mistral_7b"


def test_unknown_name_suggests_near_name() -> None:
    with pytest.raises(ValueError, match=r"Did you mean 'gemma3_4b'") as info:
        load_architecture("gemma3_4bb")
    assert "Known architectures:" in str(info.value)
    assert "llama3.1_8b" in str(info.value)
    with pytest.raises(ValueError, match="Known architectures"):
        load_architecture("bert_base_en")


@pytest.mark.slow  # 1-2 s at rest: make test runs it, make test-fast does not
def test_gemma3_1b_builds_abstractly_without_allocating() -> None:
    import keras_hub  # noqa: F401  (imported first: its import alone adds ~800 MiB of RSS)

    from autoaccum.adapters.keras.presets._architectures import (
        abstract_state,
        build_abstract_causal_lm,
    )

    arch = load_architecture("gemma3_1b")
    before = _rss_mib()
    model = build_abstract_causal_lm(arch, lora_rank=4)
    grown = _rss_mib() - before
    # Published: 999,885,952 (keras-hub preset metadata); must be within 2%. With LoRA on,
    # the original weights are exactly the frozen (non-trainable) ones.
    count = sum(math.prod(v.shape) for v in model.non_trainable_variables)
    assert abs(count - 999_885_952) <= 0.02 * 999_885_952
    assert count == arch.parameter_count
    # Nothing allocated: no weight, LoRA factor or optimizer slot has a value, and RSS did not
    # grow by anything like the 2 GB of bfloat16 weights.
    weights = model.trainable_variables + model.non_trainable_variables
    slots = [v for v in model.optimizer.variables if v.shape != ()]
    assert all(v._value is None for v in weights + slots)
    assert grown < 500, f"RSS grew by {grown} MiB"
    state = abstract_state(model)
    assert len(state.trainable) == 26 * 2 * 2  # LoRA a/b on query and value in 26 blocks
    assert {str(s.dtype) for s in state.trainable} == {"float32"}
    assert str(state.non_trainable[0].dtype) == "bfloat16"
    assert sum(s.size for s in state.non_trainable) == count
    assert model.backbone.count_params() == count + sum(s.size for s in state.trainable)
    assert len(state.optimizer) == 2 + 2 * len(state.trainable)  # iteration, lr, m and v


def test_abstract_model_stays_abstract_after_a_symbolic_call() -> None:
    """Keras initializes pending variables when a top-level StatelessScope exits; the
    builder removes its variables from that list, so later keras work allocates nothing."""
    import jax
    import keras

    from autoaccum.adapters.keras.presets._architectures import (
        abstract_state,
        build_abstract_causal_lm,
    )

    model = build_abstract_causal_lm(
        "llama3.2_1b", lora_rank=2, backbone_overrides={"num_layers": 1}
    )
    with keras.StatelessScope():  # a top-level scope that initializes pending variables
        pass
    state = abstract_state(model)
    lowered = jax.jit(lambda t, n, x: model.stateless_call(t, n, x)[0]).lower(
        state.trainable,
        state.non_trainable,
        {
            "token_ids": jax.ShapeDtypeStruct((1, 8), "int32"),
            "padding_mask": jax.ShapeDtypeStruct((1, 8), "int32"),
        },
    )
    assert lowered.out_info.shape == (1, 8, 128256)
    assert model.backbone.token_embedding.embeddings._value is None


def test_bad_lora_rank_is_rejected() -> None:
    from autoaccum.adapters.keras.presets._architectures import build_abstract_causal_lm

    with pytest.raises(ValueError, match="lora_rank"):
        build_abstract_causal_lm("gemma3_1b", lora_rank=0)
