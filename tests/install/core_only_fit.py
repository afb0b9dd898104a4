"""Run inside an environment with only ``pip install autoaccum`` (no extras): plan and fit a
small Flax NNX model, then show that each feature of an extra names the install that adds it.

    python tests/install/core_only_fit.py   # prints the plan, the losses and "CORE OK"

Used by tests/install/test_fresh_venv.py in a fresh virtual environment; imports nothing of
the repository except the installed ``autoaccum``.
"""

from __future__ import annotations

import importlib.metadata
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import autoaccum


class TinyLM(nnx.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.hidden = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.out = nnx.Linear(4 * dim, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.hidden(self.embed(tokens))))


def loss_fn(model: TinyLM, batch: dict) -> tuple[jax.Array, jax.Array]:
    logits = model(batch["tokens"][:, :-1])
    targets = batch["tokens"][:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)


def main() -> int:
    extras = [name for name in ("keras", "keras-hub", "tensorflow", "jax-cuda13-plugin",
                                "matplotlib")
              if _installed(name)]
    print("autoaccum", autoaccum.__version__, "| jax", jax.__version__, "| flax",
          importlib.metadata.version("flax"), "| optional packages present:", extras or "none")
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, 64, size=(64, 33)).astype(np.int32)}
    model = TinyLM(rngs=nnx.Rngs(0))
    plan = autoaccum.plan(model, data, effective_batch=16, budget="24MiB", optimizer=optax.adamw,
                          learning_rate=1e-3, loss_fn=loss_fn, log=None)
    print(plan.report())
    result = autoaccum.fit(model, data, effective_batch=16, budget="24MiB",
                           optimizer=optax.adamw, learning_rate=1e-3, loss_fn=loss_fn, epochs=3)
    losses = [round(float(v), 4) for v in result.epoch_losses]
    print("plan:", result.plan.micro_batch, "x", result.plan.accum_steps, "| steps:",
          result.steps, "| mean loss per epoch:", losses)
    assert losses[-1] < losses[0], losses
    missing = []
    for feature, call in (
        ("deviceless plan", lambda: autoaccum.internal.deviceless_target("t4")),
        ("plot", lambda: autoaccum.plot_plan(plan, "need.png")),
        ("keras-hub preset", _preset),
    ):
        try:
            call()
        except autoaccum.devices.MissingExtraError as error:
            missing.append(error.extra)
            print(f"{feature}: {error}")
    print("extras named:", missing)
    expected = [e for e, dist in (("dryrun", "jax-cuda13-plugin"), ("plot", "matplotlib"),
                                  ("keras", "keras-hub")) if not _installed(dist)]
    assert missing == expected, (missing, expected)
    print("CORE OK")
    return 0


def _preset() -> None:
    from autoaccum.adapters.keras.presets import plan_preset

    plan_preset("gemma3_1b", effective_batch=8, device="t4")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
