"""MBPP as an evaluation dataset: the committed data, the loader's prompts and the execution scorer.

Pure tests: no model. The scorer runs real Python subprocesses, so the dataset's own reference
solutions must pass, wrong or non-terminating ones must fail.
"""

from __future__ import annotations

import json
import time

import pytest

from eval.__main__ import _parser
from fitting.answers import SCORERS, mbpp_program, score, score_mbpp
from fitting.datasets import DATA_DIR, DEFAULT_FILES, MAX_TOKENS, load_items

MBPP_FILE = DATA_DIR / DEFAULT_FILES["mbpp"]


def _rows() -> dict[int, dict]:
    with MBPP_FILE.open(encoding="utf-8") as handle:
        return {row["task_id"]: row for row in map(json.loads, handle)}


def _item(task_id: int):
    return next(item for item in load_items("mbpp") if item.id == f"Mbpp/{task_id}")


def _fenced(code: str) -> str:
    return f"Here is the function:\n```python\n{code}\n```\nIt passes the tests."


def test_the_committed_file_is_the_whole_sanitized_set():
    rows = _rows()
    assert len(rows) == 427  # task ids are unique
    assert min(rows) == 2 and max(rows) == 809
    fields = {"source_file", "task_id", "prompt", "code", "test_imports", "test_list"}
    assert all(set(row) == fields and row["test_list"] for row in rows.values())


def test_loader_gives_one_item_per_problem_with_its_asserts_in_the_prompt():
    items = load_items("mbpp")
    rows = list(_rows().values())
    assert len(items) == 427
    assert [item.id for item in items] == [f"Mbpp/{row['task_id']}" for row in rows]
    assert [item.row for item in items] == list(range(427))
    for item, row in zip(items, rows):
        [message] = item.messages
        assert message["role"] == "user"
        prompt = message["content"]
        assert prompt.startswith(row["prompt"] + "\nYour code should pass these tests:\n\n")
        assert all(test in prompt for test in row["test_list"])
        assert "```python" in prompt and row["code"] not in prompt  # never the reference solution
        assert item.meta["tests"] == row["test_list"] and item.gold is None
    assert MAX_TOKENS["mbpp"] == 384
    assert [item.id for item in load_items("mbpp", rows="0:3")] == ["Mbpp/2", "Mbpp/3", "Mbpp/4"]


def test_test_imports_become_setup_code():
    assert _item(82).meta["setup"] == "import math"  # its asserts call math.isclose
    assert _item(2).meta["setup"] == ""
    # a correct answer that imports nothing passes only because the setup imports math for the asserts
    no_import = "def volume_sphere(r):\n    return 4 / 3 * 3.141592653589793 * r ** 3"
    assert score_mbpp(_item(82), _fenced(no_import)).correct


@pytest.mark.parametrize("task_id", [2, 3, 4, 82, 596, 809])
def test_reference_solutions_pass(task_id):
    item = _item(task_id)
    result = score("mbpp", item, _fenced(_rows()[task_id]["code"]))
    assert result.correct and result.pred == "pass" and result.rule == "code_block"


def test_an_answer_without_a_code_block_runs_as_is():
    result = score_mbpp(_item(3), _rows()[3]["code"])
    assert result.correct and result.rule == "raw"


@pytest.mark.parametrize("task_id, wrong", [
    (2, "def similar_elements(a, b):\n    return tuple(set(a) | set(b))"),  # union, not intersection
    (3, "def is_not_prime(n):\n    return n % 2 == 0"),  # 35 is odd and not prime
    (17, "def square_perimeter(a):\n    return a * a"),
    (82, "import math\ndef volume_sphere(r):\n    return 4 * math.pi * r ** 3"),  # no 1/3
    (2, "def some_other_name(a, b):\n    return tuple(set(a) & set(b))"),  # right idea, wrong name
    (2, "def similar_elements(a, b)\n    return tuple(set(a) & set(b))"),  # syntax error
])
def test_wrong_solutions_fail(task_id, wrong):
    result = score_mbpp(_item(task_id), _fenced(wrong))
    assert not result.correct and result.pred == "fail"


def test_a_solution_that_never_returns_fails_at_the_time_limit():
    looping = "def similar_elements(a, b):\n    while True:\n        pass"
    started = time.monotonic()
    result = score_mbpp(_item(2), _fenced(looping), timeout_s=2.0)
    assert not result.correct
    assert time.monotonic() - started >= 2.0  # killed by the limit, not failed early


def test_the_program_is_the_code_then_the_setup_then_the_asserts():
    item = _item(82)
    program = mbpp_program(item, _fenced("def volume_sphere(r):\n    return 0"))
    code, setup, first_test = (program.index(s) for s in ("def volume_sphere", "import math", item.meta["tests"][0]))
    assert code < setup < first_test
    assert all(test in program for test in item.meta["tests"])


def test_rows_of_the_full_set_load_and_their_setup_code_runs(tmp_path):
    row = {"task_id": 900, "text": "Write a function to add the module's OFFSET to a number.",
           "code": "def add_offset(n):\n    return n + OFFSET", "test_setup_code": "OFFSET = 10",
           "test_list": ["assert add_offset(1) == 11", "assert add_offset(-10) == 0"], "challenge_test_list": []}
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    [item] = load_items("mbpp", path)
    assert item.id == "Mbpp/900" and item.meta["setup"] == "OFFSET = 10"
    assert item.messages[0]["content"].startswith(row["text"] + "\nYour code should pass these tests:")
    assert score_mbpp(item, _fenced(row["code"])).correct
    assert not score_mbpp(item, _fenced("def add_offset(n):\n    return n + 1")).correct


def test_mbpp_is_a_dataset_of_the_command_line():
    assert SCORERS["mbpp"] is score_mbpp
    args = _parser().parse_args(["report", "--dataset", "mbpp", "--run-name", "mbpp_check"])
    assert args.dataset == "mbpp"
