"""Output that parses by construction: llama.cpp's grammar sampler over logits the engine computed.

`gbnf_for` turns an OpenAI `response_format` into a GBNF grammar (llama-cpp-python's port of
llama.cpp's JSON-schema converter); `Grammar` holds one answer's parse state and answers three
questions about the next token: is it allowed, which tokens are (a mask), and how much of a
proposed continuation is. Its state always matches the answer tokens it is given: extending them
accepts the new tokens, anything else (a re-tokenized boundary) replays the answer from the start.
The grammar works on bytes, so two tokenizations of the same text reach the same state.
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_grammar

# llama-cpp-python's converter lets a JSON string hold raw control characters (a newline), which JSON
# forbids; llama.cpp's own converter and JSON_GBNF exclude them, as this rule does.
LOOSE_CHAR = r'char ::= [^"\\] |'
JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data

# The converter writes a repetition of n (`maxLength`, `maxItems`, a pattern's `{m,n}`) as n nested
# optional groups, and llama.cpp's grammar parser recurses once per level: at 20,000 it overflows the
# stack and kills the process, and `minLength` 1e8 builds a 100 MB grammar before anything parses it.
# So every keyword that sizes the grammar is bounded before the converter sees the schema.
MAX_REPEAT = 1_000  # the most one keyword may ask for
MAX_REPEATS_TOTAL = 10_000  # the most all of a schema's repetitions together may ask for
MAX_SCHEMA_NODES = 5_000  # objects and lists in the schema (OpenAI allows 5,000 properties)
REPEAT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class GrammarUnsupported(Exception):
    """The response format cannot be written as a grammar; the message says why."""


class SchemaRefused(GrammarUnsupported):
    """A JSON schema no one should try to follow: too large a grammar, or a reference outside it.
    `path` names the offending keyword inside the schema (dotted, as OpenAI's `param`)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def check_schema(schema: Any) -> None:
    """Raise SchemaRefused unless every keyword that sizes a grammar is within bounds: each
    repetition (length, items, properties, a pattern's quantifier) at most MAX_REPEAT, all of them
    together at most MAX_REPEATS_TOTAL, at most MAX_SCHEMA_NODES objects and lists, and `$ref`s
    only local (`#...`). Iterative: the schema's nesting is bounded by the body's depth limit."""
    total, nodes = 0, 0
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise SchemaRefused(f"the schema holds more than {MAX_SCHEMA_NODES} objects and lists", where)
        if isinstance(node, list):
            children = [(child, f"{where}[{i}]") for i, child in enumerate(node)]
        else:
            children = [(child, f"{where}.{key}" if where else key) for key, child in node.items()]
            for (child, path), key in zip(children, node):
                total += _repeats(key, child, path)
                if total > MAX_REPEATS_TOTAL:
                    raise SchemaRefused(f"the schema's lengths and counts add up to more than {MAX_REPEATS_TOTAL}", path)
        stack.extend(reversed(children))  # visited in the document's order: the error names the first past a bound


def _repeats(key: str, value: Any, path: str) -> int:
    """How many copies `key: value` asks the grammar for (0 for keywords that ask none)."""
    if key == "$ref":
        if not isinstance(value, str) or not value.startswith("#"):
            raise SchemaRefused("only local references ('#/...') are followed", path)
        return 0
    if key in REPEAT_KEYWORDS and isinstance(value, (int, float)) and not isinstance(value, bool):
        counts = [value]
    elif key == "pattern" and isinstance(value, str):
        counts = [int(n) for pair in QUANTIFIER.findall(value) for n in pair if n]
    else:
        return 0
    for count in counts:
        if count > MAX_REPEAT:
            raise SchemaRefused(f"'{key}' asks for {count:g} repetitions; at most {MAX_REPEAT} are served", path)
    return int(sum(counts))


def gbnf_for(kind: str, schema: dict[str, Any] | None = None) -> str:
    """The grammar of `json_object` (any JSON object) or of `json_schema` with `schema`."""
    if kind == "json_object":
        return llama_grammar.JSON_GBNF
    check_schema(schema)
    try:
        gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema or {}))
    except Exception as exc:  # noqa: BLE001 - the converter raises bare errors of several kinds
        raise GrammarUnsupported(f"the JSON schema cannot be turned into a grammar: {exc}") from exc
    return gbnf.replace(LOOSE_CHAR, JSON_CHAR)


class Grammar:
    """One answer's grammar state over a model's vocabulary. Not thread-safe: one user at a time."""

    def __init__(self, vocab: Any, n_vocab: int, gbnf: str) -> None:
        self._sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
        if not self._sampler:
            raise GrammarUnsupported("llama.cpp could not parse the grammar")
        self._tokens: list[int] = []  # the answer tokens the state has accepted
        self._all = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._all["id"] = np.arange(n_vocab)
        self._one = np.zeros(1, dtype=TOKEN_DATA)

    def clone(self) -> "Grammar":
        """A grammar in the same state, for another answer (cheaper than parsing the GBNF again)."""
        twin = object.__new__(Grammar)
        twin._sampler = llama_cpp.llama_sampler_clone(self._sampler)
        twin._tokens = list(self._tokens)
        twin._all, twin._one = self._all.copy(), self._one.copy()
        return twin

    def close(self) -> None:
        if getattr(self, "_sampler", None):
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    __del__ = close  # a request refused after admission built its grammar never decodes to close it

    def allows(self, answer: Sequence[int], token: int) -> bool:
        """May `token` follow `answer`? (An end-of-generation token: only where the grammar is complete.)"""
        self._sync(answer)
        return self._allows(self._sampler, token)

    def mask(self, answer: Sequence[int], logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar forbids after `answer` set to -inf. Scans the whole
        vocabulary (milliseconds): call it off the event loop, and only when a cheaper check failed."""
        self._sync(answer)
        self._all["logit"] = logits
        self._apply(self._sampler, self._all)
        return self._all["logit"].copy()

    def accepted(self, answer: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts after `answer` (the state is kept)."""
        self._sync(answer)
        trial = llama_cpp.llama_sampler_clone(self._sampler)
        try:
            for count, token in enumerate(tokens):
                if not self._allows(trial, token):
                    return count
                llama_cpp.llama_sampler_accept(trial, token)
            return len(tokens)
        finally:
            llama_cpp.llama_sampler_free(trial)

    def _sync(self, answer: Sequence[int]) -> None:
        held = len(self._tokens)
        if list(answer[:held]) != self._tokens:
            llama_cpp.llama_sampler_reset(self._sampler)
            self._tokens, held = [], 0
        for token in answer[held:]:
            # Accepting a token the grammar forbids aborts the process inside llama.cpp: check first.
            if not self._allows(self._sampler, token):
                raise GrammarUnsupported(f"token {token} breaks the grammar")
            llama_cpp.llama_sampler_accept(self._sampler, token)
            self._tokens.append(token)

    def _allows(self, sampler: Any, token: int) -> bool:
        self._one[0] = (token, 0.0, 0.0)
        self._apply(sampler, self._one)
        return bool(np.isfinite(self._one[0]["logit"]))

    @staticmethod
    def _apply(sampler: Any, data: np.ndarray) -> None:
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(data), selected=-1,
            sorted=False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
