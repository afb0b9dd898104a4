"""Device profiles: loading, lookup by alias, validation errors, memory arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoaccum.devices._profiles import (
    DeviceProfile,
    MiB,
    all_profiles,
    find_profile,
    list_profiles,
    load_profile,
    profiles_dir,
)

EXPECTED = {
    "t4", "l4", "p100", "v100-16gb", "v100-32gb", "a10g", "a100-40gb", "a100-80gb",
    "h100-80gb", "h200", "rtx3090", "rtx4090", "cpu",
    "a100-pcie-80gb", "h100-pcie", "a6000", "l40s", "rtx5090", "rtx-pro-6000",
    "b200", "b300", "gb200", "gb300",
    "v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8", "v5p-8", "v4-8",
}  # fmt: skip


def test_every_expected_device_has_a_profile():
    assert set(list_profiles()) >= EXPECTED


def test_every_profile_loads_with_sane_values():
    for profile in all_profiles():
        assert isinstance(profile, DeviceProfile)
        assert 0.5 <= profile.default_memory_fraction <= 1.0
        assert profile.dtype_advice and "\n" not in profile.dtype_advice
        assert profile.workspace_margin_mib > 0 or profile.is_tpu
        if profile.is_tpu:
            tpu = profile.tpu
            assert profile.source and profile.bf16_native and not profile.margins
            assert tpu.chips * profile.memory_mib > 10_000
            assert 0.9 * profile.memory_mib < tpu.usable_hbm_mib <= 1.01 * profile.memory_mib
            assert tpu.device_kind.startswith("TPU") and tpu.accelerator_type
            assert profile.pool_bytes() == profile.budget_bytes() == tpu.usable_hbm_mib * MiB
        if profile.is_gpu:
            gpu = profile.gpu
            assert profile.memory_mib and profile.memory_mib > 10_000
            assert profile.cuda_total_mib is None or profile.cuda_total_mib <= profile.memory_mib
            assert profile.cuda_context_reserve_mib > 0
            assert gpu.core_count > 0 and gpu.memory_bandwidth > 1e11
            assert gpu.shared_memory_per_block_optin <= gpu.shared_memory_per_core
            assert profile.bf16_native == (gpu.compute_capability >= (8, 0))
            assert "--xla_gpu_enable_command_buffer=" in profile.env["XLA_FLAGS"]
            assert profile.name_patterns


def test_aliases_are_case_and_separator_insensitive():
    assert find_profile("Tesla-T4").key == "t4"
    assert find_profile("TESLA_T4").key == "t4"
    assert find_profile("tesla t4").key == "t4"
    assert find_profile("A100-80GB").key == "a100-80gb"
    assert find_profile("rtx-4090").key == "rtx4090"


def test_aliases_are_unique_across_profiles():
    seen: dict[str, str] = {}
    for profile in all_profiles():
        for alias in (profile.key, *profile.aliases):
            assert alias not in seen or seen[alias] == profile.key, alias
            seen[alias] = profile.key


def test_unknown_device_name_lists_known_profiles():
    with pytest.raises(ValueError, match="Unknown device 'tpu-v9'") as info:
        find_profile("tpu-v9")
    message = str(info.value)
    for key in ("t4", "a100-80gb", "h100-80gb", "cpu"):
        assert key in message
    assert "Received: device='tpu-v9'" in message
    assert len(message) < 800 and "autoaccum devices --json" in message  # lists the aliases


def test_unknown_device_name_suggests_near_names():
    with pytest.raises(ValueError, match="Did you mean 'a100-80gb'"):
        find_profile("a100-80g")


def test_load_profile_accepts_a_file_path():
    path = profiles_dir() / "l4.toml"
    assert load_profile(path).key == "l4"
    assert load_profile(str(path)).name == "NVIDIA L4"


def test_load_profile_missing_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="not found"):
        load_profile(tmp_path / "nope.toml")


def _write_variant(tmp_path: Path, drop: str | None = None, replace: tuple[str, str] = ("", "")):
    text = (profiles_dir() / "t4.toml").read_text()
    lines = [ln for ln in text.splitlines() if drop is None or not ln.startswith(drop + " =")]
    path = tmp_path / "custom.toml"
    path.write_text("\n".join(lines).replace(*replace) + "\n")
    return path


def test_profile_missing_a_field_names_the_file_and_field(tmp_path: Path):
    path = _write_variant(tmp_path, drop="workspace_margin_mib")
    with pytest.raises(ValueError, match="workspace_margin_mib") as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_profile_missing_a_gpu_field_names_it(tmp_path: Path):
    path = _write_variant(tmp_path, drop="core_count")
    with pytest.raises(ValueError, match=r"gpu\.core_count"):
        load_profile(path)


def test_profile_field_of_wrong_type_names_it(tmp_path: Path):
    path = _write_variant(tmp_path, replace=("bf16_native = false", 'bf16_native = "no"'))
    with pytest.raises(ValueError, match="'bf16_native' must be bool"):
        load_profile(path)


def test_profile_with_unknown_field_is_rejected(tmp_path: Path):
    path = _write_variant(tmp_path, replace=("memory_mib =", "memory_gib = 15\nmemory_mib ="))
    with pytest.raises(ValueError, match="memory_gib"):
        load_profile(path)


def test_invalid_toml_names_the_file(tmp_path: Path):
    path = tmp_path / "broken.toml"
    path.write_text("name = \n")
    with pytest.raises(ValueError, match=r"broken\.toml.*not valid TOML"):
        load_profile(path)


def test_profiles_dir_env_var_overrides_the_folder(tmp_path: Path, monkeypatch):
    (tmp_path / "mygpu.toml").write_text(
        (profiles_dir() / "t4.toml").read_text().replace('"t4", "tesla-t4"', '"mine"')
    )
    monkeypatch.setenv("AUTOACCUM_PROFILES_DIR", str(tmp_path))
    assert list_profiles() == ["mygpu"]
    assert find_profile("MINE").key == "mygpu"


def test_profiles_dir_env_var_pointing_nowhere_is_an_error(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("AUTOACCUM_PROFILES_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="AUTOACCUM_PROFILES_DIR"):
        list_profiles()


def test_pool_is_cuda_total_times_fraction_and_budget_subtracts_margin():
    t4 = find_profile("t4")
    assert t4.pool_bytes() == int(t4.cuda_total_mib * MiB * t4.default_memory_fraction)
    assert t4.pool_bytes(0.5) == int(t4.cuda_total_mib * MiB * 0.5)
    # On the device: the pool minus the cuDNN workspace; a deviceless T4 plan adds the lab's
    # credit (profiles/t4.toml [[margins]]).
    assert (t4.budget_bytes(0.5, deviceless=False)
            == t4.pool_bytes(0.5) - t4.workspace_margin_mib * MiB)
    assert t4.budget_bytes(0.5) == t4.pool_bytes(0.5) - t4.workspace_margin_mib * MiB + 128 * MiB
    l4 = find_profile("l4")  # no cuda_total_mib: falls back to memory_mib
    assert l4.pool_bytes(1.0) == l4.memory_mib * MiB


def test_invalid_memory_fraction_is_rejected():
    with pytest.raises(ValueError, match=r"Received: memory_fraction=1\.5"):
        find_profile("t4").pool_bytes(1.5)


def test_cpu_pool_needs_the_host_memory():
    cpu = find_profile("cpu")
    assert not cpu.is_gpu
    with pytest.raises(ValueError, match="total_bytes"):
        cpu.pool_bytes()
    assert cpu.pool_bytes(total_bytes=10 * MiB) == int(10 * MiB * cpu.default_memory_fraction)


def test_tpu_slices_answer_to_the_names_google_cloud_colab_and_kaggle_use():
    assert find_profile("colab-tpu").key == "v5e-1"
    assert find_profile("kaggle-tpu").key == "v5e-8"
    assert find_profile("v5litepod-8").key == "v5e-8"
    assert find_profile("TPU v6e-8").key == "v6e-8"
    v5e8 = find_profile("v5e-8")
    assert (v5e8.tpu.topology, v5e8.tpu.chips, v5e8.tpu.chips_per_host_bounds) == (
        "v5e:2x4", 8, (2, 4, 1))
    assert find_profile("v4-8").tpu.chip_config_name == "megacore"
    assert v5e8.platform == "tpu" and find_profile("t4").platform == "gpu"


def test_a_tpu_table_with_bad_bounds_is_refused_naming_the_field(tmp_path):
    text = (profiles_dir() / "v5e-8.toml").read_text().replace(
        "chips_per_host_bounds = [2, 4, 1]", "chips_per_host_bounds = [2, 4]")
    path = tmp_path / "odd.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"chips_per_host_bounds must be three positive"):
        load_profile(path)
