"""The fresh processes of benchmarks/gpu_validation.py: one job each, a JSON line out.

    python benchmarks/_gpu_children.py JOB '{"case": {...}, ...}'

Jobs: ``peak`` (compile-only need on this device, then real steps at one micro-batch and the
measured peak), ``deviceless`` (needs for a named GPU from a CPU-only process), ``plan`` (the
planner's choice here), ``backoff`` (a plan by real steps, through real out-of-memory errors),
``elastic`` (an out-of-memory mid-training, recovered), ``t4`` (plan and train on a pool
capped to a T4's). The parent sets the environment (JAX_PLATFORMS, memory fraction, NVML
blocked for ``deviceless``) before this process starts.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

if os.environ.get("GPU_VALIDATION_BLOCK_NVML") == "1":
    sys.modules["pynvml"] = None  # type: ignore[assignment]  # as on a machine without the GPU
os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np

import autoaccum

MIB = 1 << 20


# --- models ------------------------------------------------------------------------------


def flax_parts(case: dict, n: int) -> tuple[Any, dict, Any, Any]:
    """A bf16 Flax transformer LM (random weights), token data, loss, optimizer factory."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    size = case["size"]

    class Block(nnx.Module):
        # Attention written out: nnx.MultiHeadAttention's bf16 backward asks XLA for the
        # ALG_DOT_BF16_BF16_F32 dot algorithm, which a T4 (cc 7.5) target refuses.
        def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs) -> None:
            kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
            self.heads = heads
            self.norm1 = nnx.RMSNorm(dim, **kw)
            self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, **kw)
            self.proj = nnx.Linear(dim, dim, use_bias=False, **kw)
            self.norm2 = nnx.RMSNorm(dim, **kw)
            self.up = nnx.Linear(dim, 4 * dim, **kw)
            self.down = nnx.Linear(4 * dim, dim, **kw)

        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            b, t, d = x.shape
            q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
            q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
            weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
            x = x + self.proj(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class LM(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs) -> None:
            kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
            self.embed = nnx.Embed(size["vocab"], size["dim"], **kw)
            self.blocks = nnx.List([Block(size["dim"], size["heads"], rngs=rngs)
                                    for _ in range(size["layers"])])
            self.norm = nnx.RMSNorm(size["dim"], **kw)
            self.head = nnx.Linear(size["dim"], size["vocab"], **kw)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens)
            mask = nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.norm(x)).astype(jnp.float32)

    def loss_fn(model: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
        logits = model(batch["tokens"][:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)

    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, size["vocab"], (n, case["seq"] + 1)).astype(np.int32)}
    return LM(rngs=nnx.Rngs(0)), data, loss_fn, optax.adamw


def gemma_model(case: dict, *, abstract: bool = False) -> Any:
    """keras-hub Gemma3 from a shipped architecture, bf16, random weights (or none)."""
    import keras
    import keras_hub

    from autoaccum.adapters.keras.presets import build_abstract_causal_lm, load_architecture

    lora = case["mode"] == "lora"
    optimizer = keras.optimizers.AdamW(learning_rate=5e-5, weight_decay=0.01)
    overrides = case["size"].get("overrides") or {}
    if abstract:
        return build_abstract_causal_lm(case["size"]["arch"], dtype="bfloat16",
                                        lora_rank=case["size"]["rank"] if lora else None,
                                        optimizer=optimizer, backbone_overrides=overrides)
    keras.utils.set_random_seed(0)
    kwargs = {**load_architecture(case["size"]["arch"]).backbone_kwargs(), **overrides}
    backbone = keras_hub.models.Gemma3Backbone(**kwargs, dtype="bfloat16")
    if lora:
        backbone.enable_lora(rank=case["size"]["rank"])
    model = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def gemma_data(case: dict, n: int) -> tuple:
    vocab = (case["size"].get("overrides") or {}).get("vocabulary_size", 262144)
    ids = np.random.default_rng(0).integers(1, vocab, (n, case["seq"] + 1)).astype(np.int32)
    mask = np.ones((n, case["seq"]), bool)
    return ({"token_ids": ids[:, :-1], "padding_mask": mask}, ids[:, 1:], mask)


