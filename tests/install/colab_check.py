"""What the README's Colab install command does to Colab's GPU runtime, resolved here with pip.

    python tests/install/colab_check.py [--freeze FILE] [--readme README.md] [--json OUT]

(``--readme``/``--json`` may be repeated: several commands checked in one run share the
wheel, the environment and the fetched metadata.)

Colab ships jax, jax-cuda12-plugin/-pjrt, keras, keras-hub and tensorflow. A command that
moves jax but not its CUDA plugin breaks the GPU (PJRT mismatch); one that adds
``tensorflow-cpu`` next to ``tensorflow`` makes two distributions write one folder. This
script resolves the README's ``%pip install`` line with pip's own resolver against Colab's
published ``pip freeze`` as the installed set, and fails (exit 1) if either would happen.

How the installed set is made (no package is downloaded or installed):

1. A virtual environment without pip gets one ``*.dist-info`` folder per line of the freeze:
   name and version (local labels such as ``+cu128`` kept), so pip sees exactly Colab's
   versions as installed.
2. pip (run from outside with ``--python`` pointing at that environment) resolves the
   command with ``--dry-run --report`` for Colab's interpreter (``--python-version`` from the
   freeze's header, CPython, manylinux x86_64, wheels only, as Colab installs them), keeping
   installed versions that satisfy (its default ``only-if-needed``), exactly as on Colab.
3. Installed packages that the resolution walks through must carry their real
   dependencies, or pip would keep them without checking what they require. The script
   walks the requirement graph from the command through the resulting environment and, for
   each kept Colab package it reaches, fetches that exact version's metadata with pip
   (``--dry-run --no-deps --report``: PEP 658 metadata, no wheel) and writes it into the
   fake dist-info; then resolves again, until no new package is reached (six rounds for
   the shipped freeze).

Limits, said plainly: pip evaluates environment markers with the interpreter that runs it
(this machine's Python), while wheels and ``Requires-Python`` are chosen for Colab's; Colab
packages the resolution never reaches keep their name and version only, so what pip would
print afterwards about *their* requirements ("pip's dependency resolver does not currently
take into account ...") is not predicted; a package whose exact version is not on PyPI
(``torch==2.11.0+cu128`` from PyTorch's index) is read from PyPI without its local label.

Exit codes: 0 pass, 1 a check failed, 3 PyPI (or the configured index) is unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
FREEZE = Path(__file__).resolve().parent / "colab-pip-freeze.gpu.txt"

TENSORFLOWS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
               "tensorflow-macos", "tensorflow-aarch64", "tensorflow-rocm", "tf-nightly",
               "tf-nightly-cpu", "tf-nightly-gpu")
JAX_FAMILY = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
              "jax-cuda13-pjrt")
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)),
             "manylinux2014_x86_64", "linux_x86_64")
# Ubuntu 22.04's glibc is 2.35: any manylinux wheel up to it installs there.
NETWORK_ERRORS = ("Failed to establish a new connection", "Network is unreachable",
                  "Temporary failure in name resolution", "Max retries exceeded",
                  "Could not fetch URL", "Connection refused", "timed out")


class IndexUnreachableError(RuntimeError):
    """The package index cannot be reached."""


def colab_command(readme: Path) -> list[str]:
    """The requirements of the README's one ``%pip install`` line (options dropped)."""
    lines = [line.strip() for line in readme.read_text().splitlines()
             if line.strip().startswith("%pip install")]
    if len(lines) != 1:
        raise SystemExit(f"Expected exactly one '%pip install' line in {readme}. "
                         f"Received: {lines}")
    words = shlex.split(lines[0])[2:]
    return [w for w in words if not w.startswith("-")]


