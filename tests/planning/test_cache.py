"""The need cache: a repeated compile of the same program for the same target is read back; a
change to anything that changes the program (or the compiler, or the target) recompiles."""

import json
import os
import threading

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import autoaccum
from autoaccum.adapters.flax._nnx_program import flax_program
from autoaccum.planning._cache import (
    CompileRequest,
    NeedCache,
    compiler_fingerprint,
    measure_all,
    resolve_cache,
)
from autoaccum.planning._measure import CompileTarget
from tests._models import TinyLM, ragged_tokens, token_loss

SPEC = {"tokens": jax.ShapeDtypeStruct((16,), jnp.int32),
        "mask": jax.ShapeDtypeStruct((16,), jnp.int32)}


class SmallLM(nnx.Module):
    """Embedding -> vocabulary logits, with a parameter dtype."""

    def __init__(self, dim: int, dtype, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, dim, param_dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(dim, 64, param_dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def _program(*, dim=32, tx=None, dtype=jnp.float32, spec=SPEC):
    model = nnx.eval_shape(lambda: SmallLM(dim, dtype, rngs=nnx.Rngs(0)))
    return flax_program(model, spec, loss_fn=token_loss, tx=tx or optax.adam(1e-3))


def _measure(cache, program, b=2, k=4, target=None):
    return measure_all([CompileRequest(program, b, k)], target or CompileTarget(),
                       cache=cache)[0]


def test_the_same_program_is_read_back_not_recompiled(tmp_path):
    cache = NeedCache(tmp_path)
    first = _measure(cache, _program())
    again = _measure(cache, _program())
    assert (first.source, again.source) == ("compiled", "cache")
    assert again.need_bytes == first.need_bytes and again.compile_seconds == 0.0
    assert again.items() == first.items()


@pytest.mark.parametrize("change", [
    {"b": 4},
    {"k": 2},
    {"dim": 48},
    {"tx": optax.sgd(1e-3)},
    {"dtype": jnp.bfloat16},
    {"spec": {"tokens": jax.ShapeDtypeStruct((24,), jnp.int32),
              "mask": jax.ShapeDtypeStruct((24,), jnp.int32)}},
], ids=["micro_batch", "accum_steps", "architecture", "optimizer_state", "dtype", "seq_len"])
@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_changed_option_recompiles_and_the_original_is_still_cached(tmp_path, change):
    cache = NeedCache(tmp_path)
    shape = {k: change.pop(k) for k in ("b", "k") if k in change}
    original = _measure(cache, _program())
    changed = _measure(cache, _program(**change), **shape)
    assert changed.source == "compiled"
    assert _measure(cache, _program()).source == "cache"
    assert original.need_bytes > 0


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_changed_target_recompiles(tmp_path):
    cache = NeedCache(tmp_path)
    t4 = autoaccum.internal.resolve_target("t4", memory_fraction=0.9).compile_target
    smaller_pool = autoaccum.internal.resolve_target("t4", memory_fraction=0.5).compile_target
    assert _measure(cache, _program()).source == "compiled"
    assert _measure(cache, _program(), target=t4).source == "compiled"
    assert _measure(cache, _program(), target=smaller_pool).source == "compiled"
    assert _measure(cache, _program(), target=t4).source == "cache"


class BlockLM(nnx.Module):
    """Embedding -> a sequence of MLP blocks -> vocabulary logits."""

    def __init__(self, depth: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + jax.nn.gelu(block(x))
        return self.head(x)


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_a_changed_remat_policy_recompiles(tmp_path):
    model = BlockLM(3, rngs=nnx.Rngs(0))
    data = ragged_tokens(16, 16, vocab=64)

    def measure(remat):
        return autoaccum.measure(model, data, micro_batch=2, accum_steps=4,
                                 optimizer=optax.adam(1e-3), loss_fn=token_loss,
                                 search=autoaccum.Search(remat=remat, cache=str(tmp_path)))

    assert measure("none").source == "compiled"
    assert measure("nothing").source == "compiled"
    assert measure("none").source == "cache"
    assert measure("nothing").source == "cache"


@pytest.mark.slow  # over 2 s: make test runs it, make test-fast does not
def test_changed_xla_flags_or_compiler_options_recompile(tmp_path, monkeypatch):
    cache = NeedCache(tmp_path)
    session_flags = os.environ.get("XLA_FLAGS")  # the test session sets some (conftest.py)
    assert _measure(cache, _program()).source == "compiled"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert _measure(cache, _program()).source == "compiled"
    if session_flags is None:
        monkeypatch.delenv("XLA_FLAGS")
    else:
        monkeypatch.setenv("XLA_FLAGS", session_flags)
    with_options = CompileTarget(compiler_options=(("xla_backend_optimization_level", 1),))
    assert _measure(cache, _program(), target=with_options).source == "compiled"
    assert _measure(cache, _program()).source == "cache"


def test_the_key_covers_versions_settings_and_autoaccums_own_source():
    fingerprint = compiler_fingerprint()
    assert fingerprint["versions"]["jax"] == jax.__version__
    assert set(fingerprint["versions"]) >= {"jaxlib", "jax-cuda12-plugin", "keras", "flax"}
    assert len(fingerprint["autoaccum_source"]) == 64
    assert "jax_compiler_enable_remat_pass" in fingerprint["jax_settings"]


def test_an_identity_key_answers_without_building_the_program(tmp_path):
    cache = NeedCache(tmp_path)
    identity = {"model": "tiny", "dim": 32}
    first = measure_all([CompileRequest(_program, 2, 4, identity)], CompileTarget(),
                        cache=cache)[0]

    def must_not_build():
        raise AssertionError("built although the figure was cached")

    again = measure_all([CompileRequest(must_not_build, 2, 4, identity)], CompileTarget(),
                        cache=cache)[0]
    assert again.source == "cache" and again.need_bytes == first.need_bytes


def test_an_unreadable_entry_is_a_miss_and_is_rewritten(tmp_path):
    cache = NeedCache(tmp_path)
    _measure(cache, _program())
    for path in tmp_path.rglob("*.json"):
        path.write_text("{not json")
    assert _measure(cache, _program()).source == "compiled"
    entry = json.loads(next(tmp_path.rglob("*.json")).read_text())
    assert entry["estimate"]["need_bytes"] > 0 and "material" in entry


def test_concurrent_compiles_give_the_same_figures_as_one_at_a_time(tmp_path):
    programs = [_program(), _program(dim=48)]
    one = measure_all([CompileRequest(p, 2, 4) for p in programs], CompileTarget(), workers=1)
    two = measure_all([CompileRequest(p, 2, 4) for p in programs], CompileTarget(), workers=2)
    assert [e.need_bytes for e in one] == [e.need_bytes for e in two]


@pytest.mark.parametrize("workers", [1, 2])
def test_each_compile_starts_while_the_next_request_is_lowered(monkeypatch, workers):
    from autoaccum.planning import _cache

    first_compiling = threading.Event()
    lower, compile_ = _cache.lower_step, _cache.compile_lowered
    waited = []

    def lowering(program, micro_batch, *args, **kwargs):
        if micro_batch == 4:  # the second request: the first one's compile is under way
            waited.append(first_compiling.wait(timeout=30))
        return lower(program, micro_batch, *args, **kwargs)

    def compiling(lowered, *args, **kwargs):
        first_compiling.set()
        return compile_(lowered, *args, **kwargs)

    monkeypatch.setattr(_cache, "lower_step", lowering)
    monkeypatch.setattr(_cache, "compile_lowered", compiling)
    program = _program()
    two = measure_all([CompileRequest(program, 2, 4), CompileRequest(program, 4, 2)],
                      CompileTarget(), workers=workers)
    assert waited == [True] and [e.micro_batch for e in two] == [2, 4]


@pytest.mark.parametrize("cores, workers", [(1, 1), (2, 1), (3, 1), (4, 2), (64, 2)])
def test_compiles_run_one_at_a_time_on_two_cores_and_two_at_a_time_from_four(
        monkeypatch, cores, workers):
    # One XLA compile keeps up to two cores busy; one model's compiles one after the other
    # reuse each other's kernels (on 2 cores: 2-4 s faster plans than two side by side).
    from autoaccum.planning import _cache

    monkeypatch.delenv(_cache.WORKERS_ENV, raising=False)
    monkeypatch.setattr(_cache.os, "cpu_count", lambda: cores)
    assert _cache.default_workers() == workers
    monkeypatch.setenv(_cache.WORKERS_ENV, "3")
    assert _cache.default_workers() == 3


def test_cost_figures_given_with_a_request_are_not_analysed_again():
    known = {"flops": 123.0, "bytes accessed": 456.0}
    estimate = measure_all([CompileRequest(_program(), 2, 4, cost=known)], CompileTarget())[0]
    analysed = measure_all([CompileRequest(_program(), 2, 4)], CompileTarget())[0]
    assert (estimate.flops, estimate.bytes_accessed) == (123.0, 456.0)
    assert analysed.flops not in (0.0, 123.0)


@pytest.mark.slow  # three plans
def test_plan_with_cache_false_neither_reads_nor_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOACCUM_CACHE_DIR", str(tmp_path))
    data = ragged_tokens(16, 16, vocab=64)
    model = TinyLM(vocab=64, dim=32, hidden=64, rngs=nnx.Rngs(0))
    options = dict(effective_batch=8, optimizer=optax.adam, learning_rate=1e-3,
                   loss_fn=token_loss, budget="1GiB", log=None,
                   search=autoaccum.Search(method="compile"))
    autoaccum.plan(model, data, **{**options, "search": autoaccum.Search(method="compile",
                                                                         cache=False)})
    assert not list(tmp_path.rglob("*.json"))
    cold = autoaccum.plan(model, data, **options)
    warm = autoaccum.plan(model, data, **options)
    assert list(tmp_path.rglob("*.json"))
    assert all(p.why.endswith("(cached)") for p in warm.probes)
    assert [p.need_bytes for p in warm.probes] == [p.need_bytes for p in cold.probes]
    assert (warm.micro_batch, warm.accum_steps) == (cold.micro_batch, cold.accum_steps)


def test_a_bad_cache_option_names_the_choices():
    with pytest.raises(ValueError, match=r"Received: cache=3"):
        resolve_cache(3)


def test_the_command_line_has_a_no_cache_flag():
    from autoaccum.cli._main import build_parser

    args = build_parser().parse_args(["plan", "--preset", "gemma3_1b", "--effective-batch", "8",
                                      "--no-cache"])
    assert args.no_cache is True
