"""The package's import direction: entry points -> adapters -> training -> reporting ->
planning -> devices.

Every import in every module (module level and inside functions) is checked, so the layering
cannot silently regress. Rules:

* a module imports only from its own layer or a lower one; one way back up is named:
  planning's results (a plan, the advisor's rows, a ``DoesNotFitError``) show themselves
  through ``autoaccum.reporting``, imported inside their showing methods (``report``,
  ``__repr__``, ``_repr_html_``) when one is shown, never at module level;
* the core (devices, planning, training) imports no framework (keras, keras_hub, tensorflow,
  flax) and no adapter;
* one adapter never imports another; nothing outside an adapter imports its private modules
  or names (but ``autoaccum.internal``, the one place that re-exports the engine's unstable
  parts), and no module imports a private name (``_x``) of another subpackage;
* the library never imports the demo package (``autoaccum_demo``, reached through its own
  command), which imports only autoaccum's public surface (the front door and the public
  subpackages ``devices``, ``planning``, ``training``);
* there is no import cycle between modules, counting function-level imports and a package's
  ``__init__`` importing its own submodules (so ``autoaccum -> cli -> demo -> autoaccum``
  would be caught).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


LAYERS = {"devices": 0, "planning": 1, "reporting": 1.5, "training": 2, "adapters": 3, "entry": 4}
INTERNAL = "autoaccum.internal"
SHOWING_METHODS = ("report", "__repr__", "_repr_html_")
"""Methods of planning's results that may import ``autoaccum.reporting`` (the one way up)."""
FRAMEWORKS = ("keras", "keras_hub", "tensorflow", "flax")
PUBLIC_SUBPACKAGES = ("autoaccum.devices", "autoaccum.planning", "autoaccum.reporting",
                      "autoaccum.training")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "autoaccum" or len(parts) == 1:
        return "entry"
    return parts[1] if parts[1] in LAYERS else "entry"


def imports_of(path: Path) -> list[tuple[str, tuple[str, ...], int]]:
    """(absolute module, imported names, line) for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module_name(path)
    package = module if is_package(path) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, tuple(a.name for a in node.names), node.lineno))
    return found


def shown_through_reporting(path: Path) -> set[int]:
    """Lines of ``path``'s imports of ``autoaccum.reporting`` made inside a showing method
    (:data:`SHOWING_METHODS`), the one import allowed to go up a layer."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in SHOWING_METHODS:
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").lstrip(".").startswith(
                        "reporting"):
                    lines.add(node.lineno)
    return lines


def sources() -> list[Path]:
    """The package's modules (a probe file another test writes for a moment is left out, so
    tests running in parallel never see it)."""
    found = [*(ROOT / "autoaccum").rglob("*.py"), *(ROOT / "autoaccum_demo").rglob("*.py")]
    return sorted(p for p in found if not p.name.startswith(PROBE_PREFIX))


PROBE_PREFIX = "_layout_probe"


def adapter_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["autoaccum", "adapters"] else None


def violations(paths: list[Path] | None = None) -> list[str]:
    out = []
    for path in sources() if paths is None else paths:
        module = module_name(path)
        here = layer_of(module)
        showing = shown_through_reporting(path)
        for target, names, line in imports_of(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module} imports {target}"
            top = target.split(".")[0]
            if module.startswith("autoaccum_demo"):
                public = target == "autoaccum" or target in PUBLIC_SUBPACKAGES
                if top == "autoaccum" and (not public
                                           or any(n.startswith("_") for n in names)):
                    out.append(f"{where} (the demo uses autoaccum's public surface only)")
                continue
            if top == "autoaccum_demo":
                out.append(f"{where} (the library never imports the demo)")
            if top in FRAMEWORKS and here in ("devices", "planning", "training"):
                out.append(f"{where} (the core imports no framework)")
            if top != "autoaccum":
                continue
            there = layer_of(target)
            shown = here == "planning" and there == "reporting" and line in showing
            if LAYERS[there] > LAYERS[here] and not shown:
                out.append(f"{where} (layer {here} may not import layer {there})")
            mine, theirs = adapter_of(module), adapter_of(target)
            if theirs and mine and mine != theirs:
                out.append(f"{where} (one adapter never imports another)")
            inside = target.split(".")[3:] if theirs else []
            if theirs and mine != theirs and module != INTERNAL and (
                    any(p.startswith("_") for p in inside)
                    or any(n.startswith("_") for n in names)):
                out.append(f"{where} (a private module or name of the {theirs} adapter)")
            same_package = target.split(".")[:2] == module.split(".")[:2]
            if not same_package and any(n.startswith("_") and n != "__version__"
                                        for n in names):
                out.append(f"{where} (a private name of another subpackage)")
    return out


