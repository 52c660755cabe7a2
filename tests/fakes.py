"""Small, obviously-correct fakes for unit tests of decoder logic (real ones live in integration tests)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from adapters.pricing import Prices
from adapters.upstream import Continuation, Handoff, UpstreamUnavailable

EOS = "<eos>"


class FakeTemplate:
    def render(self, messages: list[dict], continue_final: bool = False) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("" if continue_final else "assistant: ")

    def render_parts(self, messages: list[dict], continue_final: bool = False) -> list[tuple[str, bool]]:
        return [(self.render(messages, continue_final), False)]


class FakeLocalModel:
    """Tokens are the strings in `vocab` (index 0 is EOS); tokenizing is greedy longest match.

    The model "wants" to write `target`: its logits peak on the longest vocab entry that
    continues the answer towards `target` (EOS once it is written or off track). At answer
    positions in `uncertain_at` the distribution is flat (high entropy), leaning by `lean` towards
    that token (so a greedy guess there still follows `target`).
    """

    def __init__(self, vocab: list[str], target: str, uncertain_at: frozenset[int] = frozenset(), n_ctx: int = 512,
                 lean: float = 0.0):
        self.vocab = [EOS, *vocab]
        self.target = target
        self.uncertain_at = uncertain_at
        self.lean = lean
        self.n_ctx = n_ctx
        self.template = FakeTemplate()
        self.prompt_length = 0
        self.forwards: list[list[int]] = []
        self.pauses = 0  # times the sequence left the batch to wait for an upstream
        self.wants_hidden = False
        self.step_s: float | None = None  # what the decoder reads as one decode step's seconds (None: unknown)

    def tokenize_prompt(self, parts: list[tuple[str, bool]]) -> list[int]:
        text = "".join(part for part, _ in parts)
        self.prompt_length = len(text)
        return [1] * len(text)  # one dummy token per character; only the count matters

    def tokenize_text(self, data: bytes) -> list[int]:
        text, tokens = data.decode(), []
        while text:
            best = max((i for i in range(1, len(self.vocab)) if text.startswith(self.vocab[i])),
                       key=lambda i: len(self.vocab[i]))
            tokens.append(best)
            text = text[len(self.vocab[best]):]
        return tokens

    def token_bytes(self, token: int) -> bytes:
        return self.vocab[token].encode()

    def is_end_of_generation(self, token: int) -> bool:
        return token == 0

    end_token = 0

    def grammar(self, text: str) -> "PrefixGrammar":
        """A fake grammar: the GBNF text is taken as the one answer it accepts."""
        return PrefixGrammar(self.vocab, text)

    hidden: np.ndarray | None = None  # with a `hidden` sequence: the latest forward's logits stand in for it

    @contextlib.asynccontextmanager
    async def sequence(self, prompt: list[int], scope: str = "", hidden: bool = False, speculate: bool = False,
                       claim=None):
        self.wants_hidden = hidden
        yield self

    def pause(self) -> None:
        self.pauses += 1

    async def forward(self, tokens: list[int]) -> np.ndarray:
        self.forwards.append(list(tokens))
        answer = tokens[self.prompt_length:]
        written = "".join(self.vocab[t] for t in answer)
        logits = np.zeros(len(self.vocab), dtype=np.float32)
        rest = self.target[len(written):] if self.target.startswith(written) else ""
        options = [i for i in range(1, len(self.vocab)) if rest and rest.startswith(self.vocab[i])]
        best = max(options, key=lambda i: len(self.vocab[i])) if options else 0
        logits[best] = self.lean if len(answer) in self.uncertain_at else 20.0
        self.hidden = logits.copy() if self.wants_hidden else None
        return logits


class PrefixGrammar:
    """Accepts exactly the prefixes of `text`; the answer may end only once all of it is written."""

    def __init__(self, vocab: list[str], text: str) -> None:
        self.vocab, self.text = vocab, text

    def allows(self, answer: list[int], token: int) -> bool:
        written = "".join(self.vocab[t] for t in answer)
        return written == self.text if token == 0 else self.text.startswith(written + self.vocab[token])

    def mask(self, answer: list[int], logits: np.ndarray) -> np.ndarray:
        return np.where([self.allows(answer, t) for t in range(len(logits))], logits, -np.inf).astype(logits.dtype)

    def accepted(self, answer: list[int], tokens: list[int]) -> int:
        count = 0
        while count < len(tokens) and self.allows(list(answer) + tokens[:count], tokens[count]):
            count += 1
        return count

    def close(self) -> None:
        pass


@dataclass
class FakeUpstream:
    """Continues towards its own `target` text, `chars_per_token` characters per requested token,
    billing the tokens it wrote (those read `ahead` returned apart, `chars_per_token` a piece)."""

    target: str
    chars_per_token: int = 2
    fail: bool = False
    fail_after: int | None = None  # calls after this many fail
    delay_s: float = 0.0
    available: bool = True
    worst_case_s: float = 1.0
    warms: bool = False
    read_ahead: int = 0
    cached_share: float = 0.0  # of each call's prompt tokens, billed as read from the cache
    calls: list[Handoff] = field(default_factory=list)
    extras: list[dict] = field(default_factory=list)  # each call's extra sampling parameters

    def handoff(self, messages: list[dict], continue_final: bool = False, scope: str = "shared") -> Handoff:
        return Handoff("", messages, "", continue_final, scope=scope)

    def text_handoff(self, prompt: str, scope: str = "shared") -> Handoff:
        return Handoff(prompt, [], "", scope=scope)

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff:
        return dataclasses.replace(handoff, answer=answer)

    def cache_key(self, handoff: Handoff, max_tokens: int, scope: str) -> str:
        return f"{scope}|{handoff.answer}|{max_tokens}"

    def estimate_prompt_tokens(self, handoff: Handoff) -> int:
        return 10 + len(handoff.answer)

    def estimate_completion_tokens(self, handoff: Handoff, span: int) -> int:
        return span

    prices = Prices(input=1e-6, cached_input=1e-7, output=1e-6)

    def estimate_cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        return self.prices.cost(prompt_tokens, completion_tokens, cached_tokens)

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                            seed: int | None, extra: dict | None = None, ahead: int = 0) -> Continuation:
        self.calls.append(handoff)
        self.extras.append(extra or {})
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail or (self.fail_after is not None and len(self.calls) > self.fail_after):
            raise UpstreamUnavailable("scripted failure")
        rest = self.target[len(handoff.answer):] if self.target.startswith(handoff.answer) else ""
        size = self.chars_per_token
        text = rest[: (max_tokens + ahead) * size]
        prompt, finished = self.estimate_prompt_tokens(handoff), len(text) == len(rest)
        cached = int(prompt * self.cached_share)
        # its tokens and, if it ended, the end token, all within what was asked, as a server bills them
        written = min(max(1, max_tokens + ahead), -(-len(text) // size) + finished)
        head, past = text[: max_tokens * size], text[max_tokens * size:]
        pieces = tuple(past[i:i + size] for i in range(0, len(past), size)) if ahead else ()
        return Continuation(head, finished=finished, prompt_tokens=prompt, completion_tokens=written,
                            cost_usd=self.estimate_cost(prompt, written, cached), latency_s=self.delay_s,
                            cached_tokens=cached, compute_ms=5.0, ahead=pieces)


def synthetic(n: int, seed: int) -> list[dict]:
    """Answers whose mismatches are digits written with entropy above 1, or the first token: no
    single signal separates them, the features together do."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        length = 12
        entropy = rng.uniform(0, 3, length)
        kinds = rng.choice(["word", "digit", "piece"], length)
        mismatch = ((entropy > 1.0) & (kinds == "digit")) | (np.arange(length) == 0)
        top1 = np.clip(1.2 - entropy / 2.5 + rng.normal(0, 0.05, length), 0.05, 1.0)
        records.append({"n": length, "mismatch": "".join("1" if m else "0" for m in mismatch),
                        "entropy": entropy.round(4).tolist(), "top1": top1.round(4).tolist(),
                        "margin": (top1 * 0.8).round(4).tolist(), "kind": kinds.tolist(),
                        "top": [[t, t * 0.2, t * 0.1, t * 0.05] for t in top1.round(4)]})
    return records


class JsonProvider(BaseHTTPRequestHandler):
    """A provider test server's base: answers are JSON, requests are not logged."""

    def send_json(self, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve `handler` on a free loopback port; yields its OpenAI base URL (a fixture's body)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
