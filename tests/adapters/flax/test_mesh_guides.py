"""Models sharded the way JAX and Flax teach it now -- ``jax.set_mesh``, the legacy ``with
mesh:``, ``with_sharding_constraint`` on activations, ``Explicit`` axes -- planned and trained
inside the caller's context (and after it): the layout is kept (``strategy == "own"``) and one
accumulated step equals the guide's own full-batch step. Run in one child process with 8
host devices (``tests/_mesh_guide_child.py``, Flax's "Scale up on multiple devices" guide, both
versions); ``make test-mesh`` runs this file on the oldest stack too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._paths import REPO, host_devices_env
from tests._session import once_per_session

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("adapters.flax.test_mesh_guides")]

EXACT = 1e-5  # the bound; measured 5e-8 .. 2e-7


def _child() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests._mesh_guide_child"], cwd=REPO,
                          env=host_devices_env(8), capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def guides() -> dict:
    return json.loads(once_per_session("mesh-guides", lambda: json.dumps(_child())))


def _kept_and_exact(case: dict, *, data_parallel: int = 2,
                    axes=(["data", 2], ["model", 4])) -> None:
    assert "error" not in case, case.get("error")
    assert case["strategy"] == "own" and case["specs_kept"]
    assert case["data_parallel"] == data_parallel and case["mesh_axes"] == list(axes)
    assert case["split"][1] > 1  # accumulated: micro-batches of one example per data device
    assert case["params_error"] <= EXACT and case["loss_error"] <= EXACT
    assert case["val_loss_finite"]  # validation traces under the same mesh


def test_flax_0_12_guide_plans_and_trains_inside_set_mesh(guides):
    _kept_and_exact(guides["guide_0_12"])


def test_flax_0_11_guide_plans_and_trains_inside_the_legacy_with_mesh(guides):
    _kept_and_exact(guides["guide_0_11"])


def test_a_default_make_mesh_with_explicit_axes_runs_automatic_style_code(guides):
    case = guides["guide_0_12_default_mesh"]
    assert "error" not in case, case.get("error")
    assert case["strategy"] == "own" and "AxisType.Explicit" in case["axis_types"]


def test_explicit_axes_code_trains_inside_and_outside_set_mesh(guides):
    case = guides["explicit"]
    assert "error" not in case, case.get("error")
    _kept_and_exact(case["inside"])
    _kept_and_exact(case["outside"])


def test_the_smallest_constraint_case_and_an_unannotated_model_keep_the_context_mesh(guides):
    case = guides["smallest"]
    assert "error" not in case, case.get("error")
    _kept_and_exact(case["pair"])
    _kept_and_exact(case["replicated"])  # no weight split: the context mesh alone


def test_code_that_names_no_mesh_axis_runs_data_parallel_over_every_device(guides):
    # Inside the (2, 4) context, the context's layout is kept only where the model's code
    # needs it; a plain model gets autoaccum's data parallelism (every strategy open).
    assert guides["smallest"]["no_constraint"] == {"strategy": "replicated", "data_parallel": 8}


def test_one_device_inside_a_context_traces_the_specs_on_size_one_axes(guides):
    case = guides["smallest"]
    assert case["one_device"] == {"strategy": "replicated", "data_parallel": 1}
    assert case["train_step_after_block"]["loss"] > 0  # called after leaving the block


def test_a_one_axis_context_mesh_splits_the_batch_over_it(guides):
    _kept_and_exact(guides["one_axis"], data_parallel=8, axes=(["data", 8],))


def test_dry_runs_inside_a_context(guides):
    case = guides["dry_runs"]
    assert "error" not in case, case.get("error")
    if "t4" in case:  # one GPU: the model's specs resolve on size-1 axes
        assert case["t4"] == {"strategy": "replicated", "data_parallel": 1}
    if "v5e_8" in case:  # a slice of as many chips as the context mesh: its layout, kept
        assert case["v5e_8"]["strategy"] == "own"
        assert case["v5e_8"]["mesh_axes"] == [["data", 2], ["model", 4]]
    assert "Explicit" in case["explicit_zero2"] and "strategy='zero2'" in case["explicit_zero2"]
