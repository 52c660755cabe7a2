"""Token-level router thresholds for a local model that has no router file (fitting/tune.py).

The entropy threshold that routes a given share of the local model's own answer steps, fitted on
the fit rows: their recorded local answers are teacher-forced once more (as `python -m eval
analyze --answers local` does, into the same file of the run, so a rerun reuses them) and the
threshold is the share's quantile of the steps' entropies (fitting/calibrate.py). A live decode
follows its own text wherever it routes, so the share it routes on new prompts is measured, not
assumed: `tune` decodes `entropy@T` on the choose and report rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapters.model_files import model_sha256, resolve_model
from fitting.analysis import TeacherForcer
from fitting.calibrate import threshold_for_share
from fitting.datasets import Item
from fitting.records import analysis_path, append_record, read_records


def analysed_local(run_dir: Path, dataset: str, items: list[Item], local: list[dict[str, Any]], local_ref: str,
                   threads: int, n_ctx: int = 2048) -> list[dict[str, Any]]:
    """The per-step signals of `items`' recorded local answers (`local`, with their tokens),
    analysed now where the run does not hold them yet."""
    out = analysis_path(run_dir, dataset, "local")
    answers = {r["id"]: r for r in local if r.get("tokens")}
    done = {r["id"] for r in read_records(out)}
    todo = [item for item in items if item.id in answers and item.id not in done]
    if todo:
        forcer = TeacherForcer.load(resolve_model(local_ref), n_ctx, threads)
        sha = model_sha256(local_ref)
        try:
            for item in todo:
                append_record(out, {**forcer.analyze(item, answers[item.id]["tokens"]), "model_sha256": sha})
        finally:
            forcer.close()
    wanted = {item.id for item in items}
    return [r for r in read_records(out) if r["id"] in wanted]


def entropy_thresholds(analysed: list[dict[str, Any]], shares: tuple[float, ...]) -> dict[float, float]:
    """Share of steps -> the entropy threshold (nats) that routes about that share of them."""
    if not any(r["n"] for r in analysed):
        raise ValueError("the fit rows' local answers have no steps to fit router thresholds on")
    return {share: threshold_for_share(analysed, "entropy", share) for share in shares}
