"""Run directories: one JSONL of per-item records per (dataset, config), appended as items finish.

    results/runs/<run-name>/<dataset>__<config>.jsonl   one line per item, written when it finishes
    results/runs/<run-name>/summary.json                rewritten after every config block
    results/runs/<run-name>/run.json                    models, prompts and every command that ran

A run killed mid-item loses only that item: a partly written last line is ignored when read and
the item is decoded again on resume.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SEP = "__"
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


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete record in `path` (none if it does not exist); the last per id wins."""
    if not path.exists():
        return []
    by_id: dict[str, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short when a run was killed
            by_id[record["id"]] = record
    return list(by_id.values())


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one record as one line, starting a new line if a killed run left a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    needs_newline = path.exists() and path.stat().st_size > 0 and not _ends_with_newline(path)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(("\n" if needs_newline else "") + json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace `path` with `records`, one per line (for records derived from others, never resumed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
    """Config name -> JSONL path, for every config of `dataset` recorded in `run_dir`."""
    found = {}
    for path in sorted(run_dir.glob(f"{dataset}{SEP}*.jsonl")):
        found[path.stem.split(SEP, 1)[1]] = path
    return found


def datasets_in(run_dir: Path) -> list[str]:
    return sorted({path.stem.split(SEP, 1)[0] for path in run_dir.glob(f"*{SEP}*.jsonl")})


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a reader never sees half a file), safe for concurrent writers."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
