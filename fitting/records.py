"""Run directories: one JSONL of per-item records per (dataset, config), appended as items finish.

    results/runs/<run-name>/<dataset>__<config>.jsonl   one line per item, written when it finishes
    results/runs/<run-name>/summary.json                rewritten after every config block
    results/runs/<run-name>/run.json                    models, prompts and every command that ran
    results/runs/<run-name>/borrowed.json               records files that are another run's (below)

A run killed mid-item loses only that item: a partly written last line is ignored when read and
the item is decoded again on resume.

A run that reuses another run's records of a config (answers that do not depend on what the run
changes) refers to them instead of copying them: borrowed.json maps the file name to the run that
holds it, pinned to the bytes it had then (their length and sha256), so that run growing later
changes nothing here. Reading a borrowed file reads those bytes; writing to it first makes it the
run's own file, a copy of them, as a copy made by hand would have been.

A finished run's records may be stored gzipped (`gzip -n <dataset>__<config>.jsonl`, which leaves
`<dataset>__<config>.jsonl.gz`; results/README.md): every reader here takes the `.jsonl` path and
reads the `.gz` beside it when the plain file is absent, lending included (borrowed.json pins the
uncompressed bytes, so packing a run changes nothing that borrows from it). Writing to a packed
file first unpacks it, so a resumed run goes on appending to a plain file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fitting.datasets import parse_rows

SEP = "__"
RUNS_DIR = Path(__file__).resolve().parent.parent / "results" / "runs"  # records apart from the harness
BORROWED = "borrowed.json"
PACKED = ".gz"  # a records file stored gzipped: <name>.jsonl.gz stands for <name>.jsonl
# Flash attention changes which greedy near-ties flip (texts, not accuracy: measured on GSM8K), so
# runs decode as the recorded ones were, with it off, though the gateway serves with it on.
RECORDED_FLASH_ATTN = False


def records_path(run_dir: Path, dataset: str, config: str) -> Path:
    return run_dir / f"{dataset}{SEP}{config}.jsonl"


def analysis_path(run_dir: Path, dataset: str, answers: str = "upstream") -> Path:
    """Where `python -m eval analyze` keeps the teacher-forced records of `answers`' answers
    (`answers="divergent"`: where `python -m eval diverge` keeps its labels)."""
    return run_dir / "analysis" / (f"{dataset}.jsonl" if answers == "upstream" else f"{dataset}.{answers}.jsonl")


def parse_source(spec: str) -> tuple[str, str, str | None]:
    """'DATASET,RUN[,ROWS]' (a run's answers to a dataset, optionally some rows) -> (dataset, run, rows)."""
    parts = spec.split(",")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"{spec!r}: use DATASET,RUN or DATASET,RUN,ROWS")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def load_analysed(specs: Iterable[str], runs_dir: Path, answers: str) -> dict[str, list[dict[str, Any]]]:
    """Analysis records of `answers` ("upstream" or "local") of each DATASET,RUN[,ROWS], by dataset."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        dataset, run, rows = parse_source(spec)
        path = analysis_path(runs_dir / run, dataset, answers)
        found = in_rows(read_records(path), parse_rows(rows))
        if not found:
            raise ValueError(f"{spec}: no analysed {answers} answers in {path}; run `python -m eval analyze"
                             + (" --answers local" if answers == "local" else "") + "` on them first")
        if "top" not in found[0]:
            raise ValueError(f"{path} has no top-k probabilities or token kinds: analyse it again into a fresh run")
        by_task.setdefault(dataset, []).extend(found)
    return by_task


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete record in `path` (none if it does not exist), or in the bytes it borrows;
    the last per id wins."""
    by_id: dict[str, dict[str, Any]] = {}
    for line in _lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short when a run was killed
        by_id[record["id"]] = record
    return list(by_id.values())


def _lines(path: Path) -> Iterator[str]:
    if path.exists():
        with path.open(encoding="utf-8") as handle:
            yield from handle
    elif packed(path).exists():
        with gzip.open(packed(path), "rt", encoding="utf-8") as handle:
            yield from handle
    elif path.name in borrowed(path.parent):
        yield from io.TextIOWrapper(io.BytesIO(borrowed_bytes(path)), encoding="utf-8")


def packed(path: Path) -> Path:
    """Where `path`'s records are when the run is stored gzipped."""
    return path.with_name(path.name + PACKED)


def _held(path: Path) -> bool:
    """Whether the run holds `path` itself, plain or gzipped (not borrowed)."""
    return path.exists() or packed(path).exists()


def _held_bytes(path: Path) -> bytes:
    """The bytes of a file the run holds itself, unpacked if it is stored gzipped."""
    return path.read_bytes() if path.exists() else gzip.decompress(packed(path).read_bytes())


