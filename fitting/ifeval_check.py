"""IFEval verification with the `if-verifiable` package's checkers, importable offline.

The package's top-level `__init__` imports Hugging Face `datasets` (to download IFEval), which we
neither need nor install: the prompts come from data/. So we register the package's
directory as a bare namespace before importing its checker modules, which leaves `__init__`
unexecuted. Checkers that need NLTK's punkt data (not downloadable here) return None.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

_NLTK_DATA_ERRORS = (LookupError, OSError)


def _registry() -> dict[str, Any]:
    if "if_verifiable" not in sys.modules:
        spec = importlib.util.find_spec("if_verifiable")
        if spec is None or spec.submodule_search_locations is None:
            raise ValueError("IFEval needs the if-verifiable package (pip install --no-deps if-verifiable==0.1.2)")
        package = types.ModuleType("if_verifiable")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["if_verifiable"] = package
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    return INSTRUCTION_DICT


def check_instructions(response: str, instruction_ids: list[str], kwargs_list: list[dict[str, Any]],
                       prompt: str) -> dict[str, bool | None]:
    """Strict pass/fail per instruction id; None where the checker cannot run here."""
    registry = _registry()
    results: dict[str, bool | None] = {}
    for instruction_id, kwargs in zip(instruction_ids, kwargs_list):
        checker_class = registry.get(instruction_id)
        if checker_class is None:
            results[instruction_id] = None
            continue
        checker = checker_class(instruction_id)
        checker.build_description(**{k: v for k, v in (kwargs or {}).items() if v is not None})
        args = checker.get_instruction_args()
        if args and "prompt" in args:
            checker.build_description(prompt=prompt)
        try:
            results[instruction_id] = bool(response.strip() and checker.check_following(response))
        except _NLTK_DATA_ERRORS:
            results[instruction_id] = None
    return results

