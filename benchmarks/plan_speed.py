"""Plans in the time of one compile (issue 50): cold and warm wall seconds of dry-run plans,
their compiles at full depth and at reduced depth, and cold wall / one full-depth compile of
the chosen step, measured side by side in one run.

Cases (``--cases``, default all):

* ``lab-t4``: the lab's Gemma3-4B, LoRA 4, sequence 400, bf16, effective batch 8, on a T4 at
  memory fraction 0.9 (``autoaccum plan --preset gemma3_4b --lora-rank 4 --seq-len 400
  --dtype bfloat16 --device t4 --effective-batch 8``);
* ``1b-t4``, ``1b-v5e``: Gemma3-1B, LoRA 4, sequence 512, on a T4 and a TPU v5e-1;
* ``nnx-t4``, ``nnx-v5e``: a Flax NNX decoder of about 0.6B parameters (Qwen3-0.6B's config:
  28 blocks, hidden 1024, 16 heads, 8 KV heads, MLP 3072, vocabulary 151,936) written from
  its config here, built with ``nnx.eval_shape`` (no weights), LoRA rank 4 on the attention
  and MLP projections through ``nnx.LoRAParam``, bf16, sequence 512, effective batch 8,
  planned with an ``autoaccum.DepthVariant`` (its factory at another depth);
* ``lab-2xt4``: the lab case on 2 T4s (``--devices 2``), the sharding strategies tried;
* ``advise-4b``: ``--advise`` for the Gemma3-4B full fine-tune on a T4 (every row).

Each plan runs in a fresh child process: cold with a new need cache, then warm with the same
cache. The chosen step is then compiled once more at full depth in a third child, alone, for
the ratio. ``--root PATH`` runs another checkout's code (an earlier commit, for the "before"
table; its plans count compiles with ``compile_count()`` only, as one total).

    python benchmarks/plan_speed.py --cases lab-t4,1b-t4 --timeout 900
    python benchmarks/plan_speed.py --root /tmp/before --cases lab-t4

Measured 2026-11-29 here (2 cores, jax 0.12.0.1), now and then with ``--root`` at 315f016
(the search before issue 50; one total of compiles), one after the other:

         case           plan  cold s  warm s  full  reduced  compiles  1 compile s  cold / 1 compile
    ---------  -------------  ------  ------  ----  -------  --------  -----------  ----------------
       lab-t4  4 x 2 nothing   143.9     1.7     2        8        10         55.0               2.6
        1b-t4     4 x 2 none    63.7     1.4     1        6         7         36.3               1.8
       1b-v5e     8 x 1 none    83.0     3.2     1        0         1         73.6               1.1
     lab-2xt4     2 x 2 none   156.6    13.4     2        8        10         43.2               3.6
    advise-4b         4 rows   182.6     2.3                       26
       nnx-t4     4 x 2 none    56.9    11.6     1        6         7         31.7               1.8
      nnx-v5e     8 x 1 none    90.3     9.3     1        0         1         78.5               1.2

    (the v5e rows measured after a TPU plan's candidates went from the largest down, libtpu
    refusing each one over the budget early: 1 finished compile; from the smallest up, each at
    full depth, they were 239.7 s (3 full) and 255.7 s; with reduced depths 356.4 s, 2 full +
    6 reduced, and 260.9 s, 1 full + 6 reduced; lab-2xt4 measured after zero1 and zero2 were
    ruled out by replicated's miss, before that 239.2 s, 4 full + 16 reduced, 6.8x)
    before (315f016): lab-t4 393.6 s cold (10 compiles), 1b-t4 156.7 s (7), 1b-v5e 335.2 s (5),
    nnx-t4 164.1 s (7); the same plans.

Then, the GPU rows again after the next larger micro-batch stopped being measured where the
search's own line puts it out of reach (``--cases 1b-t4,nnx-t4,lab-t4,lab-2xt4``, a quiet
machine; the lone compiles ran faster than in the run above, so the ratios moved less than
the cold seconds):

        case           plan  cold s  warm s  full  reduced  compiles  1 compile s  cold / 1 compile
    --------  -------------  ------  ------  ----  -------  --------  -----------  ----------------
       1b-t4     4 x 2 none    46.9     6.2     1        4         5         23.7               2.0
      nnx-t4     4 x 2 none    42.5     9.6     1        4         5         28.3               1.5
      lab-t4  4 x 2 nothing   124.7     6.5     2        8        10         45.7               2.7
    lab-2xt4     2 x 2 none   137.6     7.6     2        8        10         32.5               4.2

After the search's second fit point became the largest candidate the line from the floor puts
under the budget (2026-11-30, ``--no-ratio``): 1b-t4 4 x 2 none 1 full + 4 reduced, nnx-t4 the
same, lab-t4 4 x 2 nothing 2 + 8, lab-2xt4 2 x 2 none (fsdp) 2 + 8: the same plans and
compiles (with an effective batch of 8 that second point is 4, as before; the cold seconds,
62.5-176.9, were taken on a slower day than the table above). Again after the whole batch's
saving was taken as 1.5 loops, not 2: 1b-t4 and nnx-t4 the same plans and compiles (64.4 and
59.3 s cold). Again after the whole batch's saving became one rule (2026-11-30, load 1-2):
the same plans and compiles; cold / warm / one compile: 1b-t4 62.6 / 7.2 / 33.3 s (1.9x),
nnx-t4 60.7 / 12.2 / 35.6 s (1.7x), lab-t4 120.7 / 6.6 / 39.1 s (3.1x), lab-2xt4 142.8 / 8.2
/ 34.8 s (4.1x; its warm run in a second pair of runs, the first having changed code between
cold and warm, which the need cache keys on).

After four changes (2026-11-30; compiles started as each is lowered, a deviceless GPU's
full-depth flops taken from the depth line, a preset's model built once for every remat
policy, and the next remat policy planned while a full-depth compile decides the first), the
same plans and compiles. Before (``--root`` at 87c14e8) and after, alternated twice, cold
seconds with ``--no-ratio``: lab-t4 104.4, 103.1 -> 80.0, 76.4; 1b-t4 40.6, 39.1 -> 36.8,
37.8. Then the four GPU rows (the machine slower than in the morning, see the lone compiles):

        case           plan  cold s  warm s  full  reduced  compiles  1 compile s  cold / 1 compile
    --------  -------------  ------  ------  ----  -------  --------  -----------  ----------------
      lab-t4  4 x 2 nothing    75.7     5.1     2        8        10         34.4               2.2
       1b-t4     4 x 2 none    35.0     5.7     1        4         5         21.5               1.6
      nnx-t4     4 x 2 none    34.4     7.6     1        4         5         24.1               1.4
    lab-2xt4     2 x 2 none   110.1     6.1     2        8        10         31.6               3.5

After the strategy a deciding compile's miss would leave next (fsdp here) was planned while
that compile runs (2026-11-30, ``--cases lab-2xt4 --no-ratio``, alternated with ``--root`` at
adfc2ab): 96.7, 105.1 -> 83.1, 83.5 s cold; warm 5.4-5.7 -> 5.0-5.2 s; the same plan (2 x 2
fsdp) and compiles (2 full, 8 reduced). Then the four GPU rows (quiet machine):

        case           plan  cold s  warm s  full  reduced  compiles  1 compile s  cold / 1 compile
    --------  -------------  ------  ------  ----  -------  --------  -----------  ----------------
      lab-t4  4 x 2 nothing    69.2     0.9     2        8        10         31.7               2.2
       1b-t4     4 x 2 none    30.4     0.8     1        4         5         17.2               1.8
      nnx-t4     4 x 2 none    29.2     6.0     1        4         5         21.1               1.4
    lab-2xt4     2 x 2 none    75.5     4.4     2        8        10         25.6               2.9

(a preset's warm plan no longer builds its model: nothing needs it when every figure is
cached.)

After micro-batch 1 stopped being compiled at reduced depths where the line from the floor
through micro-batch 2 already bounds it over the budget (a full-depth compile decides it either
way), and the full-depth model is built while the first reduced depths compile (2026-11-30,
``--no-ratio``, alternated with ``--root`` at fa05eb1): lab-t4 66.5, 67.9 -> 61.8, 60.4 s;
lab-2xt4 78.6, 76.1 -> 73.0, 70.9 s (both 2 full + 6 reduced, from 8; the same plans); 1b-t4
29.4, 32.1 -> 29.5, 31.1 s and nnx-t4 29.3, 31.3 -> 29.8, 32.2 s (unchanged: they never reach
micro-batch 1). Then the four GPU rows:

        case           plan  cold s  warm s  full  reduced  compiles  1 compile s  cold / 1 compile
    --------  -------------  ------  ------  ----  -------  --------  -----------  ----------------
      lab-t4  4 x 2 nothing    65.6     0.9     2        6         8         30.5               2.2
       1b-t4     4 x 2 none    28.7     0.9     1        4         5         16.8               1.7
      nnx-t4     4 x 2 none    28.6     6.0     1        4         5         20.3               1.4
    lab-2xt4     2 x 2 none    69.6     4.3     2        6         8         25.8               2.7

Then with compiles one at a time on this 2-core machine (``default_workers``; the next step
lowered meanwhile), alternated twice with two side by side, ``--no-ratio``: 1b-t4 29.7, 33.1
-> 26.4, 28.4 s; nnx-t4 30.5, 32.2 -> 28.5, 29.9 s; lab-t4 61.8, 64.7 -> 58.9, 63.2 s; the
same plans and compiles. The four GPU rows afterwards (a slower hour: the lone compiles
5-13% slower than the table above):

        case           plan  cold s  warm s  full  reduced  compiles  1 compile s  cold / 1 compile
    --------  -------------  ------  ------  ----  -------  --------  -----------  ----------------
      lab-t4  4 x 2 nothing    67.5     0.9     2        6         8         32.9               2.1
       1b-t4     4 x 2 none    29.0     0.9     1        4         5         18.0               1.6
      nnx-t4     4 x 2 none    29.3     6.4     1        4         5         23.0               1.3
    lab-2xt4     2 x 2 none    74.2     4.6     2        6         8         27.8               2.7

After a later micro-batch's full-depth step was lowered while its reduced depths compile
(not beside a deciding compile), alternated with ``--root`` at 4264072, ``--no-ratio``: 1b-t4
31.6, 28.7, 32.1, 32.1, 35.0 -> 27.0, 28.2, 28.7, 32.7, 32.5 s; the same plans and compiles.
The four GPU rows afterwards, a slow hour (the same traced 1B plan 25.5 s at 16:40, 35-36 s at
18:05), the lone compile now without XLA's cost analysis (the plans skip it too):

        case           plan  cold s  warm s  full  reduced  compiles  1 compile s  cold / 1 compile
    --------  -------------  ------  ------  ----  -------  --------  -----------  ----------------
      lab-t4  4 x 2 nothing    81.2     1.4     2        6         8         35.5               2.3
       1b-t4     4 x 2 none    34.4     1.1     1        4         5         20.3               1.7
      nnx-t4     4 x 2 none    37.0     8.8     1        4         5         25.0               1.5
    lab-2xt4     2 x 2 none    86.0     5.2     2        6         8         28.2               3.0

The rest: docs/guides/planning.md ("How long a plan takes") and the closing notes of issue 50.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table

HERE = Path(__file__).resolve().parent
PRESETS = {  # case: (architecture, lora rank, sequence length, device, devices, advise)
    "lab-t4": ("gemma3_4b", 4, 400, "t4", None, False),
    "1b-t4": ("gemma3_1b", 4, 512, "t4", None, False),
    "1b-v5e": ("gemma3_1b", 4, 512, "v5e-1", None, False),
    "lab-2xt4": ("gemma3_4b", 4, 400, "t4", 2, False),
    "advise-4b": ("gemma3_4b", None, 400, "t4", None, True),
}
NNX = {"nnx-t4": "t4", "nnx-v5e": "v5e-1"}
CASES = [*PRESETS, *NNX]


# -- the Flax NNX decoder (Qwen3-0.6B's shape), written from its config --------------------

def nnx_decoder(depth: int):
    """An abstract (``nnx.eval_shape``) decoder of ``depth`` blocks with LoRA rank 4."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    hidden, heads, kv, head_dim, mlp, vocab = 1024, 16, 8, 128, 3072, 151_936

    def lora_linear(i, o, rngs):
        return nnx.LoRALinear(i, o, lora_rank=4, use_bias=False, dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.RMSNorm(hidden, rngs=rngs, param_dtype=jnp.bfloat16)
            self.q = lora_linear(hidden, heads * head_dim, rngs)
            self.k = lora_linear(hidden, kv * head_dim, rngs)
            self.v = lora_linear(hidden, kv * head_dim, rngs)
            self.o = lora_linear(heads * head_dim, hidden, rngs)
            self.norm2 = nnx.RMSNorm(hidden, rngs=rngs, param_dtype=jnp.bfloat16)
            self.gate = lora_linear(hidden, mlp, rngs)
            self.up = lora_linear(hidden, mlp, rngs)
            self.down = lora_linear(mlp, hidden, rngs)

        def __call__(self, x):
            b, t, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).reshape(b, t, heads, head_dim)
            k = jnp.repeat(self.k(h).reshape(b, t, kv, head_dim), heads // kv, axis=2)
            v = jnp.repeat(self.v(h).reshape(b, t, kv, head_dim), heads // kv, axis=2)
            mask = jnp.tril(jnp.ones((t, t), bool))
            y = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
            x = x + self.o(y.reshape(b, t, heads * head_dim))
            h = self.norm2(x)
            return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, hidden, param_dtype=jnp.bfloat16, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
            self.norm = nnx.RMSNorm(hidden, rngs=rngs, param_dtype=jnp.bfloat16)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.embed.attend(self.norm(x)).astype(jnp.float32)

    return nnx.eval_shape(lambda: Decoder(nnx.Rngs(0)))


def _token_loss(model, batch):
    """Next-token cross-entropy summed over the masked targets, and their count (written out,
    so an older checkout's code plans it too)."""
    import jax.numpy as jnp
    import optax

    logits = model(batch["tokens"][:, :-1])
    mask = batch["mask"][:, 1:].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return jnp.sum(losses * mask), jnp.sum(mask)


def _nnx_plan(device: str, log):
    import numpy as np
    import optax
    from flax import nnx

    import autoaccum

    data = {"tokens": np.zeros((8, 513), np.int32), "mask": np.ones((8, 513), np.int32)}
    return autoaccum.plan(
        nnx_decoder(28), data, effective_batch=8, optimizer=optax.adamw(1e-4),
        trainable=nnx.LoRAParam, loss_fn=_token_loss, device=device, log=log,
        search=autoaccum.Search(depth_variant=autoaccum.DepthVariant(depth=28,
                                                                      build=nnx_decoder)))


# -- one child ------------------------------------------------------------------------------

def child(case: str, cache: str) -> None:
    """Plans ``case`` with the need cache at ``cache``; prints one JSON line."""
    os.environ["AUTOACCUM_CACHE_DIR"] = cache
    if case.startswith("lab"):
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    start = time.perf_counter()
    import autoaccum
    from autoaccum.planning import _measure

    before = _measure.compile_count()
    out: dict = {"case": case}
    try:
        if case in NNX:
            plan = _nnx_plan(NNX[case], "stderr")
        else:
            arch, rank, seq, device, devices, advise = PRESETS[case]
            from autoaccum.adapters.keras.presets import advise_preset, plan_preset

            kwargs = dict(effective_batch=8, lora_rank=rank, sequence_length=seq,
                          dtype="bfloat16", device=device, log="stderr",
                          target=autoaccum.Target(devices=devices))
            if advise:
                advice = advise_preset(arch, **kwargs)
                rows = [a for a in advice.alternatives]
                out["rows"] = len(rows)
                out["row_full"] = [getattr(getattr(a, "plan", None), "compiles", None)
                                   and a.plan.compiles.full for a in rows]
                plan = None
            else:
                plan = plan_preset(arch, **kwargs)
        if plan is not None:
            out.update(micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
                       remat=plan.remat, strategy=plan.strategy,
                       need_gib=round(plan.need_bytes / 2**30, 2))
            count = getattr(plan, "compiles", None)
            if count is not None:
                out.update(full=count.full, reduced=count.reduced, cached=count.cached,
                           full_seconds=round(count.full_seconds, 1))
    except autoaccum.DoesNotFitError as error:
        out["does_not_fit"] = str(error).split(". ")[0][:120]
    out["compiles_total"] = _measure.compile_count() - before
    out["wall"] = round(time.perf_counter() - start, 1)
    print("RESULT " + json.dumps(out), flush=True)


def one_compile(case: str, micro_batch: int, accum_steps: int) -> None:
    """Compiles the chosen step of ``case`` once at full depth, alone; prints its seconds."""
    import autoaccum
    from autoaccum.planning._cache import CompileRequest, measure_all
    from autoaccum.planning._targets import resolve_target

    if case.startswith("lab"):
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    if case in NNX:
        import numpy as np
        import optax
        from flax import nnx

        from autoaccum.adapters.flax import FlaxAdapter
        from autoaccum.planning._plan_options import ProgramOptions

        data = {"tokens": np.zeros((8, 513), np.int32), "mask": np.ones((8, 513), np.int32)}
        prepared = FlaxAdapter().prepare(
            nnx_decoder(28), data, effective_batch=8, remat="none", remat_layers=None,
            options=ProgramOptions(optimizer=optax.adamw(1e-4), trainable=nnx.LoRAParam,
                                   loss_fn=_token_loss))
        program, device = prepared.program, NNX[case]
    else:
        from autoaccum.adapters.keras.presets._architectures import load_architecture
        from autoaccum.adapters.keras.presets._preset_plans import _preset_program

        arch, rank, seq, device, _, _ = PRESETS[case]
        program = _preset_program(load_architecture(arch), dtype="bfloat16", lora_rank=rank,
                                  optimizer="adamw", learning_rate=5e-5, overrides={},
                                  sequence_length=seq, policy="none")
    del autoaccum
    target = resolve_target(device, None).compile_target
    start = time.perf_counter()
    # Without XLA's cost analysis (the plan takes a deviceless GPU's flops from its depth
    # line; converting the whole step to HLO for it took 2.0-2.8 s for Gemma3-4B): building,
    # lowering and compiling the step, as its user would.
    measure_all([CompileRequest(program, micro_batch, accum_steps,
                                cost={"flops": 0.0, "bytes accessed": 0.0})], target, workers=1)
    print("RESULT " + json.dumps({"one_compile": round(time.perf_counter() - start, 1)}),
          flush=True)


def _run(args: list[str], root: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": root}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(HERE / "plan_speed.py"), *args], env=env,
                              cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": round(time.perf_counter() - start)}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": done.stderr[-400:]}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--root", default=str(HERE.parent), help="the checkout to run")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per plan")
    parser.add_argument("--no-ratio", action="store_true", help="skip the lone compile")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "CACHE"), help=argparse.SUPPRESS)
    parser.add_argument("--one-compile", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.one_compile:
        case, micro, accum = args.one_compile
        one_compile(case, int(micro), int(accum))
        return
    rows = []
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory() as cache:
            cold = _run(["--child", case, cache], args.root, args.timeout)
            warm = (_run(["--child", case, cache], args.root, args.timeout)
                    if "wall" in cold else {})
        one = {}
        if not args.no_ratio and "micro_batch" in cold:
            one = _run(["--one-compile", case, str(cold["micro_batch"]),
                        str(cold["accum_steps"])], str(HERE.parent), args.timeout)
        split = (f"{cold['micro_batch']} x {cold['accum_steps']} {cold['remat']}"
                 if "micro_batch" in cold else cold.get("does_not_fit", "")[:40]
                 or (f"{cold.get('rows')} rows" if "rows" in cold else ""))
        full = cold.get("full", "")
        ratio = (round(cold["wall"] / one["one_compile"], 1)
                 if "wall" in cold and one.get("one_compile") else "")
        rows.append([case, split,
                     cold.get("wall", f"timeout {cold.get('timeout', '?')}"),
                     warm.get("wall", ""), full, cold.get("reduced", ""),
                     cold.get("compiles_total", ""), one.get("one_compile", ""), ratio])
        print(json.dumps({"case": case, "cold": cold, "warm": warm, "one": one}),
              file=sys.stderr, flush=True)
    print_table(["case", "plan", "cold s", "warm s", "full", "reduced", "compiles",
                 "1 compile s", "cold / 1 compile"], rows)


if __name__ == "__main__":
    main()
