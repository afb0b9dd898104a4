"""Byte sizes as reports print them: two different sizes never read the same."""

import pytest

from autoaccum.devices._profiles import MiB, format_bytes, format_bytes_pair


@pytest.mark.parametrize("a, b", [
    (2.3 * MiB, 2.3 * MiB + 1), (2.3 * MiB, 2.3 * MiB - 5000), (100 * MiB, 100 * MiB + 1),
    (12 * 2**30, 12 * 2**30 + 4096), (1023, 1022),
])
def test_two_different_sizes_never_print_the_same(a, b):
    first, second = format_bytes_pair(a, b)
    assert first != second
    assert first.split()[-1] == second.split()[-1]  # the same unit, more digits


def test_close_sizes_get_the_digits_that_tell_them_apart():
    assert format_bytes_pair(2.3 * 2**20, 2.3 * 2**20 - 100) == ("2.3000 MiB", "2.2999 MiB")
    assert format_bytes_pair(1536, 12 * 2**30) == ("1.50 KiB", "12.0 GiB")


def test_sizes_that_already_differ_keep_three_figures():
    assert format_bytes_pair(1536, 12 * 2**30) == (format_bytes(1536), format_bytes(12 * 2**30))
    assert format_bytes_pair(5 * MiB, 5 * MiB) == ("5.00 MiB", "5.00 MiB")
