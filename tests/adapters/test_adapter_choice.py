"""The adapter that trains a model is chosen among the frameworks the process has imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autoaccum.adapters import adapter_for
from tests._paths import REPO


def test_a_flax_module_gets_the_flax_adapter():
    from flax import nnx

    assert adapter_for(nnx.Linear(2, 1, rngs=nnx.Rngs(0))).name == "flax"


def test_an_object_of_no_supported_framework_is_a_value_error_naming_its_type():
    with pytest.raises(ValueError, match=r"Received: model of type builtins\.dict"):
        adapter_for({"w": 1})


def test_choosing_the_keras_adapter_does_not_import_flax():
    pytest.importorskip("keras")
    code = """if True:
        import sys
        import keras
        from autoaccum.adapters import adapter_for
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        print(adapter_for(model).name, "flax" in sys.modules)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "keras False", done.stdout
