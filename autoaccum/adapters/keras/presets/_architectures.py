"""Offline keras-hub architectures: backbone configs shipped as data, built without weights.

``autoaccum/data/architectures/<name>.json`` holds what keras-hub's ``Backbone.get_config()``
gives for a public preset (Gemma 2/3, Llama 3.x, Mistral), so ``autoaccum plan --preset NAME``
can plan a fine-tune on a machine that cannot download the preset. :func:`load_architecture`
reads one; :func:`build_abstract_causal_lm` (in :mod:`._abstract_lm`) builds its
``CausalLM`` with no weight allocated.

>>> from autoaccum.adapters.keras.presets import list_architectures, load_architecture
>>> "gemma3_4b" in list_architectures()
True
>>> arch = load_architecture("gemma3_instruct_4b_text")     # a keras-hub preset name works too
>>> arch.name, arch.backbone_class, arch.backbone_config["num_layers"]
('gemma3_4b', 'Gemma3Backbone', 34)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "Architecture",
    "architectures_dir",
    "list_architectures",
    "load_architecture",
]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One shipped architecture: keras-hub class names, backbone config and sizes.

    ``parameter_count`` is counted from an abstract build of ``backbone_config`` (no LoRA);
    ``published_parameter_count`` is keras-hub's preset metadata ``params`` for
    ``keras_hub_preset``. ``backbone_config`` is read-only; ``backbone_kwargs()`` copies it.
    """

    name: str
    family: str
    keras_hub_preset: str
    keras_hub_presets: tuple[str, ...]
    backbone_class: str
    causal_lm_class: str
    preprocessor_class: str
    tokenizer_class: str
    parameter_count: int
    published_parameter_count: int
    source: str
    note: str
    backbone_config: Mapping[str, Any] = dataclasses.field(hash=False)

    def backbone_kwargs(self) -> dict[str, Any]:
        """A fresh ``dict`` of ``backbone_config``, to pass to the backbone class.

        >>> from autoaccum.adapters.keras.presets import load_architecture
        >>> load_architecture("mistral_7b").backbone_kwargs()["sliding_window"]
        4096
        """
        return dict(self.backbone_config)


def architectures_dir() -> Path:
    """The folder holding the ``<name>.json`` architecture files.

    >>> from autoaccum.adapters.keras.presets import architectures_dir
    >>> (architectures_dir() / "gemma3_1b.json").is_file()
    True
    """
    return Path(__file__).resolve().parent / "architectures"


def list_architectures() -> list[str]:
    """Names of the shipped architectures, sorted.

    >>> from autoaccum.adapters.keras.presets import list_architectures
    >>> list_architectures()[:3]
    ['gemma2_2b', 'gemma3_12b', 'gemma3_1b']
    """
    return sorted(p.stem for p in architectures_dir().glob("*.json"))


def load_architecture(name: str) -> Architecture:
    """The architecture called ``name``, or whose keras-hub presets include ``name``.

    Case, ``-`` and ``_`` do not matter (``"Gemma3-4B"`` finds ``gemma3_4b``). An unknown
    name raises ``ValueError`` naming close matches and every known architecture.

    >>> from autoaccum.adapters.keras.presets import load_architecture
    >>> load_architecture("Llama3.2-1B").keras_hub_preset
    'llama3.2_instruct_1b'
    >>> load_architecture("gemma3_4")
    Traceback (most recent call last):
    ...
    ValueError: Unknown architecture 'gemma3_4'. Did you mean 'gemma3_4b', ...
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
    index = _index()
    wanted = _normalize(name)
    if wanted in index:
        return _load(index[wanted])
    names = list_architectures()
    close = difflib.get_close_matches(wanted, sorted(index), n=3, cutoff=0.6)
    suggestions = list(dict.fromkeys(index[c] for c in close))
    hint = f" Did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    raise ValueError(
        f"Unknown architecture {name!r}.{hint} Known architectures: {', '.join(names)} "
        "(keras-hub preset names such as 'gemma3_instruct_4b_text' work too). To plan another "
        f"model, add a <name>.json with its backbone config to {architectures_dir()}. "
        f"Received: name={name!r}"
    )


def _normalize(name: str) -> str:
    return re.sub(r"[\s\-]+", "_", name.strip().lower())


@functools.cache
def _index() -> dict[str, str]:
    """Normalized architecture and keras-hub preset names -> architecture name."""
    index: dict[str, str] = {}
    for name in list_architectures():
        index[_normalize(name)] = name
        for preset in _read(name).get("keras_hub_presets", []):
            index.setdefault(_normalize(preset), name)
    return index


def _read(name: str) -> dict[str, Any]:
    path = architectures_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"Architecture file {path} is not valid JSON: {e}. Fix the file.") from e


@functools.cache
def _load(name: str) -> Architecture:
    data = _read(name)
    fields = {f.name for f in dataclasses.fields(Architecture)}
    missing = sorted(fields - set(data))
    if missing:
        raise ValueError(
            f"Architecture file {architectures_dir() / (name + '.json')} lacks {missing}. "
            "Add them (see gemma3_1b.json for the layout)."
        )
    data = {k: data[k] for k in fields}
    data["keras_hub_presets"] = tuple(data["keras_hub_presets"])
    data["parameter_count"] = int(data["parameter_count"] or 0)
    data["backbone_config"] = types.MappingProxyType(dict(data["backbone_config"]))
    return Architecture(**data)
