"""Test environment: CPU JAX, Keras on JAX, quiet TensorFlow; set before any import of them."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
