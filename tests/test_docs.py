"""Every code block of the README and the docs site runs as written, or says why it cannot; the
API reference documents every public name; the site's nav lists every page.

A fenced block is marked by an HTML comment on the line before it:

* ``<!-- readme-test: NAME -->``: it runs. The blocks of one page run in order, the ``python``
  ones in one namespace (a page's later examples use its earlier ones' names), in a temporary
  working folder; a ``bash`` block runs there under ``bash -e``, with this Python's scripts
  first on ``PATH``. ``devices=N`` after the name (on any block of a page) runs the whole page in
  a child process with N host CPU devices.
  ``requires=a,b`` runs the page only where those modules import (an optional extra, such
  as ``autoaccum[tunix]``), else skips it.
* ``<!-- readme-skip: REASON -->``: it does not run, for the reason given (it needs a GPU or the
  network); such blocks are few.
* ``text`` blocks show output; they are not code.

``mkdocs build --strict`` (``make docs``) checks the links, anchors and docstrings.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._paths import REPO, host_devices_env

DOCS = REPO / "docs"
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!-- readme-(test|skip): (.*?) -->")
OUTPUT_LANGUAGES = {"text"}
FAST_PAGES = {"guides/learning-rate.md", "guides/margins.md", "install.md"}
"""Pages whose blocks run in under about 2 s (``make test-fast`` runs them; the others are
``slow``)."""
MOST_SKIPPED = 8
"""Blocks that do not run, across the README and the site: few, each with its reason."""


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: "README.md", "docs/guides/flax.md"
    line: int
    language: str
    code: str
    mark: str | None  # "test", "skip" or None
    name: str  # the test's name, or the skip's reason
    devices: int = 1
    requires: tuple[str, ...] = ()  # modules the page needs (an optional extra)


def pages() -> list[Path]:
    """README.md and every page of the site."""
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, with their marks."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        mark = MARK.fullmatch(before.rstrip("\n").rsplit("\n", 1)[-1])  # the line before
        kind, words = (mark.group(1), mark.group(2).strip()) if mark else (None, "")
        devices, requires = 1, ()
        if kind == "test":
            name, *options = words.split()
            words = name
            for option in options:
                key, _, value = option.partition("=")
                assert key in ("devices", "requires"), f"{path}: unknown option {option!r}"
                if key == "devices":
                    devices = int(value)
                else:
                    requires = tuple(value.split(","))
        found.append(Block(str(path.relative_to(REPO)), before.count("\n") + 1,
                           match.group(1), match.group(2), kind, words, devices, requires))
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]


def runnable_pages() -> list[str]:
    """The site's pages with blocks to run, relative to ``docs/``."""
    return sorted({str((REPO / b.page).relative_to(DOCS)) for b in all_blocks()
                   if b.mark == "test" and b.page.startswith("docs/")})


