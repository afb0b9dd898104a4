"""GPU profiles against XLA's shipped GPU target descriptions, and a deviceless compile for
every GPU profile.

The expected figures are in ``xla_gpu_specs.toml`` (read from openxla/xla's
``xla/backends/gpu/target_config/specs/*.txtpb``; no network at test time).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from autoaccum.devices._deviceless import deviceless_blocker, ptxas_version
from autoaccum.devices._profiles import GpuSpec, all_profiles, find_profile
from tests._paths import REPO

SPECS = tomllib.loads((Path(__file__).parent / "xla_gpu_specs.toml").read_text())
_SPEC_FILE = re.compile(r"target_config/specs/(\w+\.txtpb)")
# XLA ships no target description for these: their profiles say which vendor figures they took.
HAND_WRITTEN = {"t4", "l4", "l40s", "a10g", "rtx3090", "rtx4090", "rtx5090"}


def _gpu_profiles():
    return [p for p in all_profiles() if p.is_gpu]


def _spec_of(profile) -> str | None:
    named = set(_SPEC_FILE.findall(profile.source))
    assert len(named) <= 1, f"{profile.key} names several XLA specs: {sorted(named)}"
    return next(iter(named), None)


def test_every_gpu_profile_says_where_its_figures_come_from():
    for profile in _gpu_profiles():
        assert profile.source, f"{profile.key} has no source"
        spec = _spec_of(profile)
        if profile.key in HAND_WRITTEN:
            assert spec is None, profile.key
            assert profile.source.startswith("Hand-written: XLA ships no"), profile.key
            assert "SMs" in profile.source and "L2" in profile.source, profile.key
        else:
            assert spec in SPECS["specs"], f"{profile.key}: {profile.source[:120]}"
            assert "commit" in profile.source, profile.key


@pytest.mark.parametrize("key", sorted(p.key for p in all_profiles() if p.is_gpu))
def test_a_profile_built_from_an_xla_spec_matches_it_field_for_field(key):
    profile = find_profile(key)
    spec_file = _spec_of(profile)
    if spec_file is None:
        pytest.skip(f"{key}: XLA ships no spec (hand-written profile)")
    expected = {k: v for k, v in SPECS["specs"][spec_file].items() if k != "commit"}
    allowed = SPECS.get("deviations", {}).get(key, {})
    fields = {f.name for f in dataclasses.fields(GpuSpec)}
    assert set(expected) <= fields, sorted(set(expected) - fields)
    for name, value in expected.items():
        if name in allowed:
            continue
        assert getattr(profile.gpu, name) == value, (
            f"{key}.gpu.{name} = {getattr(profile.gpu, name)!r}, XLA's {spec_file} says {value!r}")
    assert SPECS["specs"][spec_file]["commit"][:12] in profile.source


def test_every_nvidia_spec_xla_ships_has_a_profile():
    named = {_spec_of(p) for p in _gpu_profiles()} - {None}
    missing = set(SPECS["specs"]) - named
    assert not missing, f"XLA specs without a profile: {sorted(missing)}"
    assert not set(SPECS["not_profiled"]) & named


def test_todays_gpus_are_there_with_the_names_people_use():
    for alias, key in [("B200", "b200"), ("nvidia-b200", "b200"), ("b200-180gb", "b200"),
                       ("B300", "b300"), ("GB200", "gb200"), ("GB300", "gb300"),
                       ("H200", "h200"), ("h100 pcie", "h100-pcie"), ("L40S", "l40s"),
                       ("RTX 5090", "rtx5090"), ("RTX PRO 6000", "rtx-pro-6000"),
                       ("rtx6000pro", "rtx-pro-6000"), ("RTX A6000", "a6000"),
                       ("a100-80gb-pcie", "a100-pcie-80gb")]:
        assert find_profile(alias).key == key, alias
    assert find_profile("b300").gpu.compute_capability == (10, 3)
    assert find_profile("gb300").gpu.feature_extension == "ACCELERATED_FEATURES"
    assert find_profile("rtx5090").gpu.compute_capability == (12, 0)


def test_blackwell_is_not_blocked_by_this_machines_ptxas():
    found = ptxas_version()
    if found is None or found[1][0] < 13:
        pytest.skip(f"needs a CUDA 13 ptxas; found {found}")
    for key in ("b200", "b300", "gb200", "gb300", "rtx-pro-6000", "rtx5090"):
        assert deviceless_blocker(find_profile(key)) is None, key
    blocked = deviceless_blocker(find_profile("v100-16gb"))
    assert blocked and "compute capability 7.0" in blocked and "dryrun-cuda12" in blocked


_COMPILE_EVERY_GPU = """
import json, sys, time
import jax, jax.numpy as jnp, optax
from autoaccum.devices._deviceless import deviceless_target
from autoaccum.devices._profiles import all_profiles

