"""Scenarios that run out of memory for real, in a child process under ``RLIMIT_AS``.

Run as ``python -m tests._oom_child SCENARIO '{"json": "args"}'`` with
:data:`autoaccum.devices._oom.CHILD_ENV`; the last stdout line is a JSON result. The parent test
process never caps itself. :func:`run_child` does all of that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def run_child(scenario: str, timeout: float = 240, **args: Any) -> dict:
    """Runs ``scenario`` in a fresh interpreter and returns its JSON result."""
    from autoaccum.devices._oom import CHILD_ENV

    env = {**os.environ, **CHILD_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "tests._oom_child", scenario, json.dumps(args)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"child {scenario} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-5000:]}"
        )
    return json.loads(lines[-1])


# --- in the child -----------------------------------------------------------------------


def _setup() -> None:
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)


def _flax_parts(vocab: int, length: int, n: int, seed: int = 1):
    import optax
    from flax import nnx

    from tests._models import TinyLM, ragged_tokens

    model = TinyLM(vocab=vocab, dim=64, hidden=128, rngs=nnx.Rngs(0))
    data = ragged_tokens(n, length, vocab=vocab, seed=seed)
    return model, data, optax.adam(1e-3)


def plan_at(micro_batch: int, accum_steps: int):
    """A hand-made :class:`Plan` for ``micro_batch x accum_steps`` (no search)."""
    from autoaccum.planning._backoff import _unknown_estimate
    from autoaccum.planning._budget import Budget
    from autoaccum.planning._lr_scaling import scale_learning_rate
    from autoaccum.planning._plan import Plan

    effective = micro_batch * accum_steps
    return Plan(
        micro_batch=micro_batch, accum_steps=accum_steps, data_parallel=1,
        effective_batch=effective, max_micro_batch=micro_batch,
        lr_scaling=scale_learning_rate(None, effective_batch=effective),
        budget=Budget(1 << 40, "test", "hand-made plan"),
        estimate=_unknown_estimate(micro_batch, accum_steps), probes=(), target="test",
        plan_seconds=0.0,
    )


def _params(model) -> list:
    import jax
    import numpy as np
    from flax import nnx

    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def flax_elastic(*, vocab: int, length: int, n: int, micro: int, accum: int,
                 fail_after: int, headroom_mib: float, epochs: int = 1) -> dict:
    """An uninterrupted fit, then the same fit whose memory cap drops after a step."""
    import io

    import numpy as np

    from autoaccum.adapters.flax._nnx_fit import flax_fit
    from autoaccum.devices._oom import AddressSpaceCap
    from tests._models import token_loss

    _setup()
    model, data, tx = _flax_parts(vocab, length, n)
    reference = flax_fit(model, data, plan=plan_at(micro, accum), loss_fn=token_loss, tx=tx,
                         epochs=epochs, seed=3, verbose=0)
    expected = _params(model)
    model, data, tx = _flax_parts(vocab, length, n)
    cap = AddressSpaceCap(headroom_bytes=1 << 32)

    from autoaccum import Callback

    class LowerCap(Callback):
        def on_step_end(self, step: int, logs: dict) -> None:
            if step == fail_after:
                cap.set_headroom(int(headroom_mib * MIB))

    log = io.StringIO()
    with cap:
        result = flax_fit(model, data, plan=plan_at(micro, accum), loss_fn=token_loss, tx=tx,
                          epochs=epochs, seed=3, verbose=0, stream=log, callbacks=[LowerCap()])
    got = _params(model)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True))
    return {
        "steps": result.steps, "reference_steps": reference.steps, "events": result.events,
        "micro_batch": result.micro_batch, "accum_steps": result.accum_steps,
        "max_abs_diff": diff, "log": log.getvalue(),
        "losses": result.losses, "reference_losses": reference.losses,
    }


def flax_fit_elastic(*, vocab: int, length: int, n: int, effective: int, fail_after: int,
                     headroom_mib: float, method: str = "backoff",
                     async_dispatch: bool = False) -> dict:
    """``autoaccum.fit`` (planned by ``method``, real steps for "backoff") whose memory cap
    drops after a step: elastic recovery redoes the step from the state before it."""
    import io

    import numpy as np

    import autoaccum
    from autoaccum.devices._oom import AddressSpaceCap
    from tests._models import token_loss

    if not async_dispatch:  # else the error surfaces when the result is read, after donation
        _setup()
    model, data, tx = _flax_parts(vocab, length, n)
    options = dict(effective_batch=effective, optimizer=tx, loss_fn=token_loss, verbose=0,
                   training=autoaccum.Training(seed=3))
    reference = autoaccum.fit(model, data, log=None, **options, budget="2GiB",
                              search=autoaccum.Search(method="compile", cache=False))
    expected = _params(model)
    model, data, tx = _flax_parts(vocab, length, n)
    cap = AddressSpaceCap(headroom_bytes=1 << 32)

    class LowerCap(autoaccum.Callback):
        def on_step_end(self, step: int, logs: dict) -> None:
            if step == fail_after:
                cap.set_headroom(int(headroom_mib * MIB))

    log = io.StringIO()
    error = ""
    with cap:
        try:
            # Real steps are their own budget: method="backoff" takes none.
            budget = None if method == "backoff" else "2GiB"
            result = autoaccum.fit(model, data, log=log, callbacks=[LowerCap()],
                                   search=autoaccum.Search(method=method, cache=False),
                                   budget=budget, **{**options, "optimizer": tx})
        except Exception as failure:  # reported: the test says what was expected
            error, result = f"{type(failure).__name__}: {failure}"[:3000], None
    got = _params(model)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True))
    return {"error": error, "steps": result.steps if result else None,
            "reference_steps": reference.steps, "plan": str(reference.plan.split_text()),
            "events": result.events if result else [], "max_abs_diff": diff,
            "log": log.getvalue()[-3000:]}


def flax_restore_consumed(*, vocab: int, length: int, n: int, headroom_mib: float) -> dict:
    """The state a failed step consumed (donated: deleted), and a cap under which the host
    copy does not fit back on the device: after the real out-of-memory of putting it back,
    the model holds the copy on the host and training goes on from it once memory is free.
    (A step that runs out of memory on this CPU fails before it consumes its inputs, so the
    consumption is done here, as a GPU's failed donated call leaves it.)"""
    import jax
    import numpy as np
    from flax import nnx

    import autoaccum
    from autoaccum.devices._oom import AddressSpaceCap
    from tests._models import token_loss

    _setup()
    model, data, tx = _flax_parts(vocab, length, n)
    step = autoaccum.train_step(model, data, effective_batch=32, optimizer=tx,
                                loss_fn=token_loss, log=None, budget="2GiB",
                                training=autoaccum.Training(elastic=False, backup="host"))
    batch = {k: v[:32] for k, v in data.items()}
    step(batch)
    after_one = _params(model)
    runner = step._runner
    runner.snapshot.take(runner.state, step=runner.steps)  # as the next attempt takes it
    for leaf in jax.tree.leaves(runner.state):  # donated to a call that failed
        if isinstance(leaf, jax.Array):
            leaf.delete()
    failure = RuntimeError("RESOURCE_EXHAUSTED: the step (stand-in for the failed call)")
    cap = AddressSpaceCap(headroom_bytes=1 << 32)
    filler: list = []  # what else holds the device: every byte left under the cap
    with cap:
        cap.set_headroom(int(headroom_mib * MIB))
        while True:  # in MiB chunks: under a MiB stays free for the host's own needs
            try:
                filler.append(jax.device_put(np.ones(1 << 18, np.float32)))
                filler[-1].block_until_ready()
            except Exception:  # the cap: the device is full
                break
        runner.settle(failure)
        filler.clear()
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    on_host = all(isinstance(a, np.ndarray) for a in leaves)
    same = all(np.array_equal(a, b) for a, b in zip(_params(model), after_one, strict=True))
    out = step(batch)  # the cap lifted: training goes on from the held state
    return {"notes": list(getattr(failure, "__notes__", [])), "on_host": on_host,
            "same": same, "steps": step.steps, "finite": bool(np.isfinite(out.loss))}


def _keras_lm(vocab: int, length: int):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((length,), dtype="int32"),
        keras.layers.Embedding(vocab, 64),
        keras.layers.Dense(128, activation="gelu"),
        keras.layers.Dense(vocab),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _keras_data(vocab: int, length: int, n: int):
    import numpy as np

    tokens = np.random.default_rng(1).integers(0, vocab, size=(n, length + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def keras_elastic(*, vocab: int, length: int, n: int, micro: int, accum: int,
                  fail_after: int, headroom_mib: float, epochs: int = 1,
                  last: int | None = None) -> dict:
    """An uninterrupted ``keras_fit``, then the same fit whose memory cap drops after a step
    (``last``: an uneven split's smaller last micro-batch)."""
    import keras
    import numpy as np

    from autoaccum.adapters.keras._keras_fit import keras_fit
    from autoaccum.devices._oom import AddressSpaceCap

    _setup()
    data = _keras_data(vocab, length, n)
    model = _keras_lm(vocab, length)
    initial = [np.asarray(w) for w in model.get_weights()]
    reference = keras_fit(model, data, micro_batch=micro, accum_steps=accum, epochs=epochs,
                          seed=3, verbose=0, last_micro_batch=last)
    expected = [np.asarray(w) for w in model.get_weights()]
    model = _keras_lm(vocab, length)
    model.set_weights(initial)
    cap = AddressSpaceCap(headroom_bytes=1 << 32)

    class LowerCap(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == fail_after:
                cap.set_headroom(int(headroom_mib * MIB))

    with cap:
        history = keras_fit(model, data, micro_batch=micro, accum_steps=accum, epochs=epochs,
                            seed=3, verbose=0, callbacks=[LowerCap()], last_micro_batch=last)
    got = [np.asarray(w) for w in model.get_weights()]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True))
    return {
        "iterations": int(model.optimizer.iterations), "events": history.autoaccum_events,
        "micro_batch": history.autoaccum_micro_batch,
        "accum_steps": history.autoaccum_accum_steps, "max_abs_diff": diff,
        "last_micro_batch": history.autoaccum_last_micro_batch,
        "loss": history.history["loss"], "reference_loss": reference.history["loss"],
        "moved": max(float(np.max(np.abs(a - b))) for a, b in zip(got, initial, strict=True)),
    }


def keras_train_step_oom(*, vocab: int, length: int, n: int, batch: int, fail_after: int,
                         headroom_mib: float) -> dict:
    """A hand-written loop of ``autoaccum.train_step`` (``elastic=False``) whose memory cap
    drops after a step: the step raises, the model is as before it, ``shrink`` goes on."""
    import numpy as np

    import autoaccum
    from autoaccum.devices._oom import AddressSpaceCap

    _setup()
    x, y = _keras_data(vocab, length, n)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]
    model = _keras_lm(vocab, length)
    initial = model.get_weights()
    plan = autoaccum.plan(model, (x, y), effective_batch=batch, budget="1GiB",
                          log=None,
                          learning_rate=autoaccum.LearningRate(base_batch=batch))
    step = autoaccum.train_step(model, (x, y), effective_batch=batch, plan=plan,
                                learning_rate=autoaccum.LearningRate(base_batch=batch))
    for one in batches:
        step(one)
    expected = model.get_weights()

    model = _keras_lm(vocab, length)
    model.set_weights(initial)
    # elastic=False: the out-of-memory is raised and step.shrink(error) goes on.
    step = autoaccum.train_step(model, (x, y), effective_batch=batch, plan=plan,
                                learning_rate=autoaccum.LearningRate(base_batch=batch),
                                training=autoaccum.Training(elastic=False))
    cap = AddressSpaceCap(headroom_bytes=1 << 32)
    failed, kept = [], False
    with cap:
        for i, one in enumerate(batches):
            if i == fail_after:
                cap.set_headroom(int(headroom_mib * MIB))
            before = [np.array(v) for v in (*model.get_weights(), *(
                o.value for o in model.optimizer.variables))]
            try:
                step(one)
            except Exception as error:
                if not autoaccum.is_out_of_memory(error):
                    raise
                failed.append(i + 1)
                after = [np.array(v) for v in (*model.get_weights(), *(
                    o.value for o in model.optimizer.variables))]
                kept = _same(before, after)
                step = step.shrink(error)
                step(one)
    got = model.get_weights()
    return {
        "failed_steps": failed, "kept": kept, "iterations": int(model.optimizer.iterations),
        "micro_batch": step.plan.micro_batch, "accum_steps": step.plan.accum_steps,
        "events": step.events,
        "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected,
                                                                         strict=True)),
    }


