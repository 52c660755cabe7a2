"""One router for mixed traffic (eval/studies/mixed/mixed_router.py): fitted on several tasks, rated per task, with
on-policy thresholds shared by all traffic or fitted per task, or taken from traffic."""

from __future__ import annotations

import json

import pytest

from eval.studies.mixed.mixed_router import main
from policies.learned import Router
from tests.fakes import synthetic


def _write(path, records, first_row=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({**r, "id": f"q-{first_row + i}", "row": first_row + i}) + "\n"
                            for i, r in enumerate(records)))


def _hotter(records, by: float):
    """The same answers with every entropy raised: text on which the router scores higher."""
    return [{**r, "entropy": [e + by for e in r["entropy"]]} for r in records]


@pytest.fixture
def runs(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "a" / "analysis" / "csqa.jsonl", synthetic(80, 1))
    _write(runs / "b" / "analysis" / "gsm8k.jsonl", synthetic(80, 2))
    _write(runs / "a" / "analysis" / "csqa.local.jsonl", synthetic(80, 3))
    _write(runs / "b" / "analysis" / "gsm8k.local.jsonl", _hotter(synthetic(80, 4), 2.0))  # its local text differs
    return runs


def test_the_mixed_router_is_rated_per_task_and_its_live_shares_checked(runs, tmp_path):
    out, report_path = tmp_path / "mixed.json", tmp_path / "report.json"
    assert main(["--fit", "csqa,a,0:40", "--fit", "gsm8k,b,0:40", "--held-out", "csqa,a,40:80",
                 "--held-out", "gsm8k,b,40:80", "--live-fit", "csqa,a,0:40", "--live-fit", "gsm8k,b,0:40",
                 "--live", "csqa,a,40:80", "--live", "gsm8k,b,40:80", "--share", "0.2",
                 "--runs-dir", str(runs), "--out", str(out), "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["fit"] == {"csqa": {"answers": 40, "positions": 480}, "gsm8k": {"answers": 40, "positions": 480}}
    for task in ("csqa", "gsm8k"):
        held = report["held_out"][task]
        assert held["answers"] == 40 and held["auroc"]["mixed"] > held["auroc"]["1-top1"] + 0.05
        assert held["auroc"]["own task"] > 0.8
    live = report["live"]
    one = {task: live[task]["share (one threshold)"]["0.2"] for task in live}
    assert one["gsm8k"] > 0.25 > 0.15 > one["csqa"]  # one threshold: the hotter task routes more
    assert (one["gsm8k"] + one["csqa"]) / 2 == pytest.approx(0.2, abs=0.05)  # the pool routes its target
    for task in live:  # each task's own on-policy thresholds hold on its other answers
        assert live[task]["share (the task's own thresholds)"]["0.2"] == pytest.approx(0.2, abs=0.05)
    for task in live:  # a threshold taken from the task's own traffic holds without refitting
        assert live[task]["share (from the task's traffic)"]["0.2"] == pytest.approx(0.2, abs=0.05)
    # from the mixed traffic through one window: the mix routes its target, the hotter task more of it
    mixed = {task: live[task]["share (from mixed traffic)"]["0.2"] for task in live}
    assert mixed["gsm8k"] > mixed["csqa"] and (mixed["gsm8k"] + mixed["csqa"]) / 2 == pytest.approx(0.2, abs=0.03)
    router = Router.load(out)
    assert router.meta["thresholds"]["fitted_on"] == {"csqa": 40, "gsm8k": 40}
    assert router.meta["fitted_on"] == {"csqa": 40, "gsm8k": 40}


def test_a_source_without_analysed_answers_is_named(runs, tmp_path):
    with pytest.raises(ValueError, match="gsm8k,a: no analysed upstream answers"):
        main(["--fit", "gsm8k,a", "--held-out", "csqa,a", "--runs-dir", str(runs), "--report", str(tmp_path / "r.json")])
    with pytest.raises(ValueError, match="DATASET,RUN or DATASET,RUN,ROWS"):
        main(["--fit", "csqa", "--held-out", "csqa,a", "--runs-dir", str(runs), "--report", str(tmp_path / "r.json")])
