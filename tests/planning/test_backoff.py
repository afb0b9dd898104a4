"""Back-off and ``auto`` planning with REAL out-of-memory errors (a child under RLIMIT_AS).

The child warms up, caps its address space at VmSize + 45 MiB and runs real train steps of a
TinyLM (vocab 1024, 128 tokens): micro-batch 16 needs ~32 MiB, 32 needs ~59 MiB.
"""

import pytest

from tests._oom_child import run_child

pytestmark = [
    pytest.mark.xdist_group("planning.test_backoff"),  # one worker builds the module's fixtures
    pytest.mark.slow,  # a child process under RLIMIT_AS
    pytest.mark.skipif(not __import__("sys").platform.startswith("linux"),
                       reason="RLIMIT_AS and /proc are Linux"),
]


@pytest.fixture(scope="module")
def flax_run():
    return run_child("flax_backoff", vocab=1024, length=128, batch=64, headroom_mib=45,
                     big_vocab=2048, big_length=1024, tiny_headroom_mib=12)


def _chosen_runs_next_larger_fails(probes, chosen, batch):
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    larger = [d for d in divisors if d > chosen]
    ran = {p["micro_batch"] for p in probes if p["kind"] == "real step" and p["fits"]}
    failed = {p["micro_batch"] for p in probes if p["kind"] == "real step" and not p["fits"]}
    assert chosen in ran
    if larger:
        assert larger[0] in failed, (chosen, probes)
    for p in probes:
        if p["kind"] == "real step" and not p["fits"]:
            assert "RESOURCE_EXHAUSTED" in p["error"] or "YNNPACK" in p["error"]


def test_backoff_finds_a_micro_batch_that_runs_and_the_next_larger_fails(flax_run):
    out = flax_run["backoff"]
    assert 4 <= out["micro_batch"] < 64
    _chosen_runs_next_larger_fails(out["probes"], out["micro_batch"], 64)
    kinds = [p["why"] for p in out["probes"]]
    assert kinds[0] == "largest candidate" and kinds[-1] == "verify" and "bisect" in kinds
    assert "out of memory" in out["log"]


def test_failed_probes_leave_the_state_bit_identical(flax_run):
    assert any(not p["fits"] for p in flax_run["backoff"]["probes"])
    assert flax_run["state_unchanged"]


def test_auto_verifies_and_backs_off_below_the_compiled_estimate(flax_run):
    out = flax_run["auto"]
    assert out["compiled_micro_batch"] == 64  # the optimistic compile-only plan
    assert out["micro_batch"] < 64 and out["micro_batch"] * out["accum_steps"] == 64
    real = [p for p in out["probes"] if p["kind"] == "real step"]
    assert real[0]["why"] == "verify compiled plan" and not real[0]["fits"]
    assert real[1]["micro_batch"] == 32  # first back-off try: the next divisor down
    _chosen_runs_next_larger_fails(out["probes"], out["micro_batch"], 64)
    assert any("ran out of memory in a real step" in n for n in out["notes"])


def test_out_of_memory_at_micro_batch_one_explains_and_keeps_the_state(flax_run):
    text = flax_run["no_fit"]
    assert text is not None and "micro_batch=1" in text
    for advice in ("rematerialization", "LoRA", "shorter sequences", "smaller dtype"):
        assert advice in text
    assert "compiled step needs" in text
    assert "RESOURCE_EXHAUSTED" in flax_run["no_fit_cause"] or "YNNPACK" in flax_run[
        "no_fit_cause"]
    assert flax_run["no_fit_state_unchanged"]


def test_keras_backoff_keeps_the_variables_bit_identical():
    out = run_child("keras_backoff", vocab=1024, length=128, batch=64, headroom_mib=45)
    assert 4 <= out["micro_batch"] < 64
    _chosen_runs_next_larger_fails(out["probes"], out["micro_batch"], 64)
    assert out["state_unchanged"]


def test_an_uneven_plan_is_verified_by_its_own_step_with_no_compile_of_its_own():
    # Effective batch 13 with room for 7: the plan is 7 + 6, compiled and kept by the search.
    # Its real step is that step (not 7 + 7, compiled again and kept for nothing): as many
    # compiles as compiled probes, and the real step's figure is the plan's own.
    import optax
    from flax import nnx

    import autoaccum
    from tests._models import TinyLM, ragged_tokens, token_loss

    plan = autoaccum.plan(TinyLM(256, 64, 128, rngs=nnx.Rngs(0)),
                          ragged_tokens(32, 32, vocab=256), effective_batch=13,
                          budget="2300KiB", optimizer=optax.adamw, learning_rate=1e-3,
                          loss_fn=token_loss, log=None, search=autoaccum.Search(cache=False))
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (7, 2, 6)
    real = [p for p in plan.probes if p.kind == "real step"]
    assert len(real) == 1 and real[0].last_micro_batch == 6
    assert "the plan's compiled step" in real[0].estimate.target
    assert real[0].estimate.need_bytes == plan.need_bytes
    assert plan.compiles.full == sum(p.kind == "compile" for p in plan.probes)
    assert "verified by one real step at micro_batch=7 x 2 (last 6)" in plan.notes
