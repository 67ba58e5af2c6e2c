"""``bench/fetch_wheels.py`` (issue 50): the wheels a GPU acceptance run carries are derived from what ``wantrain``
imports and declares, against the dated copy of the GPU image's package list, so that an import added to wantrain
cannot be left behind."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What bench/fetch_wheels.py carried by hand before issue 50 (blinker, starlette and uvicorn were missing)
HAND_WRITTEN = {"diffusers", "structlog", "tensorboardx", "av", "ftfy", "wcwidth", "orjson", "cattrs", "tomli-w",
                "crc32c"}


@pytest.fixture(scope="module")
def fetch_wheels():
    spec = importlib.util.spec_from_file_location("fetch_wheels", ROOT / "bench" / "fetch_wheels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _package(tmp_path: Path, source: str) -> Path:
    package = tmp_path / "wantrain"
    (package / "core").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("import os\nfrom wantrain import core\n")
    (package / "core" / "bus.py").write_text(source)
    return package


def test_every_import_of_wantrain_is_in_the_gpu_image_or_carried(fetch_wheels):
    derivation = fetch_wheels.derive_here()
    assert derivation.problems == []
    imports = fetch_wheels.runtime_imports()
    dependencies, optional = fetch_wheels.declared()
    distributions = importlib.metadata.packages_distributions()
    image = fetch_wheels.read_image()
    assert fetch_wheels.uncarried(imports, image, set(derivation.carry), optional, distributions) == []
    # the bus's blinker and the serve page's starlette and uvicorn are carried; torch and peft are the image's
    assert {"blinker", "starlette", "uvicorn", "diffusers", "structlog"} <= set(derivation.carry)
    assert "torch" not in derivation.carry and "peft" not in derivation.carry
    assert derivation.optional == {"wandb", "prodigyopt", "bitsandbytes"}  # optional extras are not carried
    assert all(version == importlib.metadata.version(name) for name, version in derivation.carry.items())
    # the hand-written list of before misses blinker: the check names the import
    missed = fetch_wheels.uncarried(imports, image, HAND_WRITTEN, optional, distributions)
    assert any(line.startswith("wantrain/core/bus.py:") and " imports blinker (blinker)" in line for line in missed)


def test_an_added_import_is_carried_or_named_as_a_problem(fetch_wheels, tmp_path):
    image = {"numpy": "2.5.2", "torch": "2.11.0"}
    # a declared dependency the image lacks: carried, with what it requires that the image lacks too (ftfy's wcwidth)
    package = _package(tmp_path, "import numpy\nimport ftfy\n\n\ndef f():\n    import blinker\n")
    derivation = fetch_wheels.derive(fetch_wheels.runtime_imports(package), image,
                                   ["numpy>=1.26", "ftfy>=6.1", "blinker>=1.9"], set())
    assert derivation.problems == [] and set(derivation.carry) == {"ftfy", "wcwidth", "blinker"}
    assert derivation.why["blinker"] == "wantrain/core/bus.py:6 (import blinker)"
    assert derivation.why["wcwidth"] == "ftfy"
    # a module no installed distribution provides, and one whose distribution pyproject.toml does not declare
    package = _package(tmp_path, "import numpy\nimport not_a_wantrain_dependency\n")
    derivation = fetch_wheels.derive(fetch_wheels.runtime_imports(package), image, [], set())
    assert [p.split(",")[0] for p in derivation.problems] == [
        "wantrain/core/bus.py:2 imports not_a_wantrain_dependency",
        "wantrain/core/bus.py:1 imports numpy (distribution numpy)"]


def test_a_package_the_image_has_at_a_version_a_requirement_refuses_is_carried(fetch_wheels, tmp_path):
    package = _package(tmp_path, "import cattrs\n")
    old = {"attrs": "23.1.0", "typing-extensions": "4.16.0"}  # cattrs here needs attrs>=25.4
    derivation = fetch_wheels.derive(fetch_wheels.runtime_imports(package), old, ["cattrs>=24.1"], set())
    assert "attrs" in derivation.carry and "the image has 23.1.0" in derivation.why["attrs"]
    assert "typing-extensions" not in derivation.carry


def test_the_carried_folder_is_checked_against_the_derivation(fetch_wheels, tmp_path):
    derivation = fetch_wheels.Derivation(carry={"blinker": "1.9.0", "tomli-w": "1.2.0"})
    (tmp_path / "blinker-1.9.0-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "tomli_w-1.1.0-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "structlog-26.1.0-py3-none-any.whl").write_bytes(b"x")
    assert fetch_wheels.check_folder(tmp_path, derivation) == [
        f"tomli-w is 1.1.0 in {tmp_path}, 1.2.0 here", f"{tmp_path} has structlog, which is not derived (remove it)"]


def test_the_wheel_script_names_a_pinned_cpython_312_manylinux_download_of_the_derived_packages(fetch_wheels):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "fetch_wheels.py"), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cmd = done.stdout.splitlines()[-1].split()
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "manylinux2014_x86_64" in cmd
    assert cmd[cmd.index("--dest") + 1].endswith(".whl")
    assert [c for c in cmd if "==" in c] == fetch_wheels.pins(fetch_wheels.derive_here())
    assert "# carry blinker==1.9.0: wantrain/core/bus.py:" in done.stdout
    assert subprocess.run(["git", "check-ignore", "-q", ".whl/x.whl"], cwd=ROOT).returncode == 0