dims = [64, 64, 10]
params = {f"l{i}": {"w": jax.ShapeDtypeStruct((a, b), jnp.float32),
                    "b": jax.ShapeDtypeStruct((b,), jnp.float32)}
          for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))}
tx = optax.adam(1e-3)
opt_state = jax.eval_shape(tx.init, params)

def forward(p, x):
    for i in range(len(p)):
        x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
        x = jax.nn.relu(x) if i < len(p) - 1 else x
    return x

def step(state, x, y):
    p, o = state
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean()
    value, grads = jax.value_and_grad(loss)(p)
    updates, o = tx.update(grads, o, p)
    return (optax.apply_updates(p, updates), o), value

jitted = jax.jit(step, donate_argnums=0)  # one function, lowered once per target
out = {}
for profile in all_profiles():
    if not profile.is_gpu:
        continue
    start = time.perf_counter()
    try:
        target = deviceless_target(profile)
    except (RuntimeError, ImportError) as e:  # a GPU this machine's ptxas cannot compile for
        out[profile.key] = {"blocked": str(e)}
        continue
    args = target.shard(((params, opt_state), jax.ShapeDtypeStruct((16, 64), jnp.float32),
                         jax.ShapeDtypeStruct((16,), jnp.int32)))
    m = jitted.lower(*args).compile().memory_analysis()
    out[profile.key] = dict(kind=target.devices[0].device_kind,
                            argument=m.argument_size_in_bytes, temp=m.temp_size_in_bytes,
                            seconds=round(time.perf_counter() - start, 2))
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_every_gpu_profile_compiles_a_train_step_deviceless():
    """~5 s per GPU profile here (two shared CPU cores): one tiny MLP + Adam step each."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_EVERY_GPU], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    result = json.loads(line.removeprefix("RESULT"))
    gpus = {p.key: p for p in _gpu_profiles()}
    assert set(result) == set(gpus)
    for key, got in result.items():
        profile = gpus[key]
        blocker = deviceless_blocker(profile)
        if "blocked" in got:  # only where this machine's ptxas says why, and the fix
            assert blocker is not None, (key, got["blocked"])
            assert "ptxas" in got["blocked"] and "dryrun-cuda12" in got["blocked"], key
            continue
        assert blocker is None, key
        assert got["kind"] == profile.gpu.device_name, key
        assert got["argument"] > 0 and got["temp"] > 0, (key, got)
    compiled = {k for k, v in result.items() if "blocked" not in v}
    assert {"b200", "b300", "gb200", "gb300", "rtx-pro-6000", "rtx5090", "h200",
            "l40s", "t4"} <= compiled


def test_the_docs_table_lists_every_gpu_profile():
    text = (REPO / "docs" / "guides" / "planning.md").read_text()
    rows = {m.group(1): m for m in re.finditer(
        r"^\| `([\w-]+)` \| [^|]+ \| ([\d,]+) \| (\d+)\.(\d+)(a?) \|", text, re.MULTILINE)}
    for profile in _gpu_profiles():
        assert profile.key in rows, f"{profile.key} missing from docs/guides/planning.md"
        row = rows[profile.key]
        assert int(row.group(2).replace(",", "")) == profile.memory_mib, profile.key
        assert (int(row.group(3)), int(row.group(4))) == profile.gpu.compute_capability
        assert bool(row.group(5)) == (profile.gpu.feature_extension == "ACCELERATED_FEATURES")