def build(case: dict, n: int) -> tuple[Any, Any, dict]:
    """(model, data, options for autoaccum.plan/measure)."""
    if case["family"] == "flax":
        model, data, loss_fn, optimizer = flax_parts(case, n)
        return model, data, {"optimizer": optimizer, "learning_rate": 1e-4, "loss_fn": loss_fn}
    return gemma_model(case), gemma_data(case, n), {}


# --- measurements ------------------------------------------------------------------------


def device_stats() -> dict | None:
    from autoaccum.devices._detect import jax_memory_stats

    return jax_memory_stats()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_steps(case: dict, model: Any, data: Any, options: dict, b: int, k: int,
              steps: int, **fit_options: Any) -> Any:
    """Real donated training steps at exactly ``b x k`` (autoaccum's own fit loops)."""
    if case["family"] == "flax":
        from autoaccum.adapters.flax._fit import flax_fit

        tx = options["optimizer"](options["learning_rate"])
        return flax_fit(model, data, plan=hand_plan(b, k), loss_fn=options["loss_fn"], tx=tx,
                        epochs=1, shuffle=False, verbose=0, **fit_options)
    from autoaccum.adapters.keras import keras_fit

    return keras_fit(model, data, micro_batch=b, accum_steps=k, epochs=1, verbose=0,
                     shuffle=False, steps_per_epoch=steps, **fit_options)


def hand_plan(b: int, k: int) -> Any:
    from autoaccum.planning._backoff import _unknown_estimate
    from autoaccum.planning._budget import Budget
    from autoaccum.planning._lr import scale_learning_rate
    from autoaccum.planning._plan import Plan

    return Plan(micro_batch=b, accum_steps=k, data_parallel=1, effective_batch=b * k,
                max_micro_batch=b, lr_scaling=scale_learning_rate(None, effective_batch=b * k),
                budget=Budget(1 << 50, "validation", "hand-made"), probes=(),
                estimate=_unknown_estimate(b, k), target="validation", plan_seconds=0.0)


def job_peak(case: dict, b: int, k: int, steps: int = 3) -> dict:
    """Compile-only need on this device, then ``steps`` real steps and the measured peak."""
    model, data, options = build(case, b * k * steps)
    start = time.perf_counter()
    estimate = autoaccum.measure(model, data, micro_batch=b, accum_steps=k, remat="none",
                                 data_parallel=1, **options)
    out = {"micro_batch": b, "accum_steps": k, "need": estimate.need_bytes,
           "argument": estimate.argument_bytes, "temp": estimate.temp_bytes,
           "compile_s": round(time.perf_counter() - start, 2)}
    before, rss_before = device_stats(), rss_bytes()
    start = time.perf_counter()
    try:
        run_steps(case, model, data, options, b, k, steps, elastic=False, backup="none")
        out["status"] = "ran"
    except Exception as error:  # a real out-of-memory is the finding; anything else is too
        from autoaccum.devices import is_out_of_memory

        out["status"] = "oom" if is_out_of_memory(error) else f"error: {error!r}"[:300]
    out["run_s"] = round(time.perf_counter() - start, 2)
    after = device_stats()
    if after:
        out.update(kind="gpu", bytes_limit=after["bytes_limit"],
                   setup_peak=before["peak_bytes_in_use"], setup_in_use=before["bytes_in_use"],
                   peak=after["peak_bytes_in_use"])
    else:
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.update(kind="cpu", rss_before=rss_before, rss_growth=max(0, peak_rss - rss_before))
    return out


