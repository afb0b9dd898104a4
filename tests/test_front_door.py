"""The top level is a small front door; the engine is public in documented subpackages."""

from __future__ import annotations

import re

import autoaccum
from tests._paths import REPO


def _readme_front_door() -> set[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("### The API: the front door and the engine", 1)[1]
    table = section.split("\n\n", 2)[2]  # the table follows the section's first paragraph
    return set(re.findall(r"`(\w+)`", table.split("\n\n", 1)[0]))


def test_the_readme_lists_exactly_the_front_door():
    assert _readme_front_door() == set(autoaccum.__all__)


def test_the_front_door_stays_small_and_every_name_resolves():
    assert len(autoaccum.__all__) <= 28  # 24 names and the four option specs
    assert len(set(autoaccum.__all__)) == len(autoaccum.__all__)
    for name in autoaccum.__all__:
        assert getattr(autoaccum, name) is not None


def test_the_engine_is_served_by_subpackages_with_their_own_all():
    for package in (autoaccum.planning, autoaccum.training, autoaccum.devices):
        assert package.__doc__ and package.__all__
        for name in package.__all__:
            assert hasattr(package, name), (package.__name__, name)
    assert not hasattr(autoaccum, "search_micro_batch")  # engine names are not at the top
    assert autoaccum.planning.search_micro_batch is not None
