"""The fresh processes of benchmarks/gpu_validation.py: one job each, one JSON line out.

    python benchmarks/_gpu_children.py JOB '{"size": {...}, ...}'

Every job uses autoaccum's public API (``plan``, ``measure``, ``train_step``, ``fit``) on the
Flax models of ``_gpu_models.py``, on this process's device: a GPU where JAX sees one, else
the CPU (where the parent set ``JAX_PLATFORMS=cpu``). The parent sets the environment (memory
fraction, XLA flags, malloc settings) before this process starts. Jobs:

* ``plans``: the planner's micro-batch for each size (compile only, this device);
* ``point``: need compiled here at one ``micro_batch x accum_steps``, then real donated steps
  and the measured peak (GPU: ``peak_bytes_in_use``; CPU: resident-set growth);
* ``deviceless``: needs and a plan for a named GPU, from a CPU-only process (a laptop's view);
* ``backoff``: ``method="backoff"``, real steps through real out-of-memory errors;
* ``elastic``: training whose memory is squeezed after step 2; autoaccum recovers;
* ``t4``: plan and train on a pool capped to a T4's (GPU only);
* ``throughput``: examples/s of autoaccum's step, the native big batch and optax.MultiSteps.

On a CPU a real out-of-memory comes from an address-space cap (``RLIMIT_AS``,
``autoaccum.internal.AddressSpaceCap``); on a GPU from the GPU.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gpu_models as models

import autoaccum

MIB = 1 << 20
LEARNING_RATE = 1e-4


# --- the device ----------------------------------------------------------------------------


def device_info() -> dict:
    """This process's device: platform, kind, JAX's memory statistics (GPU) and versions."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    return {"platform": device.platform, "kind": device.device_kind, "jax": jax.__version__,
            "bytes_limit": (stats or {}).get("bytes_limit"), "pid": os.getpid()}


def on_gpu() -> bool:
    import jax

    return jax.devices()[0].platform == "gpu"


def memory_stats() -> dict:
    """GPU: JAX's pool statistics. CPU: an empty dict."""
    import jax

    if not on_gpu():
        return {}
    return dict(jax.devices()[0].memory_stats() or {})


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Resets the resident-set high-water mark (Linux ``clear_refs`` 5); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def context_bytes(stats: dict) -> int | None:
    """GPU memory this process holds outside JAX's pool (the CUDA context, libraries), from
    ``nvidia-smi``'s per-process figure minus the pool; ``None`` where it cannot tell."""
    if not stats or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            pool = int(stats.get("pool_bytes") or stats.get("bytes_reserved")
                       or stats.get("bytes_limit") or 0)
            return int(parts[1]) * MIB - pool
    return None


