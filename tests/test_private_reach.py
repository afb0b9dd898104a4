"""Keras's and JAX's internals are reached through one door per framework, nowhere else.

The doors: ``autoaccum/adapters/keras/_internals.py`` (Keras, keras-hub) and
``autoaccum/devices/_jax_internals.py`` (JAX, jaxlib); each of their names has a test of the
behaviour it relies on (``tests/adapters/keras/test_internals.py``,
``tests/devices/test_jax_internals.py``), so a new Keras or JAX touches one file. Every other
module of the package (and the demo) is checked, statement by statement (module level and
inside functions), for:

* an import of ``keras.src``, ``jax._src`` or ``jaxlib`` (``import x``, ``from x import y``,
  ``from keras import src``);
* a string naming such a module (``sys.modules.get("jax._src.xla_bridge")``,
  ``importlib.import_module(...)``);
* a private Keras or JAX name the doors hold, read, written or called as an attribute
  (``model._jax_state``; ``self._x`` is an object's own) or through
  ``getattr``/``setattr``/``hasattr``/``delattr``;
* in the Keras adapter, an object's ``__dict__`` or ``vars(...)`` (a Keras object's
  attributes set past ``Layer.__setattr__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DOORS = ("autoaccum/adapters/keras/_internals.py", "autoaccum/devices/_jax_internals.py")

PRIVATE_MODULES = ("keras.src", "jax._src", "jaxlib")
"""Packages whose modules are the frameworks' internals."""

PRIVATE_NAMES = frozenset({
    # Keras models, trainers, layers, optimizers, variables (adapters/keras/_internals.py)
    "_compile_config", "_compile_loss", "_deferred_initialize", "_flat_losses",
    "_flatten_layers", "_get_current_learning_rate", "_get_metrics_result_or_logs",
    "_initial_epoch", "_initializer", "_jax_state", "_jax_state_synced", "_keras_history",
    "_layout", "_learning_rate", "_loss_tracker", "_moments", "_reduction_axes",
    "_remat_mode", "_symbolic_build", "_to_backend_mesh", "_value",
    # keras-hub backbones
    "_lora_enabled_layers", "_lora_rank",
    # JAX (devices/_jax_internals.py)
    "_backends", "_plugins_registered", "_xla",
})
"""Private attributes of Keras, keras-hub and JAX objects that only a door may touch."""

ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")

KERAS_ADAPTER = "autoaccum/adapters/keras/"


def sources() -> list[Path]:
    """The package's and the demo's modules, the doors left out (a layout test's probe file
    included: it is a module like any other while it exists)."""
    found = [*(ROOT / "autoaccum").rglob("*.py"), *(ROOT / "autoaccum_demo").rglob("*.py")]
    return sorted(p for p in found if p.relative_to(ROOT).as_posix() not in DOORS)


def _is_private_module(name: str | None) -> bool:
    return bool(name) and any(name == m or name.startswith(m + ".") for m in PRIVATE_MODULES)


def _names_private_module(text: str) -> bool:
    """Whether a string names a private module (``"jaxlib"`` alone is also the distribution's
    name, which ``importlib.metadata`` reads: only its submodules count)."""
    return text == "keras.src" or text.startswith(("keras.src.", "jax._src", "jaxlib."))


def _own(node: ast.Attribute) -> bool:
    """``self.x`` / ``cls.x``: an autoaccum object's own attribute."""
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def reaches(where: str, text: str) -> list[str]:
    """Every private reach in one module's source ``text`` (``where``: its path from the
    repository root, which decides whether the Keras adapter's ``__dict__`` rule applies)."""
    tree = ast.parse(text, filename=where)
    keras_adapter = where.startswith(KERAS_ADAPTER)
    out = []

    def flag(node: ast.AST, what: str) -> None:
        out.append(f"{where}:{node.lineno}: {what}")

    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                                | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_private_module(alias.name):
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if _is_private_module(module):
                flag(node, f"from {module} import ...")
            for alias in node.names:
                if _is_private_module(f"{module}.{alias.name}"):
                    flag(node, f"from {module} import {alias.name}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and _names_private_module(node.value)):
            flag(node, f"the module name {node.value!r}")
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_NAMES and not _own(node):
                flag(node, f"the private attribute .{node.attr}")
            elif node.attr == "__dict__" and keras_adapter:
                flag(node, "an object's __dict__")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if (node.func.id in ATTRIBUTE_CALLS and len(args) > 1
                    and isinstance(args[1], ast.Constant) and args[1].value in PRIVATE_NAMES):
                flag(node, f"{node.func.id}(..., {args[1].value!r})")
            elif node.func.id == "vars" and keras_adapter:
                flag(node, "vars(...) of an object")
    return out


def violations(paths: list[Path] | None = None) -> list[str]:
    out = []
    for path in sources() if paths is None else paths:
        out += reaches(path.relative_to(ROOT).as_posix(), path.read_text())
    return out


def test_keras_and_jax_internals_are_reached_only_through_their_doors():
    assert violations() == []


def test_the_doors_exist_where_the_rule_says():
    for door in DOORS:
        assert (ROOT / door).is_file(), door


def _with(path: str, extra: str) -> list[str]:
    """The reaches of ``path`` with ``extra`` lines added to its source."""
    return reaches(path, (ROOT / path).read_text() + extra)


def test_the_rule_catches_a_keras_src_import_added_to_fit():
    found = _with("autoaccum/adapters/keras/_keras_fit.py",
                  "\n\ndef _probe():\n    from keras.src import backend\n    return backend\n")
    assert any("from keras.src import" in v for v in found)
    assert _with("autoaccum/adapters/keras/_keras_fit.py", "") == []


def test_the_rule_catches_every_form_of_reach():
    extra = "\n".join([
        "",
        "import jax._src.xla_bridge",
        "import jaxlib",
        "from keras import src",
        "from jax._src.lib import xla_client",
        "import sys",
        "bridge = sys.modules.get('jax._src.xla_bridge')",
        "def probe(model, layer):",
        "    model._jax_state = None",
        "    getattr(layer, '_remat_mode', None)",
        "    layer.__dict__['_moments'] = None",
        "    return vars(model)",
        "",
    ])
    found = _with("autoaccum/adapters/keras/_keras_step.py", extra)
    for what in ("import jax._src.xla_bridge", "import jaxlib", "from keras import src",
                 "from jax._src.lib import", "the module name 'jax._src.xla_bridge'",
                 "the private attribute ._jax_state", "getattr(..., '_remat_mode')",
                 "an object's __dict__", "vars(...) of an object"):
        assert any(what in v for v in found), (what, found)


def test_the_doors_themselves_reach_in():
    """The rule is not vacuous: the doors hold what it refuses elsewhere."""
    for door in DOORS:
        assert reaches("autoaccum/adapters/keras/x.py", (ROOT / door).read_text()), door
