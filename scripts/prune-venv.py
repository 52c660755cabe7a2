"""Uninstall from this virtual environment every distribution the gateway does not need at run time.

scripts/setup.sh installs the whole lock (requirements/lock.txt), test and evaluation tools
included (pytest, hypothesis, schemathesis, matplotlib, ...). The container image (Dockerfile)
serves only, so its build stage keeps the closure of pyproject.toml's `dependencies` plus
llama-cpp-python and pip (`python -m gateway fetch-models` uses pip), following extras
(litellm needs httpx[http2]) and environment markers as this interpreter evaluates them, and
removes the rest, and then files no installed package loads: the CMake install of llama.cpp's
libraries and headers that a llama-cpp-python wheel built with its own compile leaves behind
(site-packages/lib, site-packages/include; setup.sh's Python-only wheel has none, and llama_cpp
loads the libraries setup.sh copies into llama_cpp/lib, beside llama-server, RUNPATH $ORIGIN)
and the web UI of litellm's proxy server (litellm/proxy/_experimental/out), which the gateway
never runs.

Usage: .venv/bin/python scripts/prune-venv.py [--dry-run]   (prints what it removes)
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
ALSO_KEEP = ["llama-cpp-python", "pip"]
UNUSED_PATHS = ["lib", "include", "litellm/proxy/_experimental/out"]  # relative to site-packages


def runtime_closure(roots: list[str]) -> set[str]:
    """Canonical names of the installed distributions that `roots` need, extras followed."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    keep: set[tuple[str, str]] = set()  # (name, extra) pairs already expanded; "" is the base
    todo = [Requirement(r) for r in roots]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name not in installed:
            continue
        for extra in ["", *sorted(requirement.extras)]:
            if (name, extra) in keep:
                continue
            keep.add((name, extra))
            for spec in installed[name].requires or []:
                dependency = Requirement(spec)
                marker = dependency.marker
                base = marker is None or marker.evaluate({"extra": ""})
                # the base needs what applies without an extra; an extra adds only what applies with it alone
                if (base if extra == "" else (not base and marker.evaluate({"extra": extra}))):
                    todo.append(dependency)
    return {name for name, _ in keep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    args = parser.parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    keep = runtime_closure(project["dependencies"] + ALSO_KEEP)
    installed = sorted({canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()})
    drop = [name for name in installed if name not in keep]
    print(f"[prune] keeping {len(keep)} distributions, removing {len(drop)}: {' '.join(drop) or '(none)'}")
    site = Path(sysconfig.get_paths()["purelib"])
    unused = [site / path for path in UNUSED_PATHS if (site / path).is_dir()]
    print(f"[prune] removing unused files: {' '.join(str(path.relative_to(site)) for path in unused) or '(none)'}")
    if args.dry_run:
        return
    if drop:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", *drop], check=True)
    for path in unused:
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