def _probes(search_or_plan) -> list:
    return [{"micro_batch": p.micro_batch, "accum_steps": p.accum_steps, "fits": p.fits,
             "kind": p.kind, "why": p.why, "error": p.error, "need_bytes": p.need_bytes}
            for p in search_or_plan.probes]


def _host(tree) -> list:
    import jax
    import numpy as np

    return [np.array(jax.device_get(a)) for a in jax.tree.leaves(tree)]


def _same(a: list, b: list) -> bool:
    import numpy as np

    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _flax_runner(model, data, program, tx, split_model, real_step_runner):
    """One real non-donating step of the live weights and a fresh optimizer state."""
    from flax import nnx

    _, params, frozen, other = split_model(model, nnx.Param)
    return real_step_runner(program, (params, other, tx.init(params)), (frozen,), data)


def flax_backoff(*, vocab: int, length: int, batch: int, headroom_mib: float,
                 big_vocab: int, big_length: int, tiny_headroom_mib: float) -> dict:
    """Back-off, auto and "nothing fits" under a cap, with the live state checked bit by bit."""
    import io

    from autoaccum.adapters.flax._nnx_program import flax_program, split_model
    from autoaccum.devices._oom import AddressSpaceCap
    from autoaccum.planning._backoff import auto_plan, backoff_search, real_step_runner
    from autoaccum.planning._budget import Budget
    from autoaccum.planning._lr_scaling import scale_learning_rate
    from autoaccum.planning._measure import measure_program
    from autoaccum.planning._plan import search_plan
    from autoaccum.planning._search import DoesNotFitError
    from autoaccum.training._epoch_batches import example_spec
    from tests._models import token_loss

    _setup()
    out: dict = {}
    model, data, tx = _flax_parts(vocab, length, batch)
    program = flax_program(model, example_spec(data), loss_fn=token_loss, tx=tx)
    runner = _flax_runner(model, data, program, tx, split_model, real_step_runner)
    before = _host(runner.state) + _params(model)
    runner(2, batch // 2)  # warm-up: allocations of a small real step
    log = io.StringIO()
    with AddressSpaceCap(headroom_bytes=int(headroom_mib * MIB)):
        search = backoff_search(runner, per_device_batch=batch, log=log)
        out["backoff"] = {"micro_batch": search.micro_batch, "probes": _probes(search),
                          "seconds": search.seconds, "log": log.getvalue()}
        # auto: an optimistic compile-only plan (budget = 4x the headroom) is verified for real.
        lr = scale_learning_rate(None, effective_batch=batch)
        optimistic = search_plan(
            lambda b, k: measure_program(program, b, k), effective_batch=batch,
            lr_scaling=lr, budget=Budget(int(4 * headroom_mib * MIB), "test", "optimistic"),
            target="local", log=None)
        checked = auto_plan(optimistic, runner, log=None)
        out["auto"] = {"compiled_micro_batch": optimistic.micro_batch,
                       "micro_batch": checked.micro_batch, "accum_steps": checked.accum_steps,
                       "probes": _probes(checked), "notes": list(checked.notes)}
    out["state_unchanged"] = _same(before, _host(runner.state) + _params(model))
    out["compiles"], out["steps_run"] = runner.compiles, runner.steps_run
    runner.release()
    del runner

    # Nothing fits: even micro-batch 1 of a long sequence with a big vocabulary.
    model, data, tx = _flax_parts(big_vocab, big_length, 4)
    program = flax_program(model, example_spec(data), loss_fn=token_loss, tx=tx)
    runner = _flax_runner(model, data, program, tx, split_model, real_step_runner)
    before = _host(runner.state)
    with AddressSpaceCap(headroom_bytes=int(tiny_headroom_mib * MIB)):
        try:
            backoff_search(runner, per_device_batch=4, log=None)
            out["no_fit"] = None
        except DoesNotFitError as error:
            out["no_fit"] = str(error)
            out["no_fit_cause"] = str(error.__cause__).splitlines()[0]
    out["no_fit_state_unchanged"] = _same(before, _host(runner.state))
    return out


def keras_backoff(*, vocab: int, length: int, batch: int, headroom_mib: float) -> dict:
    """Back-off on a Keras model under a cap; its variables checked bit by bit."""
    import numpy as np

    from autoaccum.adapters.keras import KerasAdapter
    from autoaccum.devices._oom import AddressSpaceCap
    from autoaccum.planning._backoff import backoff_search
    from autoaccum.planning._plan_options import ProgramOptions

    _setup()
    data = _keras_data(vocab, length, batch)
    model = _keras_lm(vocab, length)
    adapter = KerasAdapter()
    prepared = adapter.prepare(model, data, effective_batch=batch, options=ProgramOptions(),
                               remat="none", remat_layers=None)
    runner = adapter.step_runner(model, prepared)
    before = [np.array(v.value) for v in model.variables + model.optimizer.variables]
    runner(2, batch // 2)
    with AddressSpaceCap(headroom_bytes=int(headroom_mib * MIB)):
        search = backoff_search(runner, per_device_batch=batch, log=None)
    after = [np.array(v.value) for v in model.variables + model.optimizer.variables]
    return {"micro_batch": search.micro_batch, "probes": _probes(search),
            "state_unchanged": _same(before, after)}


SCENARIOS = {
    "flax_elastic": flax_elastic, "keras_elastic": keras_elastic,
    "flax_fit_elastic": flax_fit_elastic,
    "flax_restore_consumed": flax_restore_consumed,
    "flax_backoff": flax_backoff, "keras_backoff": keras_backoff,
    "keras_train_step_oom": keras_train_step_oom,
}

if __name__ == "__main__":
    name, raw = sys.argv[1], sys.argv[2]
    out = SCENARIOS[name](**json.loads(raw))
    print(json.dumps(out), flush=True)
