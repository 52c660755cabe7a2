"""Reading a client's JSON body safely: time, size, JSON, nesting depth and text that UTF-8 can encode.

Everything here runs before the body meets pydantic, litellm or an upstream, so that no body can
cause a 500: Python's JSON parser recurses (a body nested 10,000 deep raises RecursionError) and
refuses integers of more than 4,300 digits (ValueError), and JSON's `\\ud800` escapes decode to
lone surrogates that fail later, wherever the text is encoded. Python's parser also reads what JSON
is not (`NaN`, `Infinity`), and numbers past a double's range (`1e999`, read as infinity, or a
310-digit integer): llama-server answers 500 to each, so they are refused too. The walk is
iterative and names the offending field as OpenAI's `param` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncGenerator
from typing import Any

from gateway.wire.errors import InvalidRequest, quoted


async def read_body(chunks: AsyncGenerator[bytes, None], max_bytes: int, timeout_s: float) -> bytes:
    """The body whose parts `chunks` yields as they arrive (closed once read), or InvalidRequest:
    a 400 as soon as it passes `max_bytes` (a chunked body declares no length to check first), a
    408 if it has not all arrived within `timeout_s` (a client trickling it would hold its
    connection and its memory for as long as it liked)."""
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s), contextlib.aclosing(chunks):
            async for chunk in chunks:
                if len(body) + len(chunk) > max_bytes:
                    raise InvalidRequest(f"request body exceeds {max_bytes} bytes")
                body += chunk
    except TimeoutError as exc:
        error = InvalidRequest(f"the request body did not arrive within {timeout_s:g} s",
                               headers={"connection": "close"})
        error.status, error.code = 408, "request_timeout"
        raise error from exc
    return bytes(body)


def parse_json_body(raw: bytes, max_bytes: int, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, or InvalidRequest (400) naming what is wrong with it."""
    if len(raw) > max_bytes:
        raise InvalidRequest(f"request body exceeds {max_bytes} bytes")
    try:
        data = json.loads(raw)
    except RecursionError as exc:
        raise InvalidRequest(f"request body is nested deeper than {max_depth} levels") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {str(exc)[:200]}") from exc
    except ValueError as exc:  # valid JSON, but an integer past Python's limit on digits
        raise InvalidRequest(f"request body holds an integer of more than {sys.get_int_max_str_digits()} "
                             "digits") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    check_json(data, max_depth)
    return data


def check_json(value: Any, max_depth: int, path: str = "") -> None:
    """Refuse a value nested deeper than `max_depth`, holding a string or key that is not valid
    Unicode (a lone surrogate), or a number that is not a double's (NaN, infinities, a 310-digit
    integer); `path` names `value` in the error's param."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequest(f"'{where}' is nested deeper than {max_depth} levels", param=where or None)
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, (int, float)) and not abs(item) <= sys.float_info.max:  # NaN compares False
            raise _refused(where, "is NaN, infinite or past a 64-bit float's range: not a number upstreams read")
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, where)
                stack.append((child, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))


def depth_of(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar is 0)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refused(where, f"holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}), which is not valid "
                       "Unicode text") from exc


def _refused(where: str, problem: str) -> InvalidRequest:
    """The 400 for a value at `where` (quoted as far as errors quote; empty: the whole body)."""
    name = f"'{quoted(where)}'" if where else "the request body"
    return InvalidRequest(f"{name} {problem}", param=quoted(where) if where else None)