def read_freeze(path: Path) -> tuple[dict[str, tuple[str, str]], str]:
    """{canonical name: (name, version)} and the Python version named in the header."""
    packages: dict[str, tuple[str, str]] = {}
    python = "3.12"
    for raw in path.read_text().splitlines():
        line = raw.strip()
        found = re.match(r"#\s*python-version:\s*([\d.]+)", line)
        if found:
            python = found.group(1)
        if not line or line.startswith(("#", "-")):
            continue
        if "==" in line:
            name, version = line.split("==", 1)
        elif " @ " in line:  # a direct URL: the version is in a wheel's file name
            name, url = line.split(" @ ", 1)
            wheel = re.search(r"/[^/]+?-([^-/]+)-[^-/]+-[^-/]+-[^-/]+\.whl", url)
            if not wheel:
                continue
            version = wheel.group(1)
        else:
            continue
        packages[canonicalize_name(name.strip())] = (name.strip(), version.strip())
    return packages, python


def build_wheel(work: Path) -> Path:
    out = work / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out),
          str(REPO)])
    return next(out.glob("autoaccum-*.whl"))


def make_environment(work: Path) -> Path:
    """A venv without pip; returns its site-packages."""
    venv = work / "colab"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return next((venv / "lib").glob("python*/site-packages"))


def write_installed(site: Path, freeze: dict[str, tuple[str, str]],
                    metadata: dict[str, dict[str, Any]]) -> None:
    for entry in site.glob("*.dist-info"):
        shutil.rmtree(entry)
    for key, (name, version) in freeze.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        meta = metadata.get(key, {})
        if meta.get("requires_python"):
            lines.append(f"Requires-Python: {meta['requires_python']}")
        lines += [f"Provides-Extra: {e}" for e in meta.get("provides_extra", [])]
        lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist", [])]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
        (info / "INSTALLER").write_text("colab-freeze\n")
        (info / "RECORD").write_text("")


def target_options(python: str) -> list[str]:
    platforms = [option for tag in PLATFORMS for option in ("--platform", tag)]
    return ["--python-version", python, "--implementation", "cp",
            "--abi", "cp" + python.replace(".", ""), "--abi", "abi3", "--abi", "none",
            *platforms, "--only-binary=:all:"]


class ResolutionError(RuntimeError):
    """pip found no set of versions that satisfies the command on top of Colab's."""


def resolve(venv_python: Path, requirements: list[str], python: str, work: Path) -> dict:
    report = work / "report.json"
    try:
        _run([sys.executable, "-m", "pip", "--python", str(venv_python), "install",
              "--dry-run", "--quiet", "--report", str(report), *target_options(python),
              *requirements])
    except subprocess.CalledProcessError as error:
        raise ResolutionError(error.stderr.strip()[-3000:]) from error
    return json.loads(report.read_text())


def fetch_metadata(pins: list[str], python: str, work: Path) -> dict[str, dict[str, Any]]:
    """Real metadata of exact versions (``name==version``), without downloading wheels:
    Colab's wheels first, else whatever this Python can read; all at once, else one by one."""
    found: dict[str, dict[str, Any]] = {}
    report = work / "metadata.json"
    for group in (pins, *([pin] for pin in pins)):
        wanted = [p for p in group if canonicalize_name(p.split("==")[0]) not in found]
        if not wanted:
            continue
        for options in (target_options(python), []):
            try:
                _run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                      "--ignore-installed", "--no-deps", "--report", str(report), *options,
                      *wanted])
            except subprocess.CalledProcessError:
                continue
            for item in json.loads(report.read_text())["install"]:
                found[canonicalize_name(item["metadata"]["name"])] = item["metadata"]
            break
    return found


def walk(roots: list[Requirement], versions: dict[str, str],
         metadata: dict[str, dict[str, Any]], python: str) -> tuple[set[str], list[str]]:
    """Names reached from ``roots`` in the final environment, and unmet requirements.

    Markers are evaluated for this interpreter and for Colab's (either may apply)."""
    environments = [default_environment(),
                    dict(default_environment(), python_version=python,
                         python_full_version=f"{python}.0")]
    reached: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    unmet: set[str] = set()
    stack = [(r, "the command") for r in roots]
    while stack:
        requirement, parent = stack.pop()
        key = canonicalize_name(requirement.name)
        version = versions.get(key)
        if version is None:
            unmet.add(f"{parent} needs {requirement}, which is not installed")
            continue
        if requirement.specifier and not _contains(requirement.specifier, version):
            unmet.add(f"{parent} needs {requirement}; the result has {version}")
        reached.add(key)
        extras = frozenset(requirement.extras)
        meta = metadata.get(key)
        if (key, extras) in seen or meta is None:
            continue
        seen.add((key, extras))
        for text in meta.get("requires_dist") or []:
            child = Requirement(text)
            if child.marker is None or any(
                child.marker.evaluate({**env, "extra": extra})
                for env in environments for extra in ({""} | extras)
            ):
                stack.append((child, f"{meta['name']} {version}"))
    return reached, sorted(unmet)


