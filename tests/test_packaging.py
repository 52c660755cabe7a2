"""The wheel: it carries the product (gateway, adapters, policies, fitting) and nothing of the study
harness, and its fitting commands start from it alone.

The wheel is built from a copy of the packaged sources (pip, with build isolation: setuptools
from the package index), installed with --no-deps into a fresh virtual environment whose
dependencies come from this one (a .pth line after its own site-packages, so the installed
packages are found first, never this checkout's), and run outside the repository:
`python -m gateway tune --help` and `steer --help`. About 15 s.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = {"gateway", "adapters", "policies", "fitting"}

pytestmark = pytest.mark.integration  # builds a wheel (the build backend comes from the package index)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh virtual environment holding only the wheel (its dependencies: this venv's)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy2(ROOT / name, source / name)
    for package in sorted(PACKAGED):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", str(source), "-w",
                            str(work / "dist")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("routing_gateway-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops - {n for n in tops if n.endswith(".dist-info")} == PACKAGED  # no eval/, bench/, tests/
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # after the venv's own site-packages on sys.path: the wheel's packages come first
    (Path(site) / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})


def test_the_packages_come_from_the_wheel(installed, tmp_path):
    found = _run(installed, tmp_path, "-c", "import adapters, fitting, gateway, policies; "
                                            "print(*(m.__file__ for m in (adapters, fitting, gateway, policies)))")
    assert found.returncode == 0, found.stderr
    venv = installed.parent.parent
    assert all(Path(path).is_relative_to(venv) for path in found.stdout.split()), found.stdout
    assert _run(installed, tmp_path, "-c", "import eval").returncode != 0  # the harness is not packaged


@pytest.mark.parametrize("command", [["tune", "--help"], ["steer", "--help"], ["steer", "fit", "--help"],
                                     ["steer", "report", "--help"]])
def test_the_fitting_commands_start_from_the_wheel(installed, tmp_path, command):
    result = _run(installed, tmp_path, "-m", "gateway", *command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: python -m gateway" in result.stdout


def test_the_fitting_code_loads_from_the_wheel(installed, tmp_path):
    result = _run(installed, tmp_path, "-c", "import fitting.tune, fitting.steering.fit, fitting.steering.report")
    assert result.returncode == 0, result.stderr[-3000:]
