"""Throughput and compiled memory: autoaccum's accumulated step vs the native big batch vs
optax.MultiSteps, on the same model and effective batch, from one run.

Targets (issue 2): accumulated >= 0.97 x native examples/s; memory over a plain micro-batch
step <= one float32 copy of the trainable parameters (issue 20 item 4).

The memory table sets the accumulated step's need over a plain micro-batch step side by side
for the non-finite rollback as it is (the optimizer inside ``lax.cond``:
``training._nonfinite.update_if_finite``) and as it was before issue 20 (the new and the old
state both computed, then selected with ``jnp.where``), rebuilt here by swapping that one
function, so both columns come from the same run. This is the CPU's form: a step compiled
for a GPU takes the select, which XLA:GPU fuses into the update (``training._nonfinite``;
under ``lax.cond`` it kept the old weights and moments beside the new ones).

    .venv/bin/python benchmarks/accumulation.py
"""

from __future__ import annotations

import _common  # noqa: F401  (environment first)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import median_seconds, print_table
from flax import nnx

import autoaccum.adapters.flax._nnx_program as flax_program_module
from autoaccum.adapters.flax._nnx_program import make_flax_step
from autoaccum.devices._profiles import format_bytes
from autoaccum.training._nonfinite import keep_if_finite
from autoaccum_demo._flax_demo import load_corpus
from autoaccum_demo._tiny_lm import TinyTransformerLM, next_token_loss, text_windows

EFFECTIVE = 32
SEQ = 128


