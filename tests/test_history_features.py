"""The history-feature ablation (eval/studies/history/history_features.py): what each position knows of the steps before."""

from __future__ import annotations

import math

import numpy as np

from eval.studies.history.history_features import SETS, ablation, history
from tests.fakes import synthetic


def test_history_reads_the_previous_step_and_the_steps_since_the_last_mismatch():
    record = {"n": 4, "mismatch": "0101", "entropy": [0.5, 1.5, 2.5, 3.5], "top1": [0.9, 0.6, 0.4, 0.3],
              "margin": [0.8, 0.3, 0.1, 0.05]}
    rows = history([record])
    assert rows.tolist() == [
        [0.0, 1.0, 1.0, 0.0, math.log1p(0)],  # nothing before the first step
        [0.5, 0.9, 0.8, 0.0, math.log1p(1)],
        [1.5, 0.6, 0.3, 1.0, math.log1p(0)],  # the step before was a mismatch (routed)
        [2.5, 0.4, 0.1, 0.0, math.log1p(1)],
    ]


def test_a_feature_that_carries_the_label_shows_as_a_gain():
    """Mismatches that follow a mismatch: the routing-history set must find them, the others cannot."""
    def chained(records):
        for record in records:  # a mismatch after the first step makes the next one a mismatch too
            marks = record["mismatch"]
            record["mismatch"] = "".join("1" if m == "1" or (i >= 2 and marks[i - 1] == "1") else "0"
                                         for i, m in enumerate(marks))
        return records

    report = ablation(chained(synthetic(150, 0)), chained(synthetic(100, 1)))
    gains = report["gain over the twelve"]
    assert gains[SETS[2]]["low"] > 0.02 and report["auroc"][SETS[2]] > report["auroc"][SETS[0]]
    assert np.isfinite(report["auroc"][SETS[1]])
