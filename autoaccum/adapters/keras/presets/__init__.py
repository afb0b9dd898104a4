"""keras-hub architectures shipped as data (Gemma, Llama, Mistral), built with no weight
allocated, and dry-run plans for them: ``autoaccum plan --preset gemma3_4b``."""
from ._architectures import list_architectures as list_architectures
from ._preset_plans import advise_preset as advise_preset
from ._preset_plans import plan_preset as plan_preset

__all__ = [
    "advise_preset",
    "list_architectures",
    "plan_preset",
]
