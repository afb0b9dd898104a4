"""The top level is a small front door; the engine is public in documented subpackages."""

from __future__ import annotations

import re

import autoaccum
from tests._paths import REPO


def _readme_front_door() -> set[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("### The API: the front door and the engine", 1)[1]
    table = section.split("\n\n", 2)[2]  # the table follows the section's first paragraph
    return set(re.findall(r"`(\w+)`", table.split("\n\n", 1)[0]))


def test_the_readme_lists_exactly_the_front_door():
    assert _readme_front_door() == set(autoaccum.__all__)


def test_the_front_door_stays_small_and_every_name_resolves():
    assert len(autoaccum.__all__) <= 28  # 24 names and the four option specs
    assert len(set(autoaccum.__all__)) == len(autoaccum.__all__)
    for name in autoaccum.__all__:
        assert getattr(autoaccum, name) is not None


def test_the_engine_is_served_by_subpackages_with_their_own_all():
    for package in (autoaccum.planning, autoaccum.training, autoaccum.devices):
        assert package.__doc__ and package.__all__
        for name in package.__all__:
            assert hasattr(package, name), (package.__name__, name)
    assert not hasattr(autoaccum, "search_micro_batch")  # engine names are not at the top
    assert autoaccum.internal.search_micro_batch is not None


def test_importing_autoaccum_changes_nothing_in_the_process():
    # As optax, equinox and flax.nnx: no environment variable set, no import hook, file
    # descriptor 2 untouched, and not even JAX imported (configure() can still set what JAX
    # reads when it starts). Names load when first used.
    import os
    import subprocess
    import sys

    code = """if True:
        import os, sys
        env, hooks, stderr = dict(os.environ), list(sys.meta_path), os.fstat(2)
        import autoaccum
        print(dict(os.environ) == env, sys.meta_path == hooks, os.fstat(2) == stderr,
              "jax" in sys.modules, "autoaccum.cli" in sys.modules)
        print(autoaccum.fit.__name__, autoaccum.devices.format_bytes(1024), sorted(dir(autoaccum))
              == sorted(set(autoaccum.__all__) | {"devices", "planning", "training",
                                                  "reporting", "internal", "__version__"}))
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "KERAS_BACKEND")}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = done.stdout.split("\n")[:2]
    assert first == "True True True False False", done.stdout
    assert second == "fit 1.00 KiB True", done.stdout


def test_a_missing_name_is_an_attribute_error_naming_it():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        autoaccum.fitt  # noqa: B018


def test_a_job_holds_the_models_adapter_the_target_and_the_learning_rate():
    import numpy as np
    from flax import nnx

    from autoaccum._front_door import resolve_job

    job = resolve_job("plan", nnx.Linear(2, 1, rngs=nnx.Rngs(0)), {"x": np.ones((4, 2))},
                      effective_batch=4, learning_rate=0.1, device="t4", log=None)
    assert (job.adapter.name, job.target.device, job.options.learning_rate.value) == (
        "flax", "t4", 0.1)