def need(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def select_rollback(finite, update, old, *args):
    """The rollback before issue 20: new and old state side by side, then ``jnp.where``."""
    return keep_if_finite(finite, update(old, *args), old)


def main() -> None:
    model = TinyTransformerLM(dim=128, heads=4, layers=4, max_len=SEQ, rngs=nnx.Rngs(0))
    data = text_windows(load_corpus(), length=SEQ)
    batch = jax.tree.map(lambda a: jnp.asarray(a[:EFFECTIVE]), data)
    graphdef, params, frozen, other = nnx.split(model, nnx.Param, nnx.Param, ...)
    tx = optax.adamw(1e-4)
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))

    def fresh_state():
        p = jax.tree.map(jnp.copy, params)
        return (p, jax.tree.map(jnp.copy, other), tx.init(p))

    rows, results, select_need = [], {}, {}

    def plain_step(optimizer):
        """One value_and_grad over the whole given batch, then ``optimizer``: no scan."""

        def step(state, b):
            p, o, opt = state

            def loss(p):
                s, n = next_token_loss(nnx.merge(graphdef, p, frozen, o), b)
                return s / jnp.maximum(n, 1)

            value, grads = jax.value_and_grad(loss)(p)
            updates, opt = optimizer.update(grads, opt, p)
            return (optax.apply_updates(p, updates), o, opt), value

        return step

    # Native big batch: one value_and_grad over all 32 examples.
    native = jax.jit(plain_step(tx), donate_argnums=0)
    state = [fresh_state()]

    def run_native():
        state[0], v = native(state[0], batch)
        v.block_until_ready()

    t = median_seconds(run_native)
    native_need = need(native.lower(fresh_state(), batch).compile())
    results["native"] = (t, native_need)

    # Plain micro-batch step (no accumulation) at each micro size, for the memory comparison.
    plain_need = {}
    for micro in (4, 8):
        small = jax.tree.map(lambda a, m=micro: a[:m], batch)
        plain_need[micro] = need(native.lower(fresh_state(), small).compile())

    # autoaccum: one jitted step scanning k micro-batches.
    step = jax.jit(make_flax_step(graphdef, loss_fn=next_token_loss, tx=tx, trainable=nnx.Param),
                   donate_argnums=0)
    for micro in (8, 4):
        k = EFFECTIVE // micro
        stacked = jax.tree.map(lambda a, k=k, m=micro: a.reshape(k, m, *a.shape[1:]), batch)
        state = [fresh_state()]

        def run_accum(stacked=stacked, state=state):
            state[0], metrics = step(state[0], stacked, frozen)
            metrics.loss.block_until_ready()

        t = median_seconds(run_accum)
        n = need(step.lower(fresh_state(), stacked, frozen).compile())
        results[f"autoaccum {micro}x{k}"] = (t, n, micro)
        now = flax_program_module.update_if_finite
        flax_program_module.update_if_finite = select_rollback
        try:
            before = jax.jit(make_flax_step(graphdef, loss_fn=next_token_loss, tx=tx,
                                            trainable=nnx.Param), donate_argnums=0)
            select_need[micro] = need(before.lower(fresh_state(), stacked, frozen).compile())
        finally:
            flax_program_module.update_if_finite = now
        before_state = [fresh_state()]

        def run_before(stacked=stacked, state=before_state, before=before):
            state[0], metrics = before(state[0], stacked, frozen)
            metrics.loss.block_until_ready()

        t = median_seconds(run_before)
        results[f"autoaccum {micro}x{k} where-rollback (before)"] = (t, select_need[micro],
                                                                    micro)

    # optax.MultiSteps: k separate calls per optimizer step.
    for micro in (8, 4):
        k = EFFECTIVE // micro
        ms = optax.MultiSteps(tx, every_k_schedule=k)
        jitted = jax.jit(plain_step(ms), donate_argnums=0)
        p0 = jax.tree.map(jnp.copy, params)
        ms_state = [(p0, jax.tree.map(jnp.copy, other), ms.init(p0))]
        micro_batches = [jax.tree.map(lambda a, i=i, m=micro: a[i * m:(i + 1) * m], batch)
                         for i in range(k)]

        def run_ms(ms_state=ms_state, micro_batches=micro_batches, jitted=jitted):
            for mb in micro_batches:
                ms_state[0], v = jitted(ms_state[0], mb)
            v.block_until_ready()

        t = median_seconds(run_ms)
        p1 = jax.tree.map(jnp.copy, params)
        n = need(jitted.lower((p1, other, ms.init(p1)), micro_batches[0]).compile())
        results[f"optax.MultiSteps {micro}x{k}"] = (t, n, micro)

    base_t = results["native"][0]
    for name, value in results.items():
        t, n = value[0], value[1]
        extra = ""
        if len(value) == 3:
            over = n - plain_need[value[2]]
            extra = f"{format_bytes(over)} ({over / (4 * n_params):.2f} x f32 params)"
        rows.append([name, f"{EFFECTIVE / t:.1f}", f"{base_t / t:.3f}", format_bytes(n), extra])
    print(f"model: TinyTransformerLM 4 layers dim 128, {n_params:,} params, seq {SEQ}, "
          f"effective batch {EFFECTIVE}, CPU, jax {jax.__version__}")
    print_table(["variant", "examples/s", "x native", "compiled need",
                 "need over plain micro-batch step"], rows)
    print("\nplain micro-batch step need: "
          + ", ".join(f"b={m}: {format_bytes(v)}" for m, v in plain_need.items()))
    f32 = 4 * n_params
    memory_rows = []
    for micro in (8, 4):
        k = EFFECTIVE // micro
        now_over = results[f"autoaccum {micro}x{k}"][1] - plain_need[micro]
        before_over = select_need[micro] - plain_need[micro]
        ms_over = results[f"optax.MultiSteps {micro}x{k}"][1] - plain_need[micro]
        memory_rows.append([f"{micro}x{k}", format_bytes(plain_need[micro]),
                            f"{format_bytes(before_over)} ({before_over / f32:.2f} x)",
                            f"{format_bytes(now_over)} ({now_over / f32:.2f} x)",
                            f"{format_bytes(ms_over)} ({ms_over / f32:.2f} x)"])
    print(f"\nneed over a plain micro-batch step, in float32 trainable parameters "
          f"({format_bytes(f32)}); target <= 1.00 x")
    print_table(["micro x accum", "plain step", "autoaccum, where-rollback (before)",
                 "autoaccum, cond-rollback (now)", "optax.MultiSteps"], memory_rows)


if __name__ == "__main__":
    main()
