"""Optional features and the extra that installs each: one check, one message.

``pip install autoaccum`` plans and trains Flax NNX models on any device; the rest comes in
extras, read from the package's own metadata (:data:`EXTRAS`, never a second copy):

* ``keras``: Keras 3 models, keras-hub presets (bringing TensorFlow through tensorflow-text)
  and the default demo, and ``keras_nlp`` (a shim whose models are keras-hub's);
* ``dryrun`` / ``dryrun-cuda12``: compiling for a named GPU that is not here (JAX's CUDA 13 /
  12 plugin at exactly JAX's version, without the CUDA libraries, and NVIDIA's ptxas and
  libdevice wheels, which XLA's GPU compile needs);
* ``cuda13`` (JAX's default) and ``cuda12``: JAX on an NVIDIA GPU, the plugin following JAX;
* ``plot``: ``plot_plan`` and ``autoaccum plan --plot``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = [
    "CORE_REQUIREMENTS",
    "CUDA_PLUGINS",
    "EXTRAS",
    "JAX_RANGE",
    "MissingExtraError",
    "cuda_plugin",
    "installed_version",
    "missing_from_extra",
    "require_extra",
]

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _declared() -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """The core requirements and each extra's: from the checkout's ``pyproject.toml`` when
    running from one, else from the installed package's metadata."""
    project = tomllib.loads(_PYPROJECT.read_text()).get("project", {}) \
        if _PYPROJECT.is_file() else {}
    if project.get("name") == "autoaccum":
        extras = project.get("optional-dependencies", {})
        return (tuple(project["dependencies"]),
                {name: tuple(reqs) for name, reqs in extras.items() if name != "dev"})
    core: list[str] = []
    extras: dict[str, list[str]] = {}
    for text in importlib.metadata.requires("autoaccum") or ():
        requirement = Requirement(text)
        marker = requirement.marker
        found = _EXTRA_MARKER.search(str(marker or ""))
        name = found.group(1) if found else None
        # A requirement for another platform (NVIDIA's wheels off Linux) is not one here.
        if name == "dev" or (marker is not None and not marker.evaluate({"extra": name or ""})):
            continue
        requirement.marker = None
        if name is None:
            core.append(str(requirement))
        else:
            extras.setdefault(name, []).append(str(requirement))
    return tuple(core), {name: tuple(reqs) for name, reqs in extras.items()}


_EXTRA_MARKER = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


CORE_REQUIREMENTS, EXTRAS = _declared()
"""The core requirements, and each extra's (``dev`` aside), as declared."""

JAX_RANGE = str(next(Requirement(r) for r in CORE_REQUIREMENTS
                     if Requirement(r).name == "jax").specifier)
"""The jax versions autoaccum supports."""

CUDA_PLUGINS: dict[str, tuple[str, str, str]] = {
    "cuda13": ("jax-cuda13-plugin", "jax-cuda13-pjrt", "dryrun"),
    "cuda12": ("jax-cuda12-plugin", "jax-cuda12-pjrt", "dryrun-cuda12"),
}
"""JAX's CUDA plugins, preferred first: (plugin, PJRT library, autoaccum extra)."""

_MODULES = {"keras-hub": "keras_hub", "jax-cuda12-pjrt": "jax_plugins.xla_cuda12",
            "jax-cuda13-pjrt": "jax_plugins.xla_cuda13"}
# Distribution name -> the module it provides, where they differ beyond '-' and '_'.

_NAMESPACED = {"nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-nvcc-cu12"}
# NVIDIA's wheels of ptxas and libdevice: files in the shared ``nvidia`` namespace, no module
# of their own; installed is what their metadata says.

_LOCKSTEP = {f"{cuda}{local}": plugins[:2]
             for cuda, plugins in CUDA_PLUGINS.items() for local in ("", "-local")}
# jax's own extras pin these distributions to jax's exact version.


def cuda_plugin() -> str | None:
    """The first CUDA plugin installed at jax's exact version (``"cuda13"``, ``"cuda12"``), or
    ``None``.

    Example:
      >>> from autoaccum.devices._extras import cuda_plugin
      >>> cuda_plugin() in (None, "cuda13", "cuda12")
      True
    """
    for cuda, distributions in CUDA_PLUGINS.items():
        if not _check_lockstep(distributions[:2]):
            return cuda
    return None


