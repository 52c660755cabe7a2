"""Re-pricing evaluation records on price sheets (fitting/costs.py; unit, no model)."""

from __future__ import annotations

import pytest

from fitting.costs import SHEETS_BY_NAME, PriceSheet, answer_oracles, load_sheet, repriced_points, repriced_table

ROUTED = {"upstream_calls": 4, "upstream_prompt_tokens": 2000, "upstream_cached_tokens": 1500,
          "upstream_completion_tokens": 8, "upstream_compute_ms": 1800.0, "correct": True}
DIRECT = {"upstream_calls": 1, "upstream_prompt_tokens": 100, "upstream_cached_tokens": 0,
          "upstream_completion_tokens": 200, "upstream_compute_ms": 9000.0, "correct": True}
LOCAL = {"upstream_calls": 0, "upstream_prompt_tokens": 0, "upstream_cached_tokens": 0,
         "upstream_completion_tokens": 0, "correct": False}


def test_the_cache_applies_only_to_calls_past_the_providers_minimum():
    sheet = PriceSheet("s", input=1.0, cached_read=0.1, output=10.0, cache_min_prompt_tokens=1024)
    # 500-token calls: under the minimum, every prompt token at the full price
    assert sheet.usd(ROUTED) == pytest.approx((2000 * 1.0 + 8 * 10.0) / 1e6)
    short_minimum = PriceSheet("s", input=1.0, cached_read=0.1, output=10.0, cache_min_prompt_tokens=64)
    assert short_minimum.usd(ROUTED) == pytest.approx((500 * 1.0 + 1500 * 0.1 + 8 * 10.0) / 1e6)


def test_cache_writes_compute_time_and_a_shared_system_prompt():
    anthropic = PriceSheet("a", input=1.0, cached_read=0.1, output=5.0, cache_write=1.25)
    assert anthropic.usd(ROUTED) == pytest.approx((500 * 1.25 + 1500 * 0.1 + 8 * 5.0) / 1e6)
    assert SHEETS_BY_NAME["self-hosted"].usd(DIRECT) == pytest.approx(9.0 / 3600 * 2.0)
    sheet = PriceSheet("s", input=1.0, cached_read=0.1, output=10.0, cache_min_prompt_tokens=1024)
    # behind a 1,500-token system prompt every call passes the minimum and reads the prefix cached
    assert sheet.usd(DIRECT, shared_prefix=1500) == pytest.approx((100 * 1.0 + 1500 * 0.1 + 200 * 10.0) / 1e6)
    assert sheet.usd(LOCAL, shared_prefix=1500) == 0.0  # no call, nothing billed


def test_sheets_load_by_name_or_from_a_file_and_compare_with_the_baseline(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("input: 2.0\ncached_read: 0.2\noutput: 8.0\ncache_min_prompt_tokens: 0\n")
    mine = load_sheet(str(path))
    assert (mine.name, mine.input, mine.output) == ("mine", 2.0, 8.0)
    assert load_sheet("deepseek") is SHEETS_BY_NAME["deepseek"]
    with pytest.raises(ValueError):
        load_sheet("no-such-sheet")
    table = repriced_table({"routed": [ROUTED], "upstream": [DIRECT]}, [mine])
    routed_cost, direct_cost = mine.usd(ROUTED), mine.usd(DIRECT)
    assert f"({routed_cost / direct_cost:.2f}x)" in table and "(1.00x)" in table


def test_the_oracles_ask_for_wrong_local_answers_and_knowing_both_only_where_the_upstream_is_right():
    local = [{**LOCAL, "id": "q0", "correct": True}, {**LOCAL, "id": "q1"}, {**LOCAL, "id": "q2"},
             {**LOCAL, "id": "q3"}]
    upstream = [{**DIRECT, "id": "q0"}, {**DIRECT, "id": "q1", "correct": False}, {**DIRECT, "id": "q2"}]  # q3 not asked
    oracles = answer_oracles(local, upstream)
    assert oracles["perfect answer check"] == [local[0], upstream[1], upstream[2]]
    assert oracles["knowing both answers"] == [local[0], local[1], upstream[2]]


def test_the_plot_places_each_config_by_its_cost_against_the_baseline_and_local_as_a_level():
    sheet = PriceSheet("s", input=1.0, output=10.0)
    configs = {"upstream": [DIRECT, {**DIRECT, "correct": False}],  # 2,100 per call, one right answer of two
               "routed": [ROUTED, ROUTED],  # 500 fresh prompt tokens + 8 x 10 (cached reads free here), both right
               "local": [{**LOCAL, "correct": True}, LOCAL], "hopeless": [{**ROUTED, "correct": False}]}
    panels, levels = repriced_points(configs, [sheet])
    assert panels[0][0] == "s" and levels == {"local": 0.5}
    assert panels[0][1]["upstream"] == (1.0, 0.5)
    assert panels[0][1]["routed"] == pytest.approx((580 / 4200, 1.0))  # per correct answer: 580 against 4,200
    assert "hopeless" not in panels[0][1]
