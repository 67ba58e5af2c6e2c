"""The wheels the GPU acceptance machine lacks, derived from what wantrain imports, downloaded into ``.whl/``.

The machine lent for acceptance runs (one H200, CPython 3.12; no package registry) has the packages listed in
``bench/gpu_image_packages.txt`` (a dated copy of the device library's list). What a run must carry is derived, not
written by hand, so that a new dependency cannot be forgotten:

1. every top-level module that a file of ``wantrain/`` imports (``ast``; imports inside functions included), less
   the standard library, mapped to its distribution (``importlib.metadata.packages_distributions``); a module no
   installed distribution provides, or one whose distribution ``pyproject.toml`` does not declare, is a problem;
   one declared only as an optional extra (``wandb``, ``prodigyopt``, ``bitsandbytes``) is not carried;
2. with ``[project] dependencies``, the roots; then their requirements, recursively (markers evaluated for CPython
   3.12 on Linux x86-64, no extras), stopping at what the image has;
3. a distribution is carried when the image lacks it, or has it at a version that a requirement refuses; it is
   pinned to the version installed here (the one the tests pass with).

The wheels are downloaded for CPython 3.12 manylinux x86-64 without their dependencies (step 2 named them) and the
folder is checked to stay under the 64 MiB a run carries. bench/README.md ("GPU acceptance run") has the install.

    python bench/fetch_wheels.py --dry-run     # the derivation and the pip command; nothing downloaded
    python bench/fetch_wheels.py               # into .whl/ (needs the package index)
    python bench/fetch_wheels.py --check       # .whl/ holds exactly the derived wheels (no index needed)
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE_LIST = ROOT / "bench" / "gpu_image_packages.txt"
CARRY_LIMIT = 64 * 2**20  # what the device tool carries in all
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64")
# The device's interpreter, for requirement markers (python3 3.12.3 on Linux x86-64)
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def normalise(name: str) -> str:
    """A distribution's name as PEP 503 compares it (``tomli_w`` and ``Tomli-W`` are ``tomli-w``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path = IMAGE_LIST) -> dict[str, str | None]:
    """Normalised name -> version (None: not read) of each package in the image list (``#`` lines are comments)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalise(name)] = version or None
    return out


def runtime_imports(package: Path = ROOT / "wantrain") -> dict[str, list[str]]:
    """Top-level module -> ``file:line`` of each import of it in ``package`` (absolute imports of other packages;
    the standard library and ``package`` itself left out)."""
    out: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in (package.name, "__future__"):
                    out.setdefault(top, []).append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return out


def declared(pyproject: Path = ROOT / "pyproject.toml") -> tuple[list[str], set[str]]:
    """(the ``[project] dependencies`` requirement strings, the normalised names of the optional extras')."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = {normalise(_requirement(r).name) for reqs in project.get("optional-dependencies", {}).values()
                for r in reqs}
    return list(project["dependencies"]), optional


def _requirement(text: str):
    from packaging.requirements import Requirement

    return Requirement(text)


@dataclass
class Derivation:
    carry: dict[str, str] = field(default_factory=dict)  # normalised name -> version installed here
    why: dict[str, str] = field(default_factory=dict)  # normalised name -> who needs it
    optional: set[str] = field(default_factory=set)  # imported, declared only as an optional extra: not carried
    problems: list[str] = field(default_factory=list)