def run_blocks(page_blocks: list[Block]) -> dict[str, str]:
    """Runs the marked blocks in order, in the working folder; returns each one's stdout."""
    import contextlib
    import io
    import warnings

    namespace: dict = {"__name__": "__docs__"}
    printed: dict[str, str] = {}
    bin_dir = str(Path(sys.executable).parent)
    for block in page_blocks:
        if block.mark != "test":
            continue
        label = f"{block.page}:{block.line}:{block.name}"
        if block.language == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                # The pages call configure() first, as a fresh process should; this one's
                # JAX started with the test session.
                warnings.filterwarnings("ignore", "autoaccum.configure.. was called after JAX")
                exec(compile(block.code, label, "exec"), namespace)
            printed[block.name] = out.getvalue()
        elif block.language == "bash":
            env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
                   "PYTHONPATH": str(REPO)}
            proc = subprocess.run(["bash", "-e", "-c", block.code], env=env,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"{label}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            printed[block.name] = proc.stdout
        else:
            raise AssertionError(f"{label}: no way to run a {block.language!r} block")
    return printed


def run_page(page: str, tmp_path: Path) -> dict[str, str]:
    """Runs the page's marked blocks (in a child process with host devices when one asks)."""
    page_blocks = blocks(DOCS / page)
    for module in {m for b in page_blocks for m in b.requires}:
        pytest.importorskip(module, reason=f"{page} needs {module} (an optional extra)")
    devices = max(b.devices for b in page_blocks)
    if devices == 1:
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        os.chdir(tmp_path)
        try:
            return run_blocks(page_blocks)
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
    child = ("import json, sys; from pathlib import Path; "
             "from tests.test_docs import DOCS, blocks, run_blocks; "
             f"out = run_blocks(blocks(DOCS / {page!r})); "
             "sys.stdout.flush(); sys.stderr.write('\\n@@OUT@@' + json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900,
                          env=host_devices_env(devices, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stderr.rsplit("@@OUT@@", 1)[1])


def test_every_code_block_runs_or_says_why_not():
    unmarked = [f"{b.page}:{b.line} ```{b.language}" for b in all_blocks()
                if b.mark is None and b.language not in OUTPUT_LANGUAGES]
    assert not unmarked, ("mark each block <!-- readme-test: NAME --> or <!-- readme-skip: "
                          f"REASON --> (text blocks are output): {unmarked}")
    for block in all_blocks():
        if block.mark == "skip":
            assert len(block.name.split()) >= 3, f"{block.page}:{block.line}: give the reason"
        if block.mark == "test":
            assert block.language in {"python", "bash"}, f"{block.page}:{block.line}"


def test_blocks_that_do_not_run_are_few_and_names_are_unique_per_page():
    skipped = [b for b in all_blocks() if b.mark == "skip"]
    assert len(skipped) <= MOST_SKIPPED, [f"{b.page}:{b.line}" for b in skipped]
    for path in pages():
        names = [b.name for b in blocks(path) if b.mark == "test"]
        assert len(names) == len(set(names)), (path, names)


def _check_own_loop(printed: dict[str, str], tmp_path: Path) -> None:
    for name, saved in (("train_step", "checkpoint.pkl"), ("keras_train_step",
                                                           "classifier.keras")):
        lines = printed[name].strip().splitlines()
        assert len(lines) == 4 and (tmp_path / saved).exists(), (name, lines)
        losses = [float(line.split()[1]) for line in lines[1:]]
        assert losses[-1] < losses[0], (name, losses)  # it trains


def _check_tunix(printed: dict[str, str], tmp_path: Path) -> None:
    def off(name: str) -> float:
        return float(printed[name].split()[-2 if name == "peft_trainer" else -1])

    # autoaccum's two paths equal the full-batch update; Tunix's MultiSteps does not.
    assert off("fit") <= 1e-5 and off("peft_trainer") <= 1e-5, printed
    assert printed["peft_trainer"].split()[-1] == "1"  # one optimizer step
    assert off("multisteps") > 0.1, printed


CHECKS = {"guides/own-loop.md": _check_own_loop, "guides/tunix.md": _check_tunix}
"""What a page's examples must print or write, beyond running."""


@pytest.mark.parametrize("page", [
    page if page in FAST_PAGES else pytest.param(page, marks=pytest.mark.slow)
    for page in runnable_pages()])
def test_a_docs_page_runs_as_written(page, tmp_path):
    printed = run_page(page, tmp_path)
    if page in CHECKS:
        CHECKS[page](printed, tmp_path)


def _reference() -> str:
    return "\n".join(path.read_text() for path in sorted((DOCS / "api").glob("*.md")))


@pytest.mark.parametrize("package", [
    "autoaccum", "autoaccum.planning", "autoaccum.training", "autoaccum.devices",
    "autoaccum.adapters.flax", "autoaccum.adapters.keras", "autoaccum.adapters.keras.presets",
    "autoaccum.reporting", "autoaccum.cli", "autoaccum.internal"])
def test_the_api_reference_documents_every_public_name(package):
    documented = set(re.findall(r"^::: ([\w.]+)$", _reference(), re.M))
    missing = [name for name in importlib.import_module(package).__all__
               if f"{package}.{name}" not in documented]
    assert not missing, f"add '::: {package}.NAME' to docs/api/ for {missing}"
    assert package in documented  # the package's own docstring


def test_the_nav_lists_every_page_of_the_site():
    config = (REPO / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$|^\s*-\s*([\w/.-]+\.md)\s*$", config, re.M))
    listed = {a or b for a, b in listed}
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk <= listed, sorted(on_disk - listed)
    assert "accuracy.md" in listed


def test_the_site_reads_the_house_docstrings_as_markdown():
    pytest.importorskip("griffe", reason="the docs tools come with the dev extra")
    sys.path.insert(0, str(DOCS))
    try:
        from _griffe_docstrings import markdown_docstring
    finally:
        sys.path.remove(str(DOCS))
    assert markdown_docstring("See :func:`plan`, :class:`~autoaccum.planning.Plan`.") == (
        "See ``plan``, ``Plan``.")
    assert markdown_docstring("Text.\n\nExample:\n  >>> 1\n  1") == (
        "Text.\n\nExamples:\n  >>> 1\n  1")
    assert markdown_docstring("Text.\n\n>>> f()  # doctest: +SKIP\n1\n\nMore.") == (
        "Text.\n\n```pycon\n>>> f()\n1\n```\n\nMore.")
    grouped = markdown_docstring(
        "Args:\n  a: one.\n\nWhere it runs:\n  b, c,\n    d: as for plan.\n\nReturns:\n  x.")
    assert grouped == ("Args:\n  a: one.\n\nArgs: Where it runs\n  b, c, d: as for plan.\n\n"
                       "Returns:\n  x.")


PRIVATE_PATH = re.compile(
    r"autoaccum(?:\.\w+)*\._[a-z]\w*|:(?:mod|func|class|data|meth|attr):`~?\.+_\w+")
"""A dotted path through a private module (``autoaccum.planning._search``), or a relative
cross-reference to one (``:func:`~._search.divisors```)."""


def test_docstrings_name_public_paths_only():
    """What a docstring (a module's, a class's, a function's or an attribute's) points a
    reader to is public (a subpackage's name, or ``autoaccum.internal``); examples may show a
    private ``__module__`` as it prints."""
    found = []
    for path in sorted((REPO / "autoaccum").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                continue
            example = False
            for line in node.value.value.splitlines():
                stripped = line.strip()
                example = stripped.startswith(">>>") or (example and bool(stripped))
                if not example and PRIVATE_PATH.search(line):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {stripped}")
    assert found == []
