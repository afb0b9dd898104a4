"""Names a package re-exports, imported when first used (PEP 562).

``import autoaccum`` then imports neither JAX nor a framework, so ``autoaccum.configure()`` can
still set what JAX reads when it is imported and when its backends start.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``; ``exports`` maps each name to its relative
    module (a submodule maps to itself: ``{"planning": ".planning"}``).
    """
    def attribute(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where, package)
        value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def names() -> list[str]:
        return sorted(exports)

    return attribute, names
