"""Where the repository is, for tests that run files or subprocesses from it."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def host_devices_env(devices: int, **extra: str) -> dict[str, str]:
    """This process's environment for a child JAX on ``devices`` host-platform CPU devices:
    ``--xla_force_host_platform_device_count`` added to the XLA flags it already has (the
    test session's, see the root ``conftest.py``), CPU JAX, Keras on JAX, quiet TensorFlow,
    then ``extra``."""
    import os

    flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                     if not flag.startswith("--xla_force_host_platform_device_count"))
    return {**os.environ, "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax",
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
            **extra}


def users_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) without the test session's XLA flags
    (root ``conftest.py``): for a child that runs what users run (``make demo``, the notebook)
    with XLA's defaults. Those flags make compiles cheap and machine code slow: the demo's 186
    training steps took 74 CPU s with them, 47 without."""
    import os

    return {k: v for k, v in (os.environ if env is None else env).items() if k != "XLA_FLAGS"}
