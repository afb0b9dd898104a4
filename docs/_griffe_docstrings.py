"""A griffe extension for the docs site (mkdocs.yml): autoaccum's docstrings are Google style
with Sphinx roles and a few house habits, read here as mkdocstrings renders Markdown. It
changes only what the site shows; the docstrings themselves stay as written.

* ``:func:`plan``` and the other roles become code spans (``~a.b.C`` shows ``C``);
* a line ``Example:`` opens an Examples section (griffe knows only the plural);
* a doctest outside an Examples section (a bare ``>>>`` paragraph) becomes a ``pycon`` code
  block, which Markdown would otherwise read as nested quotes and reference links;
* inside ``Args:``, the grouping headings of long signatures (``Where it runs:`` followed by
  indented ``name: description`` entries) open a further parameters table titled with the
  heading, and a group of names wrapped over lines (``a, b,`` / ``c: as for plan``) is read
  as one entry.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const|ref):`(~?)([^`]+)`")
SECTIONS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments",
            "other parameters", "raises", "exceptions", "returns", "yields", "receives",
            "examples", "example", "attributes", "warns", "warnings", "methods", "functions",
            "classes", "modules", "note", "notes", "see also", "references"}
ENTRY = re.compile(r"^\s+(\*{0,2}\w+)(\s*,\s*\*{0,2}\w+)*\s*(\([^)]*\))?\s*:")
WRAPPED_NAMES = re.compile(r"^\s+\*{0,2}\w+(\s*,\s*\*{0,2}\w+)*\s*,\s*$")
DOCTEST_FLAG = re.compile(r"\s*#\s*doctest:.*$")


def _role(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"``{target.rsplit('.', 1)[-1] if tilde else target}``"


def _is_header(line: str) -> bool:
    return not line.startswith(" ") and line.endswith(":") and line[:-1].strip().lower() in SECTIONS


def _args_groups(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_args = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if in_args and WRAPPED_NAMES.match(line):  # "a, b," + "  c: ..." -> one entry
            while WRAPPED_NAMES.match(line) and i + 1 < len(lines):
                i += 1
                line = f"{line.rstrip()} {lines[i].strip()}"
        elif line and not line.startswith(" "):
            header = line.strip().lower().rstrip(":")
            if _is_header(line):
                in_args = header in {"args", "arguments", "parameters", "params"}
            elif (in_args and line.endswith(":") and i + 1 < len(lines)
                  and (ENTRY.match(lines[i + 1]) or WRAPPED_NAMES.match(lines[i + 1]))):
                if out and out[-1].strip():
                    out.append("")
                line = f"Args: {line[:-1].strip()}"
            else:
                in_args = False
        out.append(line)
        i += 1
    return out


def _fence_doctests(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_examples = in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line and not line.startswith(" "):
            in_examples = _is_header(line) and line[:-1].strip().lower() in {"examples", "example"}
        if not in_fence and not in_examples and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(DOCTEST_FLAG.sub("", lines[i]))
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return out


def markdown_docstring(text: str) -> str:
    """``text`` as the site renders it (see the module's docstring).

    Examples:
        >>> markdown_docstring("See :func:`plan` and :class:`~autoaccum.planning.Plan`.")
        'See ``plan`` and ``Plan``.'
        >>> markdown_docstring("Example:\\n  >>> 1")
        'Examples:\\n  >>> 1'

        >>> print(markdown_docstring("Args:\\n  a: one.\\n\\nMore:\\n  b,\\n    c: two."))
        Args:
          a: one.
        <BLANKLINE>
        Args: More
          b, c: two.
    """
    text = ROLE.sub(_role, text)
    text = re.sub(r"^(\s*)Example:\s*$", r"\1Examples:", text, flags=re.M)
    return "\n".join(_fence_doctests(_args_groups(text.split("\n"))))


class SphinxRolesAsCode(griffe.Extension):
    """Rewrites each docstring as :func:`markdown_docstring` says, when griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
