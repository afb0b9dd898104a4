"""Test environment: CPU JAX, Keras on JAX, quiet TensorFlow; set before any import of them."""

import os
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The need cache of this test session (never the user's ~/.cache): every session starts cold.
os.environ.setdefault("AUTOACCUM_CACHE_DIR", tempfile.mkdtemp(prefix="autoaccum-test-cache-"))

SLOW_DOCTESTS = ("autoaccum/cli/_plot.py", "autoaccum/adapters/keras/presets/_plan_preset.py")
"""Doctests that compile a model for seconds: ``make test-fast`` skips them like slow tests."""


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("::")[0] in SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)
