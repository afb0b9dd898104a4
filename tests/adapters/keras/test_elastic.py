"""Elastic recovery in ``keras_fit`` with a REAL out-of-memory mid-run (child under RLIMIT_AS)."""

import sys

import pytest

from tests._oom_child import run_child

pytestmark = pytest.mark.slow  # subprocesses, keras-hub builds or large compiles


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux")
def test_real_out_of_memory_mid_run_matches_an_uninterrupted_run():
    # Micro-batch 32 needs ~60 MiB; after optimizer step 2 the cap drops to VmSize + 45 MiB.
    out = run_child("keras_elastic", vocab=1024, length=128, n=128, micro=32, accum=1,
                    fail_after=2, headroom_mib=45)
    assert out["iterations"] == 4
    assert out["events"] and "step 3: out of memory at micro_batch 32 x 1" in out["events"][0]
    assert out["micro_batch"] < 32 and out["micro_batch"] * out["accum_steps"] == 32
    assert out["moved"] > 1e-3  # it trained
    assert out["max_abs_diff"] < 1e-5
    assert abs(out["loss"][0] - out["reference_loss"][0]) < 1e-5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux")
def test_real_out_of_memory_in_an_uneven_step_goes_on_at_a_divisor_of_the_same_examples():
    # 48 = 32 + 16 per step; micro-batch 32 no longer fits after step 2: the same 48
    # examples are redone at the largest divisor of 48 that fits (24 or below), exactly.
    out = run_child("keras_elastic", vocab=1024, length=128, n=192, micro=32, accum=2, last=16,
                    fail_after=2, headroom_mib=45)
    assert out["iterations"] == 4
    assert out["events"] and "step 3: out of memory at micro_batch 32 x 2" in out["events"][0]
    assert "effective batch 48 unchanged" in out["events"][0]
    assert out["micro_batch"] < 32 and out["micro_batch"] * out["accum_steps"] == 48
    assert out["last_micro_batch"] is None
    assert out["moved"] > 1e-3
    assert out["max_abs_diff"] < 1e-5
    assert abs(out["loss"][0] - out["reference_loss"][0]) < 1e-5
