"""`python -m gateway tune` (fitting/tune.py): prompts files, labels, the choice rule, the figures, and
the whole command on SmolLM2 locally with a real llama-server upstream; a tuned alias loads the
check `tune` wrote and refuses it for another local model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from adapters.model_files import model_sha256
from fitting.answers import score
from fitting.costs import PriceSheet
from fitting.datasets import Item, load_items
from fitting.prompts import PromptsError, convert, load_prompts
from fitting.records import analysis_path, read_records, records_path
from fitting.summary import wilson_ci
from fitting.tune import TuneOptions, resolve_splits, routing_for, tune, tune_items
from fitting.tune_fit import agreement_levels, candidates, choose, cost_ratio, figures, relabel
from gateway.__main__ import main as gateway_main
from gateway.config_checks import alias_files, check_routing
from gateway.settings import RoutingSettings, load_settings
from policies.learned import RouterError
from tests.conftest import QWEN, SMOL, gateway_config

SHEET = PriceSheet("test", input=1.0, cached_read=0.1, output=2.0)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _record(id_: str, correct: bool, text: str = "", calls: int = 0, **extra) -> dict:
    return {"id": id_, "row": 0, "text": text, "correct": correct, "upstream_calls": calls,
            "upstream_prompt_tokens": 10 * calls, "upstream_completion_tokens": 5 * calls, "upstream_cached_tokens": 0,
            "wall_s": 1.0, "answer_tokens": 5, "mean_entropy": 1.0, "max_entropy": 2.0, "mean_top1": 0.6,
            "first_entropy": 1.0, "finish_reason": "stop", **extra}



def test_tune_without_its_extra_fails_in_one_line_naming_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else find_spec(name, *a))
    assert gateway_main(["tune", "--alias", "routed", "--out", str(tmp_path / "out"), "--dataset", "csqa"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("error: python -m gateway tune needs tqdm, which is not installed: "
                     "pip install 'routing-gateway[fitting]'")
    assert not (tmp_path / "out").exists()


# -- prompts files --

def test_prompts_file_shapes(tmp_path):
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "reference": 4},
        {"id": "chat", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"prompt": "Pick one.\nA. x\nB. y", "reference": "B", "format": "letter"},
    ])
    items = load_prompts(path)
    assert [item.id for item in items] == ["0", "chat", "2"]
    assert items[0].messages == [{"role": "user", "content": "What is 2+2?"}]
    assert (items[0].gold, items[0].meta["format"]) == ("4", "number")  # read from the reference
    assert (items[1].gold, items[1].meta["format"]) == (None, "auto")
    assert [item.id for item in load_prompts(path, "1:3")] == ["chat", "2"]


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "a", "messages": []}, "either 'prompt'"),
    ({"reference": "1"}, "either 'prompt'"),
    ({"prompt": "a", "format": "essay"}, "format is one of"),
    ({"messages": [{"role": "user"}]}, "role and text content"),
])
def test_bad_prompt_lines_name_the_row(tmp_path, row, problem):
    with pytest.raises(PromptsError, match=problem):
        load_prompts(_write(tmp_path / "p.jsonl", [{"prompt": "fine"}, row]))


def test_repeated_ids_are_refused(tmp_path):
    with pytest.raises(PromptsError, match="ids repeat"):
        load_prompts(_write(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]))


@pytest.mark.parametrize("fmt, reference, text, correct", [
    ("number", "1000", "so 10 x 100 = 1,000.\nAnswer: 1,000", True),
    ("number", "1000", "Answer: 999", False),
    ("letter", "B", "B. apple, because it grows on trees", True),
    ("letter", "B", "The answer is (C).", False),
    ("text", "the sea is blue", "The sea is blue!", True),
])
def test_answers_scored_against_the_reference(fmt, reference, text, correct):
    item = Item("q", [{"role": "user", "content": "?"}], reference, {"format": fmt})
    assert score("prompts", item, text).correct is correct


def test_without_a_reference_nothing_is_scored_right():
    item = Item("q", [{"role": "user", "content": "?"}], None, {"format": "auto"})
    scored = score("prompts", item, "Answer: 4")
    assert (scored.correct, scored.rule, scored.pred) == (False, "no_reference", "4")


def test_convert_keeps_eval_prompts_and_gold(tmp_path):
    lines = convert("csqa", rows="0:3")
    originals = load_items("csqa", rows="0:3")
    assert [line["messages"] for line in lines] == [item.messages for item in originals]
    items = load_prompts(_write(tmp_path / "p.jsonl", lines))
    assert all(score("prompts", item, f"{original.gold}. because").correct for item, original in zip(items, originals))
    assert lines[0]["id"].startswith("csqa/")
    with pytest.raises(PromptsError):
        convert("ifeval")


# -- labels, candidates, the choice --

def test_answers_without_reference_are_labelled_by_agreement():
    items = {"a": Item("a", [], None, {"format": "number"}), "b": Item("b", [], None, {"format": "auto"}),
             "c": Item("c", [], "7", {"format": "number"})}
    upstream = [_record("a", True, "Answer: 12"), _record("b", True, "Answer: 3"), _record("c", False, "Answer: 7")]
    local = [_record("a", False, "so 12"), _record("b", False, "Answer: 4"), _record("c", True, "Answer: 7"),
             _record("d", True, "no upstream answer")]
    labelled = {r["id"]: r["correct"] for r in relabel(local, upstream, items)}
    assert labelled == {"a": True, "b": False, "c": True}  # c keeps its reference score; d has no upstream answer


def test_agreement_candidates_escalate_below_each_level():
    assert agreement_levels(4) == [0.1667, 0.5, 0.8333]
    local = [_record("x", False), _record("y", True)]
    agree = [_record("x", False, agreement=1 / 3), _record("y", True, agreement=1.0)]
    upstream = [_record("x", True, calls=1), _record("y", True, calls=1)]
    found = candidates(local, upstream, None, agree, 4)
    assert sorted(found) == ["local", "local,agree=4,afresh=0.1667", "local,agree=4,afresh=0.5",
                             "local,agree=4,afresh=0.8333"]
    asked = {name: [bool(r["afresh"]) for r in records] for name, records in found.items() if name != "local"}
    assert asked == {"local,agree=4,afresh=0.1667": [False, False], "local,agree=4,afresh=0.5": [True, False],
                     "local,agree=4,afresh=0.8333": [True, False]}


def _candidate(n_right: int, n_asked: int, n: int = 10) -> list[dict]:
    return [_record(str(i), i < n_right, calls=1 if i < n_asked else 0) for i in range(n)]


def test_the_rule_takes_the_most_accurate_within_the_cost_ratio():
    upstream = _candidate(8, 10)  # 10 calls for 8 correct
    found = {"local": _candidate(3, 0), "cheap": _candidate(5, 2), "good": _candidate(7, 5),
             "same-but-dearer": _candidate(7, 6), "dear": _candidate(8, 9)}
    assert cost_ratio(found["good"], upstream, SHEET) == pytest.approx((5 / 7) / (10 / 8))
    assert choose(found, upstream, SHEET, 0.7).name == "good"  # 0.57x; dear is 0.9x
    assert choose(found, upstream, SHEET, 1.0).name == "dear"
    assert choose(found, upstream, SHEET, 0.8).name == "good"  # same-but-dearer ties on accuracy and costs more
    assert choose({"expensive": _candidate(8, 10)}, upstream, SHEET, 0.5).name == "local"


def test_figures_pair_against_local():
    local = [_record(str(i), i < 2) for i in range(10)]
    upstream = [_record(str(i), i < 8, calls=1) for i in range(10)]
    routed = [_record(str(i), i < 6, calls=1 if 1 < i < 7 else 0, afresh=1 < i < 7) for i in range(10)]
    f = figures(routed, local, upstream, SHEET)
    assert (f["n"], f["accuracy"], f["gained"], f["lost"], f["afresh"]) == (10, 0.6, 4, 0, 0.5)
    assert f["mcnemar_p"] == pytest.approx(0.125)
    assert f["cost_ratio"] == pytest.approx((5 / 6) / (10 / 8))
    low, high = f["cost_ratio95"]
    assert low <= f["cost_ratio"] <= high
    assert f["wilson95"] == pytest.approx(wilson_ci(6, 10))


def test_wilson_interval():
    assert wilson_ci(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_ci(0, 10)[0] == 0.0 and wilson_ci(10, 10)[1] == 1.0
    assert all(math.isnan(v) for v in wilson_ci(0, 0))


def test_eval_datasets_are_read_directly(tmp_path):
    dataset, items = tune_items(TuneOptions(Path("c.yaml"), "a", tmp_path, dataset="csqa"))
    assert dataset == "csqa" and len(items) == 300 and items[0].gold == "A"
    with pytest.raises(ValueError, match="--prompts"):
        tune_items(TuneOptions(Path("c.yaml"), "a", tmp_path))


def test_default_splits_and_bad_ones(tmp_path):
    options = TuneOptions(Path("c.yaml"), "a", tmp_path)
    assert resolve_splits(options, 10) == {"fit": "0:4", "choose": "4:6", "report": "6:10"}
    with pytest.raises(ValueError, match="all of"):
        resolve_splits(TuneOptions(Path("c.yaml"), "a", tmp_path, fit_rows="0:5"), 10)


def test_routing_for_each_candidate_is_valid_alias_routing(tmp_path):
    options = TuneOptions(Path("c.yaml"), "a", tmp_path / "out")
    assert routing_for("local", options, True) == {"policy": "never"}
    fitted = routing_for("local,afresh=0.42", options, True)
    assert fitted == {"policy": "never", "answer_check": str(tmp_path / "out" / "answer-check.json"),
                      "escalate_below": 0.42}
    agree = routing_for("local,agree=4,afresh=0.5", options, False)
    assert agree["answer_check"] == {"kind": "agreement", "samples": 4}
    assert routing_for("entropy@1.5", options, False) == {"policy": "entropy", "threshold": 1.5}
    for routing in (fitted, agree):
        RoutingSettings(**routing)  # the config accepts what the snippet says


# -- the whole command, on real models --

QUESTIONS = [("Which is a colour?\nA. red\nB. seven\nAnswer with the letter.", "A"),
             ("Which is a number?\nA. blue\nB. seven\nAnswer with the letter.", "B"),
             ("Which is an animal?\nA. dog\nB. rock\nAnswer with the letter.", "A"),
             ("Which is a fruit?\nA. stone\nB. apple\nAnswer with the letter.", "B"),
             ("Which can fly?\nA. bird\nB. brick\nAnswer with the letter.", "A"),
             ("Which is cold?\nA. fire\nB. ice\nAnswer with the letter.", "B"),
             ("Which is a day?\nA. Monday\nB. June\nAnswer with the letter.", "A"),
             ("Which is a month?\nA. Friday\nB. June\nAnswer with the letter.", "B")]


def _tuned_setup(tmp_path: Path, upstream_base: str) -> tuple[Path, Path]:
    config = gateway_config(upstream_base, mode="tokens")
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # both references of the first two fit rows: one the model gets right and one it cannot, so a
    # check can be fitted whatever SmolLM2 answers
    rows = [{"prompt": q, "reference": ref, "format": "letter"} for q, ref in QUESTIONS]
    rows[0]["reference"], rows[1]["reference"] = "A", "Z"
    return config_path, _write(tmp_path / "prompts.jsonl", rows)


@pytest.mark.integration
def test_tune_end_to_end_and_the_tuned_alias(tmp_path, smol_llama_server, capsys):
    config_path, prompts = _tuned_setup(tmp_path, smol_llama_server)
    out = tmp_path / "tuned"
    options = TuneOptions(config_path, "routed", out, prompts, fit_rows="0:4", choose_rows="4:6", report_rows="6:8",
                          agree=2, max_tokens=6, progress=False)
    result = tune(options)
    assert "8 prompts x 3 configs, 24 answers to decode" in capsys.readouterr().out
    for name in ("prompts__local.jsonl", "prompts__upstream.jsonl", "prompts__local,agree=2.jsonl"):
        assert len((out / name).read_text().splitlines()) == 8
    assert result.check is not None and result.check.model_sha256 == model_sha256(SMOL)
    assert json.loads((out / "answer-check.json").read_text())["model_sha256"] == model_sha256(SMOL)
    saved = json.loads((out / "tune.json").read_text())
    assert saved["choice"]["name"] == result.choice.name and saved["splits"]["report"] == "6:8"
    assert set(saved["report"]) >= {"local", "upstream", result.choice.name}
    assert all(f["n"] == 2 for f in saved["report"].values())
    report = (out / "tune-report.md").read_text()
    assert "## On the report rows" in report and "right or wrong against each prompt's reference" in report
    snippet = yaml.safe_load((out / "alias.yaml").read_text())
    assert snippet["aliases"]["routed"]["routing"] == result.routing

    # resumable: the same command through the command line decodes nothing again and chooses the same
    code = gateway_main(["tune", "--config", str(config_path), "--alias", "routed", "--prompts", str(prompts),
                         "--out", str(out), "--fit-rows", "0:4", "--choose-rows", "4:6", "--report-rows", "6:8",
                         "--agree", "2", "--max-tokens", "6"])
    assert code == 0 and "0 answers to decode" in capsys.readouterr().out
    assert json.loads((out / "tune.json").read_text())["choice"] == saved["choice"]

    # a tuned alias: the check tune wrote loads for this local model, and is refused for another
    raw = yaml.safe_load(config_path.read_text())
    raw["aliases"]["routed"]["routing"] = routing_for("local,afresh=0.5", options, True)
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text(yaml.safe_dump(raw))
    settings = load_settings(tuned)
    _, check = alias_files(settings)["routed"]
    assert check is not None and check.weights.tolist() == result.check.weights.tolist()
    assert check_routing(settings, {name: None for name in settings.aliases}) == []
    raw["models"]["local"]["smol"]["gguf"] = QWEN
    tuned.write_text(yaml.safe_dump(raw))
    with pytest.raises(RouterError, match="was trained for the local model with sha256"):
        alias_files(load_settings(tuned))


@pytest.mark.integration
def test_tune_without_references_and_with_router_thresholds(tmp_path, smol_llama_server):
    config_path, _ = _tuned_setup(tmp_path, smol_llama_server)
    prompts = _write(tmp_path / "bare.jsonl", [{"prompt": q} for q, _ in QUESTIONS[:5]])
    out = tmp_path / "bare"
    result = tune(TuneOptions(config_path, "routed", out, prompts, agree=0, handoff_shares=(0.3,), max_tokens=4,
                              progress=False))
    assert result.labels == "agreement"
    assert result.report["upstream"]["accuracy"] == 1.0  # agreement with itself
    assert "agreement with upstream-only" in (out / "tune-report.md").read_text()
    # the threshold routes 30% of the fit answers' steps (rows 0:2), teacher-forced into the run's analysis
    analysed = read_records(analysis_path(out, "prompts", "local"))
    assert sorted(r["row"] for r in analysed) == [0, 1]
    entropies = [e for r in analysed for e in r["entropy"]]
    threshold = result.thresholds[0.3]
    assert 0 < sum(e > threshold for e in entropies) <= math.ceil(0.3 * len(entropies))
    routed = read_records(records_path(out, "prompts", f"entropy@{threshold:g}"))
    assert sorted(r["row"] for r in routed) == [2, 3, 4]  # the choose and report rows only
    assert f"entropy@{threshold:g}" in result.report
