"""On-policy labels (the upstream teacher-forced on the local model's answers) and the router's
calibration read on them, with SmolLM2 as both models so the labels are known."""

from __future__ import annotations

import pytest

from fitting.analysis import TeacherForcer
from fitting.datasets import load_items
from fitting.records import analysis_path, append_record, records_path
from eval.studies.mixed.reliability import LABELS, calibration, first_positions, label, live_records, main, table
from policies.learned import Router
from tests.conftest import ROOT, SMOL


def greedy(forcer: TeacherForcer, item, length: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(length):
        tokens.append(forcer.analyze(item, tokens)["next"])
    return tokens


@pytest.mark.integration
def test_labels_mark_where_the_labelling_model_would_write_another_token(smol_path, tmp_path, capsys):
    items = load_items("csqa", rows="0:2")
    forcer = TeacherForcer.load(smol_path, n_ctx=1024, threads=1)
    try:
        answers = [greedy(forcer, item, 5) for item in items]
        answers[1][2] = answers[1][2] + 1  # the labeller's own greedy answer, but for one token
        for item, tokens in zip(items, answers):
            append_record(records_path(tmp_path / "run", "csqa", "local"), {"id": item.id, "row": item.row,
                                                                             "tokens": tokens})
            analysed = forcer.analyze(item, tokens)
            append_record(analysis_path(tmp_path / "run", "csqa", "local"), analysed)
            append_record(analysis_path(tmp_path / "run", "csqa"), analysed)  # as if the upstream had written it
    finally:
        forcer.close()

    label(["csqa,run,0:2"], SMOL, SMOL, n_ctx=1024, threads=1, runs_dir=tmp_path)

    records = live_records(["csqa,run,0:2"], tmp_path)["csqa"]
    assert [r["mismatch"][:3] for r in records] == ["000", "001"]
    assert records[0]["mismatch"] == "00000"  # its own greedy answer: nothing to label
    router = Router.load(ROOT / "routers" / "mixed-qwen2.5-coder-0.5b.json")  # its scores need no model
    result = calibration(router, records)
    assert result["positions"] == 10 and result["label_share"] == pytest.approx(
        sum(r["mismatch"].count("1") for r in records) / 10)
    assert 0.0 <= result["ece"] <= 1.0 and "| csqa | live | 10 |" in table({"live": {"csqa": result}})

    source = "csqa,run,0:2"
    assert main(["report", "--router", str(ROOT / "routers" / "mixed-qwen2.5-coder-0.5b.json"), "--held-out", source,
                 "--live", source, "--fit-live", source, "--runs-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("| csqa | the local model's own answers | 10 |") == 2  # the router and the one fitted here
    assert "| csqa | the local model's own answers, first position | 2 |" in printed


def test_labels_along_other_tokens_than_the_analysed_ones_are_refused(tmp_path):
    run = tmp_path / "run"
    item = load_items("csqa", rows="0:1")[0]
    step = {"entropy": [1.0, 0.5], "top1": [0.5, 0.8], "margin": [0.2, 0.6],
            "top": [[0.5, 0.3, 0.1, 0.1], [0.8, 0.1, 0.05, 0.05]], "kind": ["word", "punct"]}
    append_record(analysis_path(run, "csqa", "local"), {"id": item.id, "row": item.row, "n": 2, "mismatch": "00",
                                                        **step})
    append_record(analysis_path(run, "csqa", LABELS), {"id": item.id, "row": item.row, "n": 3, "mismatch": "010"})
    with pytest.raises(ValueError, match="other tokens"):
        live_records(["csqa,run,0:1"], tmp_path)


def test_first_positions_keep_each_answer_s_first_step_only():
    record = {"id": "a", "row": 0, "n": 2, "mismatch": "10", "entropy": [1.0, 0.5], "top1": [0.5, 0.8],
              "margin": [0.2, 0.6], "top": [[0.5, 0.3], [0.8, 0.1]], "kind": ["word", "punct"]}
    empty = {**record, "n": 0, "mismatch": "", **{key: [] for key in ("entropy", "top1", "margin", "top", "kind")}}
    assert first_positions([record, empty]) == [{"id": "a", "row": 0, "n": 1, "mismatch": "1", "entropy": [1.0],
                                                 "top1": [0.5], "margin": [0.2], "top": [[0.5, 0.3]],
                                                 "kind": ["word"]}]