class Squeeze:
    """Takes memory away from the next step: on a GPU by allocating a ballast array that
    leaves ``room`` bytes free in JAX's pool; on a CPU by capping the address space at
    ``room`` bytes above what the process holds now (the cap is lifted around compiles)."""

    def __init__(self) -> None:
        self.cap: Any = None
        self.ballast: list = []

    @contextlib.contextmanager
    def armed(self) -> Iterator[Squeeze]:
        if on_gpu():
            yield self
            self.ballast.clear()
            return
        from autoaccum.internal import AddressSpaceCap

        self.cap = AddressSpaceCap(headroom_bytes=1 << 40)
        with self.cap:
            yield self

    def to(self, room: int) -> None:
        if self.cap is not None:
            self.cap.set_headroom(max(int(room), 0))
            return
        import jax.numpy as jnp

        chunk = None
        for _ in range(40):  # the pool may be fragmented: fill it in smaller pieces
            stats = memory_stats()
            excess = int(stats["bytes_limit"]) - int(stats["bytes_in_use"]) - int(room)
            if excess < 16 * MIB:
                return
            chunk = min(excess, chunk or excess)
            try:
                self.ballast.append(jnp.zeros((chunk // 4,), jnp.float32).block_until_ready())
            except Exception as error:
                oom_or_raise(error)
                chunk //= 2


# --- autoaccum on the models -----------------------------------------------------------------


def config(size: dict) -> models.LMConfig:
    return models.LMConfig(**size)


def options(cfg: models.LMConfig) -> dict:
    """What autoaccum.plan / measure / fit / train_step take for these models."""
    return {"optimizer": models.optimizer,
            "learning_rate": autoaccum.LearningRate(value=LEARNING_RATE, rule="none"),
            "loss_fn": models.next_token_loss, "trainable": models.trainable(cfg)}


def abstract_model(cfg: models.LMConfig) -> Any:
    """The model without weights (``nnx.eval_shape``): planning and compiling need shapes."""
    from flax import nnx

    return nnx.eval_shape(lambda: models.DecoderLM(cfg, rngs=nnx.Rngs(0)))


def planned(cfg: models.LMConfig, model: Any, effective: int, *, budget: Any = None,
            device: str | None = None, memory_fraction: float | None = None,
            method: str = "compile") -> Any:
    data = models.token_data(cfg, effective)
    return autoaccum.plan(model, data, effective_batch=effective, budget=budget, device=device,
                          log=None, **options(cfg),
                          target=autoaccum.Target(memory_fraction=memory_fraction,
                                                  data_parallel=1),
                          search=autoaccum.Search(remat="none", objective="memory", method=method,
                                                  cache=False))


def plan_row(plan: Any, seconds: float) -> dict:
    """A plan as JSON; ``limit`` is the largest micro-batch its probes found to fit (the
    plan trains at ``micro_batch``, an even split of the batch at most that large)."""
    real = sum(1 for p in plan.probes if getattr(p, "kind", "") == "real step")
    fits = [p.micro_batch for p in plan.probes if p.fits]
    return {"micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps,
            "max_micro_batch": plan.max_micro_batch,
            "limit": max([*fits, plan.max_micro_batch]), "need": plan.estimate.need_bytes,
            "budget": plan.budget.bytes, "budget_detail": plan.budget.detail,
            "target": plan.target, "compiles": len(plan.probes) - real,
            "probes": [[p.micro_batch, bool(p.fits), p.error[:120]] for p in plan.probes],
            "real_ooms": sum(1 for p in plan.probes if not p.fits and p.error),
            "seconds": round(seconds, 1)}


def measured(cfg: models.LMConfig, model: Any, b: int, k: int, *, device: str | None = None,
             memory_fraction: float | None = None) -> Any:
    return autoaccum.measure(model, models.token_data(cfg, b * k), micro_batch=b,
                             accum_steps=k, device=device, **options(cfg),
                             target=autoaccum.Target(memory_fraction=memory_fraction,
                                                     data_parallel=1),
                             search=autoaccum.Search(remat="none", cache=False))


def plan_at(estimate: Any, b: int, k: int) -> Any:
    """A :class:`autoaccum.Plan` that runs exactly ``b x k`` (no search), for the step that
    ``estimate`` (``autoaccum.measure`` at ``b x k``) compiled."""
    from autoaccum.planning import Budget, Plan, scale_learning_rate

    return Plan(micro_batch=b, accum_steps=k, data_parallel=1, effective_batch=b * k,
                max_micro_batch=b, estimate=estimate, probes=(), target=estimate.target,
                lr_scaling=scale_learning_rate(LEARNING_RATE, effective_batch=b * k,
                                               rule="none"),
                budget=Budget(estimate.need_bytes, "validation", f"{b} x {k} by hand"),
                plan_seconds=0.0)


def batches(data: dict, effective: int) -> Iterator[dict]:
    n = len(data["tokens"])
    for start in range(0, n - effective + 1, effective):
        yield {"tokens": data["tokens"][start:start + effective]}


def oom_or_raise(error: BaseException) -> str:
    """The first line of a real out-of-memory error (the original one, where a later error
    such as a lost donated state was raised from it); anything else propagates."""
    if not autoaccum.is_out_of_memory(error):
        raise error
    chain, current = [], error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    original = [e for e in chain if autoaccum.is_out_of_memory(e)][-1]
    lines = [line.strip() for line in str(original).splitlines() if line.strip()]
    return (lines[0] if lines else type(original).__name__)[:200]


# --- jobs ------------------------------------------------------------------------------------


def job_plans(sizes: list[dict], effective: list[int], budgets: list[Any]) -> dict:
    """The planner's choice for each size on this device (compile only, no weights)."""
    out = {"device": device_info(), "plans": []}
    for size, e, budget in zip(sizes, effective, budgets, strict=True):
        cfg = config(size)
        start = time.perf_counter()
        try:
            row = plan_row(planned(cfg, abstract_model(cfg), e, budget=budget),
                           time.perf_counter() - start)
        except autoaccum.DoesNotFitError as error:
            row = {"error": f"does not fit: {str(error).splitlines()[0][:200]}"}
        out["plans"].append({"size": cfg.name, "effective_batch": e, **row})
    return out


def job_point(size: dict, b: int, k: int, steps: int) -> dict:
    """Need compiled here at ``b x k``, then ``1 + steps`` real donated steps and the peak."""
    cfg = config(size)
    rss_base = _status("VmRSS")
    model, data = models.build(cfg, b * k * (steps + 1))
    start = time.perf_counter()
    est = measured(cfg, model, b, k)
    out: dict[str, Any] = {
        "device": device_info(), "micro_batch": b, "accum_steps": k, "need": est.need_bytes,
        "argument": est.argument_bytes, "output": est.output_bytes, "alias": est.alias_bytes,
        "temp": est.temp_bytes, "compile_s": round(time.perf_counter() - start, 2)}
    setup = memory_stats()
    out["setup_peak"] = setup.get("peak_bytes_in_use")
    step = autoaccum.train_step(model, data, effective_batch=b * k, plan=plan_at(est, b, k),
                                log=None, **options(cfg),
                                training=autoaccum.Training(backup="none"))
    feed = batches(data, b * k)
    start = time.perf_counter()
    try:
        step(next(feed))  # compiles (or reuses the compile above), then runs
        out["first_step_s"] = round(time.perf_counter() - start, 2)
        warm = memory_stats()
        out["warm_peak"] = warm.get("peak_bytes_in_use")
        out["rss_reset"] = reset_peak_rss()
        out["rss_at_reset"] = _status("VmRSS")
        start = time.perf_counter()
        for _ in range(steps):
            result = step(next(feed))
        out["step_s"] = round((time.perf_counter() - start) / steps, 3)
        out.update(status="ran", loss=round(result.loss, 4))
    except Exception as error:  # a real out-of-memory is the finding
        out.update(status="oom", error=oom_or_raise(error))
    stats = memory_stats()
    if stats:
        out.update(kind="gpu", peak=stats.get("peak_bytes_in_use"),
                   bytes_limit=stats.get("bytes_limit"), in_use=stats.get("bytes_in_use"),
                   context=context_bytes(stats))
    else:  # the state as XLA counts it + what the measured steps added to the resident set
        hwm = _status("VmHWM")
        growth = hwm - out["rss_at_reset"] if out.get("rss_reset") else hwm - rss_base
        out.update(kind="cpu", peak=est.argument_bytes + max(growth, 0), rss_growth=growth,
                   rss_base=rss_base, rss_hwm=hwm)
    return out


def job_deviceless(size: dict, profile: str, memory_fraction: float | None,
                   effective: int | None, points: list[list[int]]) -> dict:
    """A laptop's view of ``profile``'s GPU: a plan for ``effective`` and the need of each
    ``[b, k]`` in ``points``, compiled deviceless in this CPU-only process."""
    cfg = config(size)
    model = abstract_model(cfg)
    out: dict[str, Any] = {"profile": profile, "memory_fraction": memory_fraction}
    if effective:
        start = time.perf_counter()
        try:
            out["plan"] = plan_row(planned(cfg, model, effective, device=profile,
                                           memory_fraction=memory_fraction),
                                   time.perf_counter() - start)
        except autoaccum.DoesNotFitError as error:
            out["plan"] = {"error": f"does not fit: {str(error).splitlines()[0][:200]}"}
    if points:
        out["needs"] = {}
    for b, k in points:
        est = measured(cfg, model, b, k, device=profile, memory_fraction=memory_fraction)
        out["needs"][f"{b}x{k}"] = est.need_bytes
        out["target"] = est.target
    return out


def job_backoff(size: dict, effective: int, budget: Any, cap: int | None) -> dict:
    """``method="backoff"``: real (non-donating) steps, bisecting through real OOMs; on a CPU
    under an address-space cap of ``cap`` bytes above the model's weights."""
    cfg = config(size)
    model, data = models.build(cfg, effective)
    squeeze = Squeeze()
    start = time.perf_counter()
    with squeeze.armed():
        if cap is not None:
            squeeze.to(cap)
        try:
            plan = autoaccum.plan(model, data, effective_batch=effective, budget=budget,
                                  log=None, **options(cfg),
                                  target=autoaccum.Target(data_parallel=1),
                                  search=autoaccum.Search(remat="none", objective="memory",
                                                          method="backoff", cache=False))
            row = plan_row(plan, time.perf_counter() - start)
        except autoaccum.DoesNotFitError as error:
            row = {"error": f"does not fit: {str(error).splitlines()[0][:200]}"}
    return {"device": device_info(), "effective_batch": effective, "cap": cap, **row}


def job_elastic(size: dict, b: int, k: int, steps: int = 4, squeeze_after: int = 2) -> dict:
    """Trains ``steps`` steps at ``b x k`` with ``elastic=True``; after step ``squeeze_after``
    the memory left for a step is cut to halfway between what ``b`` and the next smaller
    micro-batch need, so the next step runs out of memory for real and autoaccum recovers."""
    cfg = config(size)
    model, data = models.build(cfg, b * k * steps)
    est = measured(cfg, model, b, k)
    smaller = max(d for d in range(1, b) if (b * k) % d == 0) if b > 1 else 1
    small = measured(cfg, model, smaller, b * k // smaller)
    # What a step allocates beyond the state it is given: outputs not aliased, and temp.
    room = ((est.need_bytes - est.argument_bytes) + (small.need_bytes - small.argument_bytes)) // 2
    squeeze = Squeeze()

    class SqueezeAfter(autoaccum.Callback):
        def on_step_end(self, step: int, logs: dict) -> None:
            if step == squeeze_after:
                squeeze.to(room)

    log = io.StringIO()
    with squeeze.armed():
        result = autoaccum.fit(model, data, effective_batch=b * k, plan=plan_at(est, b, k),
                               verbose=0, log=log,
                               callbacks=[SqueezeAfter()], **options(cfg),
                               training=autoaccum.Training(elastic=True, backup="auto",
                                                           shuffle=False))
    return {"device": device_info(), "planned": [b, k], "room": room,
            "final": [result.micro_batch, result.accum_steps], "steps": result.steps,
            "events": [str(e) for e in result.events], "losses": result.losses,
            "log": log.getvalue()[-1500:]}


def job_t4(size: dict, effective: int, steps: int = 2) -> dict:
    """On a pool capped to a T4's (the parent set the fraction): the plan, then training."""
    cfg = config(size)
    model, data = models.build(cfg, effective * steps)
    start = time.perf_counter()
    plan = autoaccum.plan(model, data, effective_batch=effective, log=None,
                          **options(cfg),
                          target=autoaccum.Target(data_parallel=1),
                          search=autoaccum.Search(remat="none", objective="memory",
                                                  method="compile", cache=False))
    out: dict[str, Any] = {"device": device_info(),
                           "plan": plan_row(plan, time.perf_counter() - start)}
    try:
        result = autoaccum.fit(model, data, effective_batch=effective, plan=plan,
                               verbose=0,
                               log=None, **options(cfg),
                               training=autoaccum.Training(elastic=False, backup="none",
                                                           shuffle=False))
        out.update(status="trains", steps=result.steps, losses=result.losses)
    except Exception as error:
        out.update(status="oom", error=oom_or_raise(error))
    stats = memory_stats()
    out.update(peak=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"))
    return out


def _timed(run_one: Any, data: dict, effective: int, steps: int) -> dict:
    """Examples/s of ``run_one`` (one effective batch per call) from the median of ``steps``
    timed calls after a warm-up call (the median keeps a busy machine's spikes out)."""
    feed = batches(data, effective)
    start = time.perf_counter()
    run_one(next(feed))  # compile and warm up
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_one(next(feed))
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    return {"examples_per_s": round(effective / median, 2), "step_s": round(median, 4),
            "first_step_s": round(first, 2)}


def job_throughput(size: dict, b: int, k: int, steps: int = 5) -> dict:
    """Examples/s at ``b x k``: autoaccum's step, one native batch of ``b * k``, and
    ``optax.MultiSteps`` (``k`` calls of ``b``), each after a warm-up step."""
    import jax
    import optax
    from flax import nnx

    cfg = config(size)
    e = b * k
    out: dict[str, Any] = {"device": device_info(), "micro_batch": b, "accum_steps": k}

    def autoaccum_step() -> dict:
        model, data = models.build(cfg, e * (steps + 1))
        est = measured(cfg, model, b, k)
        step = autoaccum.train_step(model, data, effective_batch=e, plan=plan_at(est, b, k),
                                    log=None, **options(cfg),
                                    training=autoaccum.Training(backup="none"))
        return _timed(step, data, e, steps)

    def plain(tx: optax.GradientTransformation, micro: int) -> dict:
        model, data = models.build(cfg, e * (steps + 1))
        graphdef, params, rest = nnx.split(model, models.trainable(cfg), ...)
        opt_state = tx.init(params)

        def loss(p: Any, batch: dict) -> Any:
            total, count = models.next_token_loss(nnx.merge(graphdef, p, rest), batch)
            return total / count

        def update(p: Any, s: Any, batch: dict) -> tuple:
            value, grads = jax.value_and_grad(loss)(p, batch)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        update = jax.jit(update, donate_argnums=(0, 1))
        state = [params, opt_state]

        def run(batch: dict) -> None:
            for start in range(0, e, micro):
                part = {"tokens": batch["tokens"][start:start + micro]}
                state[0], state[1], value = update(state[0], state[1], part)
            float(value)

        return _timed(run, data, e, steps)

    variants = {
        "autoaccum accumulated step": autoaccum_step,
        "native batch": lambda: plain(models.optimizer(LEARNING_RATE), e),
        "optax.MultiSteps": lambda: plain(optax.MultiSteps(models.optimizer(LEARNING_RATE),
                                                           every_k_schedule=k), b),
    }
    for name, run in variants.items():
        try:
            out[name] = run()
        except Exception as error:
            out[name] = {"error": oom_or_raise(error)}
        jax.clear_caches()
        gc.collect()  # the variant's model and state go before the next one's arrive
    return out


JOBS = {"plans": job_plans, "point": job_point, "deviceless": job_deviceless,
        "backoff": job_backoff, "elastic": job_elastic, "t4": job_t4,
        "throughput": job_throughput}


def main() -> None:
    name, raw = sys.argv[1], sys.argv[2]
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)  # a step's memory, in time
    result = JOBS[name](**json.loads(raw))
    print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
