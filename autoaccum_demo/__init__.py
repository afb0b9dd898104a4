"""autoaccum's demos and their data, kept outside the library's import path.

``make demo`` (``autoaccum demo``) runs :func:`run_default_demo`; ``autoaccum demo --flax`` runs
:func:`run_flax_demo`. The library never imports this package; only the CLI's ``demo``
command does.
"""

from ._flax_demo import run_default_demo as run_default_demo
from ._flax_demo import run_flax_demo as run_flax_demo
from ._flax_demo import tiny_lm_plan_inputs as tiny_lm_plan_inputs

__all__ = ["run_default_demo", "run_flax_demo", "tiny_lm_plan_inputs"]