def test_imports_point_one_way():
    assert violations() == []


def test_no_import_cycles():
    modules = {module_name(p): p for p in sources()}
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        showing = shown_through_reporting(path) if layer_of(module) == "planning" else set()
        for target, names, line in imports_of(path):
            if line in showing:  # shown when called: the showing module is loaded by then
                continue
            for candidate in (target, *(f"{target}.{n}" for n in names)):
                if candidate in modules and candidate != module:
                    graph[module].add(candidate)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_rules_catch_a_violation(tmp_path, monkeypatch):
    bad = ROOT / "autoaccum" / "devices" / "_layout_probe_tmp.py"
    bad.write_text("from ..training._accumulate import accumulate_gradients\nimport keras\n")
    try:
        found = [v for v in violations([bad]) if "_layout_probe_tmp" in v]
    finally:
        bad.unlink()
    assert any("layer devices may not import layer training" in v for v in found)
    assert any("imports no framework" in v for v in found)


CORE = ("devices", "planning", "training")
DOCTEST_IMPORT = re.compile(r"^\s*(?:>>>|\.\.\.)\s+(?:from\s+(\S+)\s+import\s+(.+)|import\s+(.+))$")


def test_core_examples_use_the_core_and_the_public_api():
    """A docstring example in the core (devices, planning, training) imports no private module
    or name of a higher layer (an adapter's, an entry point's): it runs on the core and the
    public API, as the core's own code does."""
    found = []
    for path in sources():
        if layer_of(module_name(path)) not in CORE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = DOCTEST_IMPORT.match(line)
            if not match:
                continue
            if match.group(3):
                imported = [(name.split(" as ")[0].strip(), ())
                            for name in match.group(3).split(",")]
            else:
                names = tuple(n.split(" as ")[0].strip(" ()") for n in match.group(2).split(","))
                imported = [(match.group(1), names)]
            for target, names in imported:
                if target.split(".")[0] != "autoaccum" or layer_of(target) in CORE:
                    continue
                private = (any(p.startswith("_") for p in target.split(".")[1:])
                           or any(n.startswith("_") for n in names))
                if private:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_every_module_has_a_name_of_its_own():
    """One name per idea: no two modules of the package share a file name (``__init__.py``
    aside), so a name in a traceback, an import or a review says which module it is."""
    paths_by_name: dict[str, list[str]] = {}
    for path in sources():
        if path.is_relative_to(ROOT / "autoaccum") and path.name != "__init__.py":
            paths_by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in sorted(paths_by_name.items()) if len(paths) > 1}
    assert shared == {}


UNHELD_DOCUMENTS = ("design notes", "design.md")
"""Documents no file in the repository holds: a comment or docstring that cites one points
nowhere (cite docs/guides/*.md, docs/accuracy.md, or say the fact where it is used)."""


def test_no_module_cites_a_document_the_repository_does_not_hold():
    cites = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sources() if path.is_relative_to(ROOT / "autoaccum")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if any(name in line.lower() for name in UNHELD_DOCUMENTS)]
    assert cites == []
