"""The evaluation harness end to end on SmolLM2 (local and upstream), so it cannot rot.

A handful of CommonsenseQA rows through the real decoder and a real upstream server process;
then the FS-GEN analysis, calibration, the report table and plot. The first tests are pure
(answer extraction, statistics) and need no model.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json

import numpy as np
import pytest

from adapters.local_model import LocalModel
from eval.__main__ import _parser
from fitting.analysis import TeacherForcer, auroc, steps, summarize_analysis
from fitting.answers import extract_choice, extract_number, score
from fitting.calibrate import calibrate, evaluate_threshold, threshold_for_share
from fitting.configs import ordered, parse_config
from fitting.datasets import load_items
from fitting.records import (
    append_record,
    borrow,
    borrowed,
    configs_in,
    datasets_in,
    merge_records,
    read_records,
    records_path,
    write_records,
)
from eval.report import build_rows, load, markdown_table, paired_table, plot
from fitting.runner import RunPlan, evaluate, run
from fitting.session import ModelOptions, Models, open_models, upstream_settings
from fitting.summary import bootstrap_ci, mcnemar_p
from gateway.runtime import make_upstream

CHOICES = {"A": "bank", "B": "library", "C": "department store", "D": "mall", "E": "new york"}


@pytest.mark.parametrize("text, letter", [
    ("B. library", "B"), ("(C) department store", "C"), ("**D**", "D"), ("Answer: E", "E"),
    ("I think the answer is (A).", "A"), ("A. library", None), ("A bank keeps money safe.", "A"),
    ("Nothing fits.", None),
])
def test_csqa_extraction(text, letter):
    assert extract_choice(text, CHOICES)[0] == letter


@pytest.mark.parametrize("text, number", [
    ("3 + 4 = 7\nAnswer: 7", 7.0), ("The answer is $1,234.50.", 1234.5), ("#### 72", 72.0),
    ("so she pays 5 and then 12", 12.0), ("no idea", None),
])
def test_gsm8k_extraction(text, number):
    assert extract_number(text)[0] == number


def test_statistics():
    assert auroc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert auroc([1, 1, 1, 1], [False, True, False, True]) == 0.5
    low, high = bootstrap_ci([1.0] * 30 + [0.0] * 70)
    assert low < 0.3 < high and 0.0 <= low and high <= 1.0


def test_config_names():
    assert parse_config("entropy@1.5").policy == "entropy"
    assert [s.name for s in ordered([parse_config("oracle"), parse_config("local")])] == ["upstream", "oracle", "local"]
    with pytest.raises(ValueError):
        parse_config("entropy")
    priced = parse_config("learned@0.05,value=0.5,ceiling=1,on=escalate")
    assert (priced.answer_value, priced.max_cost_ratio, priced.on_ceiling) == (0.5, 1.0, "escalate")
    assert priced.escalation == "continue"
    assert parse_config("learned@0.05,value=1,escalation=afresh").escalation == "afresh"
    assert parse_config("learned@0.05,value=1,escalation=draft").escalation == "draft"
    for bad in ("top1@0.5,on=panic", "top1@0.5,escalation=restart", "top1@0.5,escalation=draft"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_merging_records_replaces_those_ids_and_keeps_the_others(tmp_path):
    path = tmp_path / "gsm8k__local.jsonl"
    write_records(path, [{"id": "a", "correct": False}, {"id": "b", "correct": False}])
    merge_records(path, [{"id": "b", "correct": True}, {"id": "c", "correct": True}])
    assert read_records(path) == [{"id": "a", "correct": False}, {"id": "b", "correct": True}, {"id": "c", "correct": True}]


def test_a_run_borrows_another_runs_records_pinned_to_the_bytes_it_had(tmp_path):
    source, run = tmp_path / "old", tmp_path / "new"
    for i in range(3):
        append_record(records_path(source, "gsm8k", "local"), {"id": f"q{i}", "correct": i == 1})
    append_record(records_path(source, "gsm8k", "upstream"), {"id": "q0", "correct": True})
    before = records_path(source, "gsm8k", "local").read_bytes()

    assert borrow(run, source, ["gsm8k__local.jsonl"]) == ["gsm8k__local.jsonl"]
    assert borrow(run, source, ["gsm8k__local.jsonl"]) == []  # as `cp -n`: what the run has stays
    assert not records_path(run, "gsm8k", "local").exists()
    assert borrowed(run) == {"gsm8k__local.jsonl": {"run": "old", "bytes": len(before),
                                                    "sha256": hashlib.sha256(before).hexdigest()}}
    assert read_records(records_path(run, "gsm8k", "local")) == read_records(records_path(source, "gsm8k", "local"))
    assert list(configs_in(run, "gsm8k")) == ["local"] and datasets_in(run) == ["gsm8k"]

    append_record(records_path(source, "gsm8k", "local"), {"id": "q3", "correct": True})  # the source grows
    assert [r["id"] for r in read_records(records_path(run, "gsm8k", "local"))] == ["q0", "q1", "q2"]
    third = tmp_path / "third"  # borrowing a borrowed file names the run that holds it
    borrow(third, run, ["gsm8k__local.jsonl"])
    assert borrowed(third)["gsm8k__local.jsonl"]["run"] == "old"

    append_record(records_path(run, "gsm8k", "local"), {"id": "q9", "correct": False})  # writing makes it a copy
    assert records_path(run, "gsm8k", "local").read_bytes().startswith(before)
    assert borrowed(run) == {} and [r["id"] for r in read_records(records_path(run, "gsm8k", "local"))][-1] == "q9"

    records_path(source, "gsm8k", "local").write_text("")  # the holder rewrote what it lent
    with pytest.raises(ValueError, match="have changed"):
        read_records(records_path(third, "gsm8k", "local"))


def test_mcnemar_p_is_the_exact_two_sided_binomial_tail():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(6, 1) == pytest.approx(2 * 8 / 128)  # P(X <= 1), X ~ Bin(7, 1/2), doubled
    assert mcnemar_p(1, 6) == mcnemar_p(6, 1)
    assert mcnemar_p(3, 3) == 1.0
    assert mcnemar_p(10, 0) == pytest.approx(2 / 1024)


def test_paired_table_counts_against_local_and_upstream():
    def record(id_, correct, pred, finish="stop"):
        return {"id": id_, "correct": correct, "pred": pred, "finish_reason": finish}

    configs = {
        "local": (parse_config("local"), [record("a", False, 1), record("b", True, 2), record("c", False, 3)]),
        "upstream": (parse_config("upstream"), [record("a", True, 7), record("b", True, 2), record("c", False, 9)]),
        "top1@0.5": (parse_config("top1@0.5"), [record("a", True, 7), record("b", False, 5, "length"),
                                                record("c", False, None)]),
    }
    lines = paired_table(configs).splitlines()
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert cells["top1@0.5"][:3] + cells["top1@0.5"][5:] == ["3", "1", "1", "1", "1 |"]
    assert cells["local"][:4] == ["3", "0", "0", "+0.0% [+0.0%, +0.0%]"] and cells["local"][4] == "1"
    assert cells["upstream"][:3] + cells["upstream"][5:] == ["3", "1", "0", "3", "0 |"]
    assert cells["upstream"][3].startswith("+33.3% [")
    assert paired_table({"local": configs["local"]}) == ""
    against_router = paired_table(configs, base="top1@0.5").splitlines()
    assert "right where top1@0.5 is wrong" in against_router[0]
    assert against_router[2].split(" | ")[1:3] == ["3", "1"]  # local: right on b, where the router is wrong


def test_report_pairs_against_local_unless_told():
    args = ["report", "--dataset", "gsm8k", "--run-name", "r"]
    assert _parser().parse_args(args).paired is None
    assert _parser().parse_args([*args, "--paired"]).paired == "local"
    assert _parser().parse_args([*args, "--paired", "local,agree=4"]).paired == "local,agree=4"


@pytest.fixture
async def smol_models(smol_path, smol_llama_server):
    local = await LocalModel.load(smol_path, n_ctx=2048, n_threads=1, n_batch=256, queue_limit=4)
    options = ModelOptions(str(smol_path), str(smol_path), timeout_s=30.0)
    upstream = make_upstream("eval-upstream", upstream_settings(options, smol_llama_server, str(smol_path)))
    yield Models(local, upstream, None, smol_path)
    local.close()


@pytest.mark.integration
async def test_harness_end_to_end(smol_models, smol_path, tmp_path):
    items = load_items("csqa", rows="0:4")
    configs = ordered([parse_config(c) for c in ("local", "upstream", "entropy@1.0", "oracle")])
    plan = RunPlan("csqa", items, configs, tmp_path, max_tokens=16, block=2)
    decoded: list[str] = []
    summary = (await run(plan, smol_models, decoded.append))["csqa"]

    assert len(decoded) == len(items) * len(configs)
    by_id = {item.id: item for item in items}
    for spec in configs:
        lines = records_path(tmp_path, "csqa", spec.name).read_text().splitlines()
        assert sorted(json.loads(line)["id"] for line in lines) == sorted(item.id for item in items)
        records = [json.loads(line) for line in lines]
        right = sum(score("csqa", by_id[r["id"]], r["text"]).correct for r in records)  # as the text scores
        assert summary[spec.name]["n"] == len(items) and summary[spec.name]["accuracy"] == right / len(items)
    assert summary["local"]["upstream_share"] == 0.0 and summary["local"]["upstream_calls"] == 0
    assert summary["upstream"]["upstream_share"] == 1.0
    assert summary["upstream"]["upstream_calls_per_item"] == 1.0  # the large model asked once per answer
    assert summary["upstream"]["billed_prompt_tokens"] > 0
    for record in read_records(records_path(tmp_path, "csqa", "oracle")):
        assert record["oracle"]["gave_up_at"] is None
        if record["oracle"]["reanchors"] == 0:  # routed exactly where the local token was wrong
            assert record["sources"].count("U") <= record["oracle"]["mismatches"]

    # resuming does not redo items: only the new config decodes
    capped = "top1@0.5,ceiling=1"
    resumed = RunPlan("csqa", items, [*configs, parse_config(capped)], tmp_path, max_tokens=16, block=2)
    decoded.clear()
    await run(resumed, smol_models, decoded.append)
    assert decoded == [capped] * len(items)
    assert len(records_path(tmp_path, "csqa", "local").read_text().splitlines()) == len(items)
    ratios = [r["cost_ratio"] for r in read_records(records_path(tmp_path, "csqa", capped)) if r["upstream_calls"]]
    assert ratios and all(0 < ratio <= 1.0 for ratio in ratios)  # the ceiling holds on every answer

    # FS-GEN analysis and calibration on the upstream's answers
    forcer = TeacherForcer.load(smol_path, n_ctx=1024, threads=1)
    references = {r["id"]: r for r in read_records(records_path(tmp_path, "csqa", "upstream"))}
    analysed = [forcer.analyze(item, references[item.id]["tokens"]) for item in items]
    forcer.close()
    fs_gen = summarize_analysis(analysed)
    assert fs_gen["tokens"] == sum(len(r["tokens"]) for r in references.values())
    mismatches = sum(r["mismatch"].count("1") for r in analysed)  # positions where the local token differs
    assert fs_gen["cof_lower"] == mismatches / fs_gen["tokens"]
    threshold = threshold_for_share(analysed[:2], "entropy", 0.5)
    fit_entropy = np.array([step["entropy"] for step in steps(analysed[:2])])
    held_entropy = np.array([step["entropy"] for step in steps(analysed[2:])])
    fit_share = evaluate_threshold(analysed[:2], "entropy", threshold)["upstream_share"]
    assert fit_share == pytest.approx(0.5, abs=2 / len(fit_entropy))  # the median, to a position
    assert evaluate_threshold(analysed[2:], "entropy", threshold)["upstream_share"] == \
        pytest.approx(float(np.mean(held_entropy > threshold)))  # held out: the positions above it
    assert len(calibrate(analysed[:2], analysed[2:], ["entropy", "top1"], shares=[0.5], accuracies=[0.9])) == 4

    # the report: a table row per config (plus query-level points) and a plot
    rows, points = build_rows(load(tmp_path, "csqa", slice(None), items=items))
    table = markdown_table(rows)
    assert all(f"| {spec.name} |" in table for spec in configs) and "query-level" in table
    assert len(points) == len(items) + 1
    plot(rows, points, tmp_path / "plot.png", "smoke")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.integration
async def test_a_shared_system_prompt_is_all_an_answer_finds_cached(smol_path, tmp_path):
    """`eval run --system`: every answer's upstream call reads the system prompt from the cache,
    and nothing an earlier answer left there (the same question asked twice pays for it twice)."""
    models = await open_models(ModelOptions(str(smol_path), str(smol_path), timeout_s=60.0), with_upstream=True)
    try:
        system = {"role": "system", "content": "You are a careful assistant. Answer with one letter. " * 20}
        [item] = [dataclasses.replace(i, messages=[system, *i.messages]) for i in load_items("csqa", rows="0:1")]
        plan = RunPlan("csqa", [item], [parse_config("upstream")], tmp_path, 4)
        cold = await evaluate(models, plan, plan.configs[0], item, None)
        assert cold["upstream_cached_tokens"] == 0  # without it, every answer starts cold
        shared = await models.share_prefix(system)
        assert shared > 200
        for _ in range(2):
            record = await evaluate(models, plan, plan.configs[0], item, None)
            assert record["upstream_cached_tokens"] == shared and record["upstream_prompt_tokens"] > shared
    finally:
        models.close()

# -- packed (gzipped) run records, as results/runs keeps them --

def test_a_gzipped_run_reads_lends_and_resumes_as_a_plain_one(tmp_path):
    source, run = tmp_path / "old", tmp_path / "new"
    path = records_path(source, "gsm8k", "local")
    for i in range(3):
        append_record(path, {"id": f"q{i}", "correct": i == 1})
    plain, before = read_records(path), path.read_bytes()
    packed = path.with_name(path.name + ".gz")
    packed.write_bytes(gzip.compress(before, mtime=0))
    path.unlink()  # as `gzip -n` leaves it

    assert read_records(path) == plain
    assert list(configs_in(source, "gsm8k")) == ["local"] and datasets_in(source) == ["gsm8k"]
    assert configs_in(source, "gsm8k")["local"] == path  # the .jsonl path, as for a plain file

    assert borrow(run, source, ["gsm8k__local.jsonl"]) == ["gsm8k__local.jsonl"]
    assert borrowed(run)["gsm8k__local.jsonl"] == {"run": "old", "bytes": len(before),
                                                    "sha256": hashlib.sha256(before).hexdigest()}
    assert read_records(records_path(run, "gsm8k", "local")) == plain
    assert borrow(source, run, ["gsm8k__local.jsonl"]) == []  # the packed file is the run's own

    append_record(path, {"id": "q3", "correct": True})  # resuming unpacks it, then appends
    assert path.read_bytes().startswith(before) and not packed.exists()
    assert [r["id"] for r in read_records(path)] == ["q0", "q1", "q2", "q3"]
    assert [r["id"] for r in read_records(records_path(run, "gsm8k", "local"))] == ["q0", "q1", "q2"]  # pinned


def test_rewriting_a_gzipped_file_replaces_it(tmp_path):
    path = records_path(tmp_path, "csqa", "upstream")
    write_records(path, [{"id": "a", "correct": False}])
    path.with_name(path.name + ".gz").write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    merge_records(path, [{"id": "b", "correct": True}])
    assert read_records(path) == [{"id": "a", "correct": False}, {"id": "b", "correct": True}]
    assert not path.with_name(path.name + ".gz").exists()
