"""keras-hub architectures shipped as data (Gemma, Llama, Mistral), built with no weight
allocated, and dry-run plans for them: ``autoaccum plan --preset gemma3_4b``."""

from ._architectures import Architecture as Architecture
from ._architectures import abstract_state as abstract_state
from ._architectures import abstract_token_batch as abstract_token_batch
from ._architectures import architectures_dir as architectures_dir
from ._architectures import build_abstract_causal_lm as build_abstract_causal_lm
from ._architectures import list_architectures as list_architectures
from ._architectures import load_architecture as load_architecture
from ._preset_plans import advise_preset as advise_preset
from ._preset_plans import plan_preset as plan_preset

__all__ = [
    "Architecture",
    "abstract_state",
    "advise_preset",
    "abstract_token_batch",
    "architectures_dir",
    "build_abstract_causal_lm",
    "list_architectures",
    "load_architecture",
    "plan_preset",
]
