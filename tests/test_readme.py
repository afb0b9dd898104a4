"""The README is a front page: short, its examples the guides' own (run by ``tests/test_docs.py``
with every other code block of the README and the docs site), its links to pages that exist."""

from __future__ import annotations

import re

from tests._paths import REPO
from tests.test_docs import DOCS, blocks

README = REPO / "README.md"
MOST_LINES = 250


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MOST_LINES, f"README.md has {len(lines)} lines; move reference to docs/"


def test_the_readme_s_examples_are_the_guides_and_run_there():
    runnable = {b.name: b.code for b in blocks(README) if b.mark == "test"}
    assert {"keras_fit", "flax_fit"} <= set(runnable)
    in_docs = {b.name: b.code for path in sorted(DOCS.rglob("*.md")) for b in blocks(path)
               if b.mark == "test"}
    for name, code in runnable.items():
        assert in_docs.get(name) == code, (
            f"README example {name!r} must be a docs page's block of the same name, word for "
            "word (the docs tests run it)")


def test_the_readme_links_to_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing
