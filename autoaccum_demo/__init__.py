"""autoaccum's demos and their data, kept outside the library's import path.

``make demo`` (``autoaccum-demo``, ``python -m autoaccum_demo``) runs
:func:`run_default_demo`: the Colab lab's Gemma3-4B on a T4 as a dry run, then a real planned
and accumulated LoRA fine-tune of a small Gemma3, pretrained offline on the shipped text
(:func:`tiny_gemma3`, made by ``python -m autoaccum_demo.pretrain``), on the shipped QA pairs.
``autoaccum-demo --flax`` runs :func:`run_flax_demo`. The library never imports this package:
the demo has its own console script (:mod:`autoaccum_demo._cli`); the notebook's offline path
imports it too.
"""

# The demo is a program: like autoaccum.configure(), it keeps JAX's and TensorFlow's CUDA
# start-up noise quiet on a machine without a GPU, before its modules import them.
from autoaccum.devices import quiet_start

quiet_start()

# isort: split
from ._demo import run_default_demo as run_default_demo  # noqa: E402
from ._finetune import FinetuneResult as FinetuneResult  # noqa: E402
from ._finetune import answer as answer  # noqa: E402
from ._finetune import finetune_demo as finetune_demo  # noqa: E402
from ._finetune import lab_optimizer as lab_optimizer  # noqa: E402
from ._flax_demo import run_flax_demo as run_flax_demo  # noqa: E402
from ._flax_demo import tiny_lm_plan_inputs as tiny_lm_plan_inputs  # noqa: E402
from ._gemma_tokenizer import format_answer as format_answer  # noqa: E402
from ._gemma_tokenizer import format_prompt as format_prompt  # noqa: E402
from ._gemma_tokenizer import load_qa as load_qa  # noqa: E402
from ._lab_dry_run import LAB as LAB  # noqa: E402
from ._lab_dry_run import lab_dry_run as lab_dry_run  # noqa: E402
from ._lab_dry_run import lab_summary as lab_summary  # noqa: E402
from ._tiny_gemma import tiny_gemma3 as tiny_gemma3  # noqa: E402
from ._tiny_gemma import tiny_gemma3_preprocessor as tiny_gemma3_preprocessor  # noqa: E402

__all__ = [
    "LAB",
    "FinetuneResult",
    "answer",
    "finetune_demo",
    "format_answer",
    "format_prompt",
    "lab_dry_run",
    "lab_optimizer",
    "lab_summary",
    "load_qa",
    "run_default_demo",
    "run_flax_demo",
    "tiny_gemma3",
    "tiny_gemma3_preprocessor",
    "tiny_lm_plan_inputs",
]