class MissingExtraError(ImportError):
    """An optional feature's extra is not installed (or not in range); the message names the
    ``pip install 'autoaccum[...]'`` that fixes it, ``extra`` the extra's name.

    Example:
      >>> str(MissingExtraError("plot_plan needs ...", extra="plot"))
      'plot_plan needs ...'
    """

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


def installed_version(distribution: str) -> str | None:
    """The installed version; ``""`` for a module without metadata; ``None`` without module.

    >>> from autoaccum.devices._extras import installed_version
    >>> installed_version("numpy") is not None, installed_version("no-such-package-xyz")
    (True, None)
    """
    if distribution in _NAMESPACED:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
    module = _MODULES.get(distribution, distribution.replace("-", "_"))
    try:
        if importlib.util.find_spec(module) is None:
            return None  # metadata alone (a half-removed package) does not make it usable
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def missing_from_extra(extra: str, packages: Sequence[str] | None = None) -> list[str]:
    """What of ``extra`` (or of its ``packages``) is missing or out of range, one phrase each.

    >>> from autoaccum.devices._extras import missing_from_extra
    >>> missing_from_extra("plot", packages=["matplotlib"])
    []
    """
    if extra not in EXTRAS:
        raise ValueError(
            f"Unknown extra. Use one of {', '.join(sorted(EXTRAS))}. Received: extra={extra!r}"
        )
    problems = []
    for requirement in _selected(extra, packages):
        version, specifier = installed_version(requirement.name), requirement.specifier
        if requirement.name == "jax" and not specifier:
            specifier = SpecifierSet(JAX_RANGE)  # the plugin extras take jax's core range
        if version is None:
            problems.append(f"{requirement.name} is not installed")
        elif version and specifier and not _within(version, specifier):
            problems.append(f"{requirement.name} {version} is outside {specifier}")
        for jax_extra in requirement.extras & set(_LOCKSTEP):
            problems += _check_lockstep(_LOCKSTEP[jax_extra])
        if "tpu" in requirement.extras and installed_version("libtpu") is None:
            problems.append("libtpu is not installed")
    return problems


def require_extra(extra: str, *, feature: str, packages: Sequence[str] | None = None) -> None:
    """Raise :class:`MissingExtraError` (an ``ImportError``) naming ``pip install
    'autoaccum[extra]'`` unless every package of ``extra`` (or of ``packages``) is installed
    within its range, before any traceback from deep inside.

    Args:
      extra: a key of :data:`EXTRAS`.
      feature: what needs it, for the message (``"keras-hub presets"``).
      packages: distribution names of that extra to check; default all of them.

    >>> from autoaccum.devices._extras import require_extra
    >>> require_extra("plot", feature="plot_plan")  # matplotlib is installed: no error
    """
    problems = missing_from_extra(extra, packages)
    if problems:
        raise MissingExtraError(
            f"{feature} needs autoaccum's `{extra}` extra: {'; '.join(problems)}. Install it "
            f"with: pip install 'autoaccum[{extra}]' (in a notebook: %pip install "
            f"'autoaccum[{extra}]', then restart the runtime). Received: "
            + ", ".join(_received(extra, packages)),
            extra=extra,
        )


def _check_lockstep(distributions: Sequence[str]) -> list[str]:
    jax_version = installed_version("jax")
    problems = []
    for name in distributions:
        version = installed_version(name)
        if version is None:
            problems.append(f"{name} is not installed")
        elif version and jax_version and version != jax_version:
            problems.append(f"{name} {version} is not jax's {jax_version} (they must match)")
    return problems


def _within(version: str, specifier: object) -> bool:
    try:
        return Version(version) in specifier  # type: ignore[operator]
    except InvalidVersion:
        return True  # a local build we cannot compare: let it try


def _selected(extra: str, packages: Sequence[str] | None) -> list[Requirement]:
    """The requirements of ``extra``, or those of its ``packages``."""
    return [r for r in map(Requirement, EXTRAS[extra])
            if (packages is None or r.name in packages)
            and (r.marker is None or r.marker.evaluate({"extra": extra}))]


def _received(extra: str, packages: Sequence[str] | None) -> list[str]:
    names = []
    for requirement in _selected(extra, packages):
        names.append(requirement.name)
        for jax_extra in requirement.extras & set(_LOCKSTEP):
            names += _LOCKSTEP[jax_extra]
        if "tpu" in requirement.extras:
            names.append("libtpu")
    return [f"{name}={installed_version(name)}" for name in dict.fromkeys(names)]