def derive(imports: dict[str, list[str]], image: dict[str, str | None], dependencies: list[str],
           optional: set[str], distributions: dict[str, list[str]] | None = None,
           version=importlib.metadata.version, requires=importlib.metadata.requires) -> Derivation:
    """What a run must carry for ``imports`` on a machine that has ``image`` (see the module docstring).
    ``distributions``, ``version`` and ``requires`` default to this interpreter's installed packages."""
    from packaging.version import Version

    if distributions is None:
        distributions = importlib.metadata.packages_distributions()
    out = Derivation()
    required = {normalise(_requirement(r).name) for r in dependencies}
    queue: list[tuple[str, str]] = []
    for module, where in sorted(imports.items()):
        dists = distributions.get(module)
        if not dists:
            out.problems.append(f"{where[0]} imports {module}, which no installed distribution provides: install "
                                f"it here and declare it in pyproject.toml")
            continue
        name = normalise(dists[0])
        if name in optional and name not in required:
            out.optional.add(name)
        elif name not in required:
            out.problems.append(f"{where[0]} imports {module} (distribution {name}), which pyproject.toml does not "
                                f"declare: add it to [project] dependencies (or to an optional extra)")
        else:
            queue.append((name, f"{where[0]} (import {module})"))
    queue += [(r, "pyproject.toml") for r in dependencies]  # after the imports: these name where it is imported
    seen: set[str] = set()
    while queue:
        text, who = queue.pop(0)
        req = _requirement(text)
        if req.marker is not None and not req.marker.evaluate(DEVICE_MARKERS):
            continue
        name = normalise(req.name)
        if name in image:
            there = image[name]
            if there is None or Version(there) in req.specifier or name in out.carry:
                continue
            who = f"{who} needs {req.specifier}, the image has {there}"
        if name in seen:
            continue
        seen.add(name)
        try:
            out.carry[name] = version(name)
        except importlib.metadata.PackageNotFoundError:
            out.problems.append(f"{who} needs {req.name}, which is not installed here (nothing to pin a wheel to)")
            continue
        out.why[name] = who
        queue.extend((r, name) for r in requires(name) or [])
    return out


def derive_here() -> Derivation:
    dependencies, optional = declared()
    return derive(runtime_imports(), read_image(), dependencies, optional)


def uncarried(imports: dict[str, list[str]], image: dict[str, str | None], carried: set[str], optional: set[str],
              distributions: dict[str, list[str]]) -> list[str]:
    """Each import of ``imports`` whose distribution neither the image nor ``carried`` holds (optional extras
    aside): what would fail at import on the machine."""
    out = []
    for module, where in sorted(imports.items()):
        name = normalise((distributions.get(module) or [module])[0])
        if name not in image and name not in carried and name not in optional:
            out.append(f"{where[0]} imports {module} ({name}): neither in the image nor carried")
    return out


def pins(derivation: Derivation) -> list[str]:
    return [f"{name}=={version}" for name, version in sorted(derivation.carry.items())]


def command(folder: Path, derivation: Derivation) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "--abi", "cp312", *platforms, "--dest", str(folder), *pins(derivation)]


def check_folder(folder: Path, derivation: Derivation) -> list[str]:
    """What is wrong with ``folder`` as the carried wheels: a derived one missing, at another version, one too many
    (two versions of a package stop the install), or over the carry limit."""
    wheels = sorted(folder.glob("*.whl"))
    found = {normalise(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
    out = [f"no wheel of {n}=={v} in {folder}" for n, v in sorted(derivation.carry.items()) if n not in found]
    out += [f"{n} is {found[n]} in {folder}, {v} here" for n, v in sorted(derivation.carry.items())
            if n in found and found[n] != v]
    out += [f"{folder} has {n}, which is not derived (remove it)" for n in sorted(set(found) - set(derivation.carry))]
    total = sum(w.stat().st_size for w in wheels)
    if total > CARRY_LIMIT:
        out.append(f"{total / 2**20:.1f} MiB in {folder} is over the {CARRY_LIMIT / 2**20:.0f} MiB a run carries")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--dry-run", action="store_true", help="print the derivation and the command; download nothing")
    parser.add_argument("--check", action="store_true", help="check --dest against the derivation; download nothing")
    args = parser.parse_args(argv)
    derivation = derive_here()
    for name, version in sorted(derivation.carry.items()):
        print(f"# carry {name}=={version}: {derivation.why[name]}")
    for name in sorted(derivation.optional):
        print(f"# not carried (optional extra): {name}")
    if derivation.problems:
        for line in derivation.problems:
            print(f"error: {line}", file=sys.stderr)
        return 1
    if args.check:
        wrong = check_folder(args.dest, derivation)
        for line in wrong:
            print(f"error: {line}", file=sys.stderr)
        return 1 if wrong else 0
    cmd = command(args.dest, derivation)
    print(shlex.join(cmd))
    if args.dry_run:
        return 0
    args.dest.mkdir(exist_ok=True)
    subprocess.run(cmd, check=True)
    wrong = check_folder(args.dest, derivation)
    for line in wrong:
        print(f"error: {line}", file=sys.stderr)
    total = sum(w.stat().st_size for w in args.dest.glob("*.whl"))
    print(f"{len(derivation.carry)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
