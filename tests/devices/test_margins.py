"""The explicit margins of a GPU's memory arithmetic, and what the environment says about the
pool: memory fraction, allocator, command buffers."""

from pathlib import Path

import pytest

from autoaccum.devices._margins import (
    Margin,
    apply_margins,
    command_buffers_enabled,
    default_margins,
    environment_memory_fraction,
)
from autoaccum.devices._profiles import MiB, find_profile, load_profile, profiles_dir
from autoaccum.planning._budget import profile_budget, resolve_fraction

# Gemma3-4B text, bf16, LoRA 4, seq 400, AdamW, compiled deviceless for the T4 at the lab's
# fraction 0.9 (XLA 0.10.2; benchmarks/dryrun.py measures them again): the accumulated step at
# micro-batch 1 x 8 and 2 x 4. The lab trains at batch 1 and runs out of memory at batch 2.
LAB_NEED_MICRO_1 = 14_288_700_913
LAB_NEED_MICRO_2 = 17_866_374_129  # the smallest of the compile settings measured (16.6 GiB)


def test_environment_fraction_wins_over_the_profile_default():
    t4 = find_profile("t4")
    fraction, why = resolve_fraction(t4, None, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"})
    assert fraction == 0.75 and "in the environment" in why
    budget = profile_budget(t4, environ={"XLA_CLIENT_MEM_FRACTION": "0.75"})
    assert budget.bytes == t4.budget_bytes(0.75, command_buffers=False)
    assert "XLA_CLIENT_MEM_FRACTION=0.75 in the environment" in budget.detail


def test_an_explicit_memory_fraction_wins_over_the_environment():
    fraction, why = resolve_fraction(find_profile("t4"), 0.5,
                                     {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"})
    assert (fraction, why) == (0.5, "memory_fraction=0.5")


def test_without_an_environment_fraction_the_profile_default_holds():
    t4 = find_profile("t4")
    assert resolve_fraction(t4, None, {}) == (t4.default_memory_fraction,
                                              "the profile's default")


def test_the_lab_setting_in_os_environ_reaches_a_deviceless_plan_budget(monkeypatch):
    from autoaccum.planning._targets import resolve_target

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
    resolved = resolve_target("t4")
    assert resolved.budget.bytes == find_profile("t4").budget_bytes(0.8)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 in the environment" in resolved.budget.detail


@pytest.mark.parametrize("value", ["1.5", "0", "ninety"])
def test_a_bad_environment_fraction_is_a_clear_error(value):
    with pytest.raises(ValueError, match=rf"Received: XLA_PYTHON_CLIENT_MEM_FRACTION='{value}'"):
        environment_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": value})


def test_both_fraction_variables_are_refused_as_jax_does():
    with pytest.raises(ValueError, match="Unset one of them"):
        environment_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
                                     "XLA_CLIENT_MEM_FRACTION": "0.8"})


def test_platform_allocator_has_no_pool_so_the_margins_outside_decide():
    t4 = find_profile("t4")
    fraction, why = resolve_fraction(t4, None, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    assert fraction == 1.0 and "platform" in why


def test_command_buffers_follow_the_environment_then_the_profile():
    profile_env = find_profile("t4").env
    assert command_buffers_enabled(profile_env, {})[0] is False  # the profile disables them
    assert command_buffers_enabled(
        profile_env, {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"})[0] is True
    assert command_buffers_enabled({}, {})[0] is True  # XLA's default


def test_the_pool_is_capped_by_the_margins_outside_it_near_fraction_one():
    t4 = find_profile("t4")
    total = t4.cuda_total_mib * MiB
    at_one = t4.pool_arithmetic(1.0, command_buffers=False)
    assert at_one.pool == total
    assert at_one.usable_pool == total - 300 * MiB  # the CUDA context stays outside
    with_graphs = t4.pool_arithmetic(1.0, command_buffers=True)
    assert with_graphs.usable_pool == total - (300 + 64) * MiB
    at_09 = t4.pool_arithmetic(0.9, command_buffers=True)
    assert at_09.usable_pool == at_09.pool  # 10% left covers them


def test_the_context_comes_off_the_pool_and_the_workspace_off_the_budget():
    margins = default_margins(cuda_context_reserve_mib=300, workspace_margin_mib=32)
    r = apply_margins(1000 * 2**20, 1000 * 2**20, margins, deviceless=True,
                      command_buffers=False)
    assert (r.usable_pool // 2**20, r.budget // 2**20, [m.name for m in r.applied]) == (
        700, 668, ["CUDA context", "cuDNN workspace"])


def test_the_lab_ground_truth_micro_batch_one_fits_and_two_does_not():
    budget = profile_budget(find_profile("t4"), environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
    assert LAB_NEED_MICRO_1 <= budget.bytes < LAB_NEED_MICRO_2
    names = [m.name for m in budget.margins]
    assert names == ["CUDA context", "cuDNN workspace", "deviceless tolerance (lab)"]
    assert all(m.source for m in budget.margins)


def test_on_the_device_itself_the_lab_tolerance_does_not_apply():
    t4 = find_profile("t4")
    assert (t4.budget_bytes(0.9, deviceless=True) - t4.budget_bytes(0.9, deviceless=False)
            == 128 * MiB)


def test_every_margin_line_names_its_size_place_and_source():
    budget = profile_budget(find_profile("a100-80gb"), environ={})
    lines = budget.margin_lines()
    assert lines[0].startswith("margin: CUDA context 300 MiB (outside the pool): ")
    assert any("cuDNN workspace 32 MiB (inside the pool)" in line for line in lines)


def _t4_with(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "custom.toml"
    path.write_text((profiles_dir() / "t4.toml").read_text() + extra)
    return path


def test_a_profile_margins_table_replaces_a_default_of_the_same_name(tmp_path):
    path = _t4_with(tmp_path, '\n[[margins]]\nname = "CUDA context"\nmib = 500\n'
                              'where = "outside"\nsource = "measured here"\n')
    context = next(m for m in load_profile(path).margins if m.name == "CUDA context")
    assert (context.mib, context.source) == (500, "measured here")


@pytest.mark.parametrize("table, message", [
    ('name = "x"\nmib = 1\nwhere = "nowhere"\nsource = "s"', "where must be one of"),
    ('name = "x"\nmib = -1\nwhere = "outside"\nsource = "s"', "cannot be negative"),
    ('name = "x"\nmib = 1\nwhere = "pool"', "needs name, mib, where, source"),
    ('name = "x"\nmib = 1\nwhere = "pool"\nsource = "s"\nwhen = "sometimes"',
     "when must be one of"),
])
def test_a_bad_margins_table_names_the_file_and_the_fix(tmp_path, table, message):
    path = _t4_with(tmp_path, f"\n[[margins]]\n{table}\n")
    with pytest.raises(ValueError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_a_margin_describes_a_credit_as_such():
    credit = Margin("tolerance", -128, "pool", "the lab", when="deviceless")
    assert credit.describe() == "tolerance credit 128 MiB (inside the pool): the lab"
    assert credit.applies(deviceless=False, command_buffers=False) is False


# --- provenance: which figure each margin came from ------------------------------------------


def test_every_shipped_margin_says_whether_it_was_estimated_or_measured():
    from autoaccum.devices import list_profiles

    for key in list_profiles():
        for margin in find_profile(key).margins:
            assert margin.provenance.startswith(("estimate:", "measured:")), (key, margin)
    # No GPU has been measured by benchmarks/gpu_validation.py yet: only the lab's T4
    # tolerance (a real Colab T4) is a measurement.
    measured = {(key, m.name) for key in list_profiles() for m in find_profile(key).margins
                if m.measured}
    assert measured == {("t4", "deviceless tolerance (lab)")}


def test_a_plan_report_names_each_margins_provenance():
    lines = profile_budget(find_profile("h100"), environ={}).margin_lines()
    assert any("[estimate: ~300 MB of CUDA context" in line for line in lines)


def test_a_margins_table_keeps_its_provenance_and_says_when_it_has_none(tmp_path):
    path = _t4_with(tmp_path, '\n[[margins]]\nname = "CUDA context"\nmib = 500\n'
                              'where = "outside"\nsource = "measured here"\n'
                              'provenance = "measured: out/gpu_validation.md, commit abc"\n'
                              '\n[[margins]]\nname = "spare"\nmib = 8\nwhere = "pool"\n'
                              'source = "s"\n')
    margins = {m.name: m for m in load_profile(path).margins}
    assert margins["CUDA context"].measured
    assert margins["CUDA context"].provenance == "measured: out/gpu_validation.md, commit abc"
    assert margins["spare"].provenance == "not stated in custom.toml"
    assert not margins["spare"].measured


def test_a_provenance_must_say_estimate_or_measured(tmp_path):
    path = _t4_with(tmp_path, '\n[[margins]]\nname = "x"\nmib = 1\nwhere = "pool"\n'
                              'source = "s"\nprovenance = "a colleague said so"\n')
    with pytest.raises(ValueError, match="provenance must start with 'estimate:'"):
        load_profile(path)