def job_deviceless(case: dict, micro_batches: list[int], effective_batch: int, profile: str,
                   memory_fraction: float | None) -> dict:
    """Needs for ``profile``'s GPU, compiled deviceless (this process sees no GPU)."""
    from autoaccum.planning._measure import measure_program
    from autoaccum.planning._targets import resolve_target

    target = resolve_target(profile, None, memory_fraction=memory_fraction)
    needs = {}
    if case["family"] == "flax":
        model, data, options = build(case, max(micro_batches))
        for b in micro_batches:
            needs[b] = autoaccum.measure(model, data, micro_batch=b,
                                         accum_steps=max(1, effective_batch // b),
                                         device=profile, memory_fraction=memory_fraction,
                                         remat="none", data_parallel=1, **options).need_bytes
    else:
        from autoaccum.adapters.keras._remat import keras_remat_program
        from autoaccum.adapters.keras.presets._plan_preset import token_example_spec

        program = keras_remat_program(gemma_model(case, abstract=True),
                                      token_example_spec(case["seq"]), "none")
        for b in micro_batches:
            needs[b] = measure_program(program, b, max(1, effective_batch // b),
                                       target.compile_target).need_bytes
    return {"target": target.compile_target.name, "kind": target.kind,
            "needs": {str(b): n for b, n in needs.items()}}


def job_plan(case: dict, effective_batch: int, method: str = "compile") -> dict:
    """The planner's choice on this device (``method="backoff"``: by real steps)."""
    import io

    model, data, options = build(case, effective_batch)
    log = io.StringIO()
    start = time.perf_counter()
    plan = autoaccum.plan(model, data, effective_batch=effective_batch, remat="none",
                          data_parallel=1, method=method, objective="memory", log=log, **options)
    return {"micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps,
            "need": plan.need_bytes, "budget": plan.budget_bytes, "target": plan.target,
            "seconds": round(time.perf_counter() - start, 1),
            "real_ooms": sum(1 for p in plan.probes if not p.fits),
            "log": log.getvalue()[-3000:]}


def job_elastic(case: dict, b: int, k: int) -> dict:
    """Fill the GPU after step 2 so the planned micro-batch runs out of memory at step 3."""
    import jax.numpy as jnp

    model, data, options = build(case, b * k * 5)
    big = autoaccum.measure(model, data, micro_batch=b, accum_steps=k, remat="none",
                            data_parallel=1, **options)
    small = autoaccum.measure(model, data, micro_batch=max(1, b // 2), accum_steps=2 * k,
                              remat="none", data_parallel=1, **options)
    ballast: list = []

    def fill(step: int, *_: Any) -> None:
        if step == 2:
            stats = device_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            room = (big.temp_bytes + small.temp_bytes) // 2  # between the two working sets
            ballast.append(jnp.zeros(max(0, free - room) // 4, jnp.float32).block_until_ready())

    import io

    log = io.StringIO()
    if case["family"] == "flax":
        result = run_steps(case, model, data, options, b, k, 5, on_step_end=fill, stream=log)
        events, final = result.events, (result.micro_batch, result.accum_steps)
    else:
        import keras

        class Fill(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                fill(batch + 1)

        history = run_steps(case, model, data, options, b, k, 5, callbacks=[Fill()])
        events = getattr(history, "autoaccum_events", [])
        final = (getattr(history, "autoaccum_micro_batch", None),
                 getattr(history, "autoaccum_accum_steps", None))
    return {"planned": [b, k], "events": [str(e) for e in events], "final": final,
            "log": log.getvalue()[-2000:]}


def job_t4(case: dict, effective_batch: int, steps: int = 2) -> dict:
    """On a pool capped to a T4's: plan here, then train at the plan and measure the peak."""
    plan = job_plan(case, effective_batch)
    peak = job_peak(case, plan["micro_batch"], plan["accum_steps"], steps=steps)
    return {"plan": plan, "peak": peak}


JOBS = {"peak": job_peak, "deviceless": job_deviceless, "plan": job_plan,
        "backoff": lambda **kw: job_plan(method="backoff", **kw), "elastic": job_elastic,
        "t4": job_t4}


if __name__ == "__main__":
    name, raw = sys.argv[1], sys.argv[2]
    result = JOBS[name](**json.loads(raw))
    print(json.dumps(result, default=str))
