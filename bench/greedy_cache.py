"""A loopback proxy in front of an upstream server that answers a repeated greedy request from its
record: the benchmarks' way to ask a deterministic upstream once per question.

A replay asks the upstream the same question several ways: a shadow sample, an escalation asked
afresh, upstream-only's answer. At temperature 0 the upstream's answer is a function of the request
(llama-server with several slots is not quite deterministic: batches of different sizes round
differently, and the same greedy request answered twice can differ), so the first answer is kept
and every later identical request gets it back byte for byte, with the usage billed the first time:
each call is still priced as a provider would bill it. Records are a gzipped JSONL file, so a resumed
run (or another run on the same rows) reuses them.

Only POSTs at temperature 0 to a completions path are recorded; everything else is forwarded as is.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

RECORDED_PATHS = ("/v1/chat/completions", "/v1/completions", "/completion", "/completions")
# fields that cannot change a greedy answer (a proxy fronts one model): left out of the key
IGNORED = {"model", "temperature", "top_p", "seed", "user", "metadata", "stream_options", "n", "cache_prompt",
           "id_slot"}


def request_key(path: str, body: dict[str, Any]) -> str | None:
    """The record key of a POST to `path` with JSON `body`, or None where the answer is not a
    function of the request (sampling, or a path that does not complete text)."""
    if path.split("?")[0] not in RECORDED_PATHS or body.get("temperature") not in (0, 0.0):
        return None
    kept = {k: v for k, v in body.items() if k not in IGNORED and not (k == "repeat_penalty" and v == 1.0)}
    if "max_completion_tokens" in kept:
        kept["max_tokens"] = kept.pop("max_completion_tokens")
    return hashlib.sha256(json.dumps([path, kept], sort_keys=True).encode()).hexdigest()


class Records:
    """Recorded answers by key, appended to a gzipped JSONL file as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answers: dict[str, dict[str, Any]] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.guard = threading.Lock()
        self.hits = self.misses = 0
        if path.exists():
            with gzip.open(path, "rt") as handle, contextlib.suppress(EOFError, json.JSONDecodeError):
                for line in handle:
                    record = json.loads(line)
                    self.answers[record["key"]] = record

    def lock(self, key: str) -> threading.Lock:
        """One lock per key: a second identical request waits for the first's answer instead of asking."""
        with self.guard:
            return self.locks.setdefault(key, threading.Lock())

    def count(self, hit: bool) -> None:
        """Count one recorded request: answered from the records (hit) or asked (miss)."""
        with self.guard:
            self.hits += hit
            self.misses += not hit

    def add(self, record: dict[str, Any]) -> None:
        with self.guard:
            self.answers[record["key"]] = record
            with gzip.open(self.path, "at") as handle:
                handle.write(json.dumps(record) + "\n")


def _handler(target: str, records: Records, client: httpx.Client) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            self._forward(b"")

        def do_POST(self) -> None:  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                key = request_key(self.path, json.loads(raw))
            except (json.JSONDecodeError, AttributeError):
                key = None
            if key is None:
                self._forward(raw)
                return
            with records.lock(key):
                record = records.answers.get(key)
                records.count(hit=record is not None)
                if record is None:
                    status, content_type, body = self._ask(raw)
                    if status != 200:
                        self._send(status, content_type, body)
                        return
                    record = {"key": key, "request": json.loads(raw), "content_type": content_type,
                              "body": body.decode()}
                    records.add(record)
            self._send(200, record["content_type"], record["body"].encode())

        def _ask(self, raw: bytes) -> tuple[int, str, bytes]:
            headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
            response = client.request(self.command, target + self.path, content=raw, headers=headers)
            return response.status_code, response.headers.get("content-type", "application/json"), response.content

        def _forward(self, raw: bytes) -> None:
            self._send(*self._ask(raw))

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@contextlib.contextmanager
def greedy_cache(target_root: str, path: Path, port: int) -> Iterator[Records]:
    """Serve the recording proxy for the server at `target_root` (http://host:port, no /v1) on
    127.0.0.1:`port` while the block runs, recording into `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    records = Records(path)
    with httpx.Client(timeout=900) as client:
        server = ThreadingHTTPServer(("127.0.0.1", port), _handler(target_root, records, client))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield records
        finally:
            server.shutdown()
            server.server_close()