def borrowed(run_dir: Path) -> dict[str, dict[str, Any]]:
    """File name -> {"run", "bytes", "sha256"}: the files of `run_dir` that another run holds."""
    path = run_dir / BORROWED
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def borrowed_bytes(path: Path) -> bytes:
    """The bytes a borrowed `path` refers to; ValueError if the run holding them has changed them."""
    entry = borrowed(path.parent)[path.name]
    source = path.parent.parent / entry["run"] / path.name
    if not _held(source) and path.name not in borrowed(source.parent):
        raise FileNotFoundError(f"{path} borrows {source}, which does not exist")
    data = (_held_bytes(source) if _held(source) else borrowed_bytes(source))[:entry["bytes"]]
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"{path} borrows {source}, whose first {entry['bytes']} bytes have changed since")
    return data


def borrow(run_dir: Path, source_dir: Path, names: Iterable[str]) -> list[str]:
    """Refer to `source_dir`'s files `names` from `run_dir`, as `cp -n` would copy them: a name the
    run already has, as its own or borrowed, is left alone. Returns the names borrowed now."""
    entries, added = borrowed(run_dir), []
    for name in names:
        if _held(run_dir / name) or name in entries:
            continue
        source = source_dir / name
        if not _held(source) and name not in borrowed(source_dir):
            raise FileNotFoundError(f"{source} does not exist")
        data = _held_bytes(source) if _held(source) else borrowed_bytes(source)
        holder = source_dir.name if _held(source) else borrowed(source_dir)[name]["run"]
        entries[name] = {"run": holder, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        added.append(name)
    if added:
        write_json(run_dir / BORROWED, dict(sorted(entries.items())))
    return added


def _own(path: Path, copy: bool = True) -> None:
    """Before `path` is written: a gzipped file is unpacked (`copy`) or dropped, and a borrowed file
    becomes the run's own, a copy of the bytes it borrows (`copy`), or nothing yet where the write
    replaces it whole."""
    if not path.exists() and packed(path).exists():
        if copy:
            path.write_bytes(_held_bytes(path))
        packed(path).unlink()
        return
    entries = borrowed(path.parent)
    if path.exists() or path.name not in entries:
        return
    if copy:
        path.write_bytes(borrowed_bytes(path))
    del entries[path.name]
    if entries:
        write_json(path.parent / BORROWED, entries)
    else:
        (path.parent / BORROWED).unlink()


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one record as one line, starting a new line if a killed run left a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _own(path)
    needs_newline = path.exists() and path.stat().st_size > 0 and not _ends_with_newline(path)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(("\n" if needs_newline else "") + json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace `path` with `records`, one per line (for records derived from others, never resumed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _own(path, copy=False)
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")


def merge_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace the records of these ids in `path` and add the new ones, keeping every other record."""
    by_id = {record["id"]: record for record in read_records(path)}
    by_id.update((record["id"], record) for record in records)
    write_records(path, by_id.values())


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


def configs_in(run_dir: Path, dataset: str) -> dict[str, Path]:
    """Config name -> JSONL path, for every config of `dataset` recorded (or borrowed) in `run_dir`."""
    found = {}
    for path in sorted(p for p in _records_files(run_dir) if p.name.startswith(f"{dataset}{SEP}")):
        found[path.stem.split(SEP, 1)[1]] = path
    return found


def datasets_in(run_dir: Path) -> list[str]:
    return sorted({path.stem.split(SEP, 1)[0] for path in _records_files(run_dir)})


def _records_files(run_dir: Path) -> set[Path]:
    """The `.jsonl` path of every records file the run holds (plain or gzipped) or borrows."""
    names = {name for name in borrowed(run_dir) if SEP in name and name.endswith(".jsonl")}
    names |= {path.name.removesuffix(PACKED) for path in run_dir.glob(f"*{SEP}*.jsonl{PACKED}")}
    return {*run_dir.glob(f"*{SEP}*.jsonl"), *(run_dir / name for name in names)}


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a reader never sees half a file), safe for concurrent writers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name != BORROWED:
        _own(path, copy=False)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(partial, path)


def append_invocation(run_dir: Path, meta: dict[str, Any]) -> None:
    """Record one command's settings in run.json (a list, one entry per invocation)."""
    path = run_dir / "run.json"
    history: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    history.append(meta)
    write_json(path, history)


def in_rows(records: Iterable[dict[str, Any]], rows: slice) -> list[dict[str, Any]]:
    """The records whose dataset row index falls in `rows` (a slice with non-negative bounds)."""
    start, stop, step = rows.start or 0, rows.stop, rows.step or 1
    return [r for r in records if r["row"] >= start and (stop is None or r["row"] < stop) and (r["row"] - start) % step == 0]