def check(freeze_path: Path, readme: Path, *, log=print) -> dict[str, Any]:
    """Resolve the README's Colab command against the freeze; return the findings."""
    (result,) = check_all(freeze_path, [readme], log=log)
    if isinstance(result, ResolutionError):
        raise result
    return result


def check_all(freeze_path: Path, readmes: list[Path], *,
              log=print) -> list[dict[str, Any] | ResolutionError]:
    """:func:`check` for several READMEs in one go: the wheel, the environment and the real
    metadata fetched for Colab's packages (the slow part) are shared; a command pip cannot
    resolve gives its :class:`ResolutionError` in place of findings."""
    freeze, python = read_freeze(freeze_path)
    commands = [colab_command(readme) for readme in readmes]
    _require_index()
    results: list[dict[str, Any] | ResolutionError] = []
    with tempfile.TemporaryDirectory(prefix="colab-check-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work)
        site = make_environment(work)
        metadata: dict[str, dict[str, Any]] = {}
        for command in commands:
            try:
                results.append(_check_command(command, freeze, python, wheel, site, metadata,
                                              work, log, freeze_path.name))
            except ResolutionError as error:
                results.append(error)
    return results


def _check_command(command: list[str], freeze: dict[str, tuple[str, str]], python: str,
                   wheel: Path, site: Path, metadata: dict[str, dict[str, Any]], work: Path,
                   log, freeze_name: str) -> dict[str, Any]:
    """Rounds of resolve, walk and fetch for one command; ``metadata`` (exact versions of
    Colab's packages, the same for every command) is filled in place."""
    requirements = []
    roots = []
    for text in command:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == "autoaccum":
            extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
            requirements.append(f"autoaccum{extras} @ {wheel.as_uri()}")
        else:
            requirements.append(text)
        roots.append(requirement)
    venv_python = site.parents[2] / "bin" / "python"
    for round_number in range(1, 8):
        write_installed(site, freeze, metadata)
        report = resolve(venv_python, requirements, python, work)
        installs = {canonicalize_name(i["metadata"]["name"]): i["metadata"]
                    for i in report["install"]}
        versions = {key: version for key, (_, version) in freeze.items()}
        versions.update({key: meta["version"] for key, meta in installs.items()})
        known = {**metadata, **installs}
        reached, _ = walk(roots, versions, known, python)
        to_fetch = sorted(k for k in reached if k not in known and k in freeze)
        log(f"round {round_number}: pip would install {len(installs)} package(s); "
            f"{len(to_fetch)} kept Colab package(s) need their real metadata")
        if not to_fetch:
            break
        pins = [f"{freeze[k][0]}=={freeze[k][1].split('+')[0]}" for k in to_fetch]
        fetched = fetch_metadata(pins, python, work)
        for key in to_fetch:
            metadata[key] = fetched.get(key, {"name": freeze[key][0], "requires_dist": []})
            if key not in fetched:
                log(f"  no metadata found for {freeze[key][0]}=={freeze[key][1]}")
    else:
        raise SystemExit("The installed set did not settle after 7 rounds.")
    _, unmet = walk(roots, versions, known, python)
    changes = []
    for key, meta in sorted(installs.items()):
        before = freeze.get(key, (meta["name"], None))[1]
        changes.append({"name": meta["name"], "colab": before, "after": meta["version"]})
    jax_versions = {k: versions[k] for k in JAX_FAMILY if k in versions}
    plugin_versions = {k: v for k, v in jax_versions.items() if k != "jaxlib"}
    tensorflows = {k: versions[k] for k in TENSORFLOWS if k in versions}
    failures = []
    jax_version = jax_versions.get("jax")
    mismatched = {k: v for k, v in plugin_versions.items() if _release(v) != _release(jax_version)}
    if mismatched:
        failures.append(f"jax {jax_version} but {mismatched}: the CUDA plugin/PJRT must match jax")
    if len(tensorflows) > 1:
        failures.append(f"more than one TensorFlow distribution: {tensorflows}")
    failures += [f"unmet: {u}" for u in unmet]
    return {"command": "%pip install " + " ".join(shlex.quote(c) for c in command),
            "python": python, "freeze": freeze_name, "changes": changes,
            "jax": jax_versions, "tensorflow": tensorflows, "failures": failures}


def print_findings(findings: dict[str, Any]) -> None:
    print(f"\nColab command: {findings['command']}  (Python {findings['python']}, "
          f"installed set: {findings['freeze']})")
    print(f"\n{'package':<28}{'Colab':>16}{'after':>16}  change")
    for row in findings["changes"]:
        before, after = row["colab"], row["after"]
        kind = "new" if before is None else _direction(before, after)
        print(f"{row['name']:<28}{before or '-':>16}{after:>16}  {kind}")
    print("\njax family after:", ", ".join(f"{k} {v}" for k, v in findings["jax"].items()))
    print("TensorFlow distributions after:",
          ", ".join(f"{k} {v}" for k, v in findings["tensorflow"].items()) or "none")
    for failure in findings["failures"]:
        print("FAIL:", failure)
    if not findings["failures"]:
        print("PASS: jax, jaxlib and the CUDA plugin/PJRT end at one version; one TensorFlow; "
              "every requirement reached from the command is met")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze", type=Path, default=FREEZE)
    parser.add_argument("--readme", type=Path, action="append",
                        help="README.md of this checkout by default; repeat to check several "
                        "in one run (each gets a '=== README' header)")
    parser.add_argument("--json", type=Path, action="append",
                        help="also write the findings here (once per --readme)")
    args = parser.parse_args(argv)
    readmes = args.readme or [REPO / "README.md"]
    if args.json and len(args.json) != len(readmes):
        parser.error(f"give one --json per --readme. Received: {len(args.json)} --json for "
                     f"{len(readmes)} README(s)")
    try:
        results = check_all(args.freeze, readmes, log=lambda m: print(m, file=sys.stderr))
    except IndexUnreachableError as error:
        print(f"SKIP: {error}", file=sys.stderr)
        return 3
    status = 0
    for i, (readme, findings) in enumerate(zip(readmes, results, strict=True)):
        if len(readmes) > 1:
            print(f"\n=== {readme}")
        if isinstance(findings, ResolutionError):
            print(f"FAIL: pip cannot resolve the Colab command on Colab's packages:\n{findings}")
            status = 1
            continue
        print_findings(findings)
        if args.json:
            args.json[i].write_text(json.dumps(findings, indent=2))
        status = max(status, 1 if findings["failures"] else 0)
    return status


def _require_index() -> None:
    try:
        _run([sys.executable, "-m", "pip", "index", "versions", "packaging"], timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        raise IndexUnreachableError(f"the package index cannot be reached ({error})") from error


def _run(command: list[str], *, timeout: float = 900) -> None:
    # No PYTHONPATH: a source checkout on it (with its build's *.egg-info) would count as
    # installed in the emulated environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if any(marker in output for marker in NETWORK_ERRORS):
            raise IndexUnreachableError(f"pip could not reach the index: {output.strip()[-400:]}")
        raise subprocess.CalledProcessError(proc.returncode, command, proc.stdout, proc.stderr)


def _contains(specifier: Any, version: str) -> bool:
    try:
        return specifier.contains(version, prereleases=True)
    except InvalidVersion:
        return True


def _release(version: str | None) -> str | None:
    return None if version is None else version.split("+")[0]


def _direction(before: str, after: str) -> str:
    try:
        a, b = Version(before), Version(after)
    except InvalidVersion:
        return "changed"
    return "upgrade" if b > a else "downgrade" if b < a else "reinstall"


if __name__ == "__main__":
    sys.exit(main())
