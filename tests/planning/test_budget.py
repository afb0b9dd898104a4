"""Budgets: parsing user input, device figures and the CPU default."""

import pytest

from autoaccum.devices._profiles import find_profile
from autoaccum.internal import parse_budget, resolve_target
from autoaccum.planning._budget import cpu_default_budget, device_budget, resolve_fraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12GiB", 12 * 2**30), ("12 GB", 12 * 10**9), ("800MiB", 800 * 2**20), (2**20, 2**20),
     ("1.5GiB", int(1.5 * 2**30)), ("4096", 4096)],
)
def test_sizes_parse_to_bytes(text, expected):
    assert parse_budget(text).bytes == expected


@pytest.mark.parametrize("text", ["80%", 0.8, "0.8", "8e-1"])
def test_fractions_take_a_share_of_capacity(text):
    assert parse_budget(text, capacity_bytes=1000).bytes == 800


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-3GiB", "", 0, -5, True, "150%", [1]])
def test_unparseable_budget_names_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="'12GiB'.*Received: budget="):
        parse_budget(bad, capacity_bytes=1000)


@pytest.mark.parametrize(("bad", "why"), [
    ("150%", r"at most 1 \(100%\)"), (-5, "positive amount"), (0, "positive amount"),
    ("-1", "positive amount"), (" -12GiB", "positive amount"), (-0.5, "positive amount"),
    (0.0, "positive amount"), ("12 parsecs", r"GB, MB, KB: of 1000"),
    ("2.7", "in bytes is a whole number"), ("1.5", "in bytes is a whole number"),
    ("1000.9", "in bytes is a whole number"), ("2.7b", "in bytes is a whole number"),
    (1e-12, "no memory at all"), ("1e-12", "no memory at all")])
def test_a_budget_out_of_range_says_which_range(bad, why):
    with pytest.raises(ValueError, match=why):
        parse_budget(bad, capacity_bytes=1000)


@pytest.mark.parametrize("one", [1, "1"])
def test_a_budget_of_one_is_refused_as_the_one_byte_nobody_means(one):
    with pytest.raises(ValueError, match=r"one byte .*all the memory is 1\.0 or '100%'"):
        parse_budget(one, capacity_bytes=1000)
    assert parse_budget(1.0, capacity_bytes=1000).bytes == 1000  # the whole of it


def test_fraction_without_capacity_asks_for_bytes():
    with pytest.raises(ValueError, match="in bytes"):
        parse_budget("50%")


def test_device_budget_subtracts_other_live_arrays_and_margin():
    stats = {"bytes_limit": 10 * 2**30, "bytes_in_use": 3 * 2**30}
    b = device_budget(stats, resident_bytes=2 * 2**30)
    margin = int(10 * 2**30 * 0.03)
    assert b.bytes == 10 * 2**30 - 2**30 - margin
    assert b.source == "device"


def test_cpu_default_is_half_available_ram_minus_margin():
    b = cpu_default_budget()
    assert b.source == "cpu-default" and b.bytes > 0 and "50%" in b.detail


def test_resolve_budget_on_cpu_uses_the_documented_default_or_the_user_value():
    assert resolve_target(None).budget.source == "cpu-default"
    assert resolve_target(None, "1GiB").budget.bytes == 2**30


def test_a_memory_fraction_given_wins_over_the_environment_and_says_where_it_came_from():
    environment = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}
    assert resolve_fraction(find_profile("t4"), None, environment) == (
        0.8, "XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 in the environment")
    assert resolve_fraction(find_profile("t4"), 0.5, environment) == (0.5, "memory_fraction=0.5")
