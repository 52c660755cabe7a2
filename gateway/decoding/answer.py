"""The answer one decoding writes: its tokens, where each came from, its bytes, the text safe to
show, how it ended, within what limit and what grammar.

A local token is `accept`ed as it is; what an upstream wrote is `append_upstream`ed: its text is
re-tokenized with the local tokenizer at the join, cut at the answer's limit, and counted as asking
the upstream directly would bill it (`direct_length`, for the cost ceiling). The answer ends on the
model's end-of-generation token, a stop string, the upstream's end, or its limit (`finish_reason`).

Under a grammar (a request's `response_format` JSON) every local token is one it `allows`, what an
upstream wrote is `kept` only as far as the grammar accepts it (a hand-off asks for at most
GRAMMAR_SPAN tokens), and the answer ends only where the grammar is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

import numpy as np

from adapters.engine import common_prefix
from gateway.decoding.text_stream import TextReleaser
from gateway.decoding.values import CACHE, GRAMMAR_SPAN, LOCAL, UPSTREAM, Written

RETOKENIZED_TAIL = 8  # answer tokens re-tokenized with upstream text: room for a word re-merging at the join
CONTINUATION_BYTES = frozenset(bytes([b]) for b in range(0x80, 0xC0))  # UTF-8 bytes inside a character


class Vocabulary(Protocol):
    """The local model's tokens as bytes, and text as its tokens (adapters.local_model.LocalModel)."""

    end_token: int

    def token_bytes(self, token: int) -> bytes: ...

    def tokenize_text(self, data: bytes) -> list[int]: ...

    def is_end_of_generation(self, token: int) -> bool: ...


class Grammar(Protocol):
    """A grammar's parse state over the local vocabulary (adapters.grammar.Grammar)."""

    def allows(self, answer: list[int], token: int) -> bool: ...

    def mask(self, answer: list[int], logits: np.ndarray) -> np.ndarray: ...

    def accepted(self, answer: list[int], tokens: list[int]) -> int: ...

    def close(self) -> None: ...


class Answer:
    """One answer, as it grows: `tokens` and their `sources` (one each), `data` (their bytes), `text`
    (what is safe to show), `finish_reason` (None while it goes on), `end_token` (it ended on the
    model's end-of-generation token, which a direct call bills), at most `limit` tokens, following
    `grammar` (None: any tokens)."""

    def __init__(self, vocabulary: Vocabulary, limit: int, stops: tuple[str, ...],
                 grammar: Grammar | None = None) -> None:
        self.limit = limit
        self._vocabulary, self._stops, self._grammar = vocabulary, stops, grammar
        self.restart()

    def restart(self) -> None:
        """Empty the answer: nothing written yet (or what was is thrown away)."""
        self.tokens: list[int] = []
        self.sources: list[str] = []  # where each token came from: local | upstream | cache
        self.data = bytearray()
        self.text = TextReleaser(self._stops)
        self.finish_reason: str | None = None
        self.end_token = False
        # the upstream's count of the text it wrote for the rest of the answer in one call, less the local
        # tokens that text became: asking directly bills the upstream's count, so the cost ceiling uses it
        self.upstream_count_extra = 0

    @property
    def rest(self) -> int:
        """Tokens the limit still allows."""
        return self.limit - len(self.tokens)

    @property
    def direct_length(self) -> int:
        """The answer's tokens so far as asking the upstream directly would bill them: the upstream's
        own count of what it wrote for the rest of the answer in one call, the local count of the rest
        (a span's count would overstate it where its tokens re-merge with the local ones)."""
        return len(self.tokens) + self.upstream_count_extra

    def source_counts(self) -> dict[str, int]:
        """Answer tokens per source."""
        return {name: self.sources.count(name) for name in (LOCAL, UPSTREAM, CACHE)}

    def accept(self, token: int) -> str | None:
        """Append a local token; the text it releases. None: it is the end-of-generation token, which
        ends the answer instead."""
        if self._vocabulary.is_end_of_generation(token):
            self.finish_reason, self.end_token = "stop", True
            return None
        self.tokens.append(token)
        self.sources.append(LOCAL)
        data = self._vocabulary.token_bytes(token)
        self.data += data
        text = self.text.feed(data)
        self._check_end()
        return text

    def append_upstream(self, written: Written, to_limit: bool = False) -> tuple[int, str]:
        """Append what a call wrote; (the index of the first token it changed, the text it releases).
        `to_limit`: the call was asked for all the limit allows, uncut; if it stopped by length, so does
        the answer, as a direct call would have (its text may re-tokenize into fewer local tokens than
        the upstream counted, and another call for the difference would bill the whole prompt again)."""
        length_before = len(self.tokens)
        first_new, added = self.append_text(written.text, written.source)
        # kept whole (not cut at the limit), its end token, if any, counted with the answer's end
        if to_limit and written.billed_tokens is not None and added == written.text.encode("utf-8"):
            self.upstream_count_extra += written.billed_tokens - written.finished - (len(self.tokens) - length_before)
        delta = self.text.feed(added)
        if written.finished and len(self.tokens) < self.limit:  # else a direct call would have stopped by length
            self.finish_reason, self.end_token = "stop", not self.text.stopped
        elif to_limit and not written.finished:
            self.finish_reason = "length"
        self._check_end()
        return first_new, delta

    def append_text(self, text: str, source: str) -> tuple[int, bytes]:
        """Append upstream text, re-tokenized locally; (the first new token's index, the new bytes).

        The answer's last few tokens are re-tokenized with the text, so a boundary that merges
        ("Par" + "is" -> "Paris") becomes the token the local model would have seen; tokens past
        the common prefix are replaced, and the next forward rewinds the KV cache to that prefix.
        Earlier tokens stand as written: re-tokenizing the whole answer would undo a split the local
        model chose far back, rewind the cache to it and count every token after it as the
        upstream's. Tokens past the answer's limit are dropped with their text.
        """
        token_bytes = self._vocabulary.token_bytes
        before = len(self.data)
        keep = self._retokenized_from()
        # the answer's bytes are its tokens' bytes, so the kept prefix ends where the tail's begin
        kept_bytes = before - sum(len(token_bytes(t)) for t in self.tokens[keep:])
        self.data += text.encode("utf-8")
        tokens = self.tokens[:keep] + self._vocabulary.tokenize_text(bytes(self.data[kept_bytes:]))
        if len(tokens) > self.limit:
            tokens = tokens[: self.limit]
            self.data = bytearray(b"".join(token_bytes(t) for t in tokens))
        common = common_prefix(self.tokens, tokens)
        self.tokens = tokens
        self.sources = self.sources[:common] + [source] * (len(tokens) - common)
        return common, bytes(self.data[before:])

    def adopt(self, other: Answer) -> str:
        """Take a local answer's place (`other`, a sampled one); the text it releases at once."""
        self.tokens, self.sources = list(other.tokens), [LOCAL] * len(other.tokens)
        self.data = bytearray(other.data)
        self.finish_reason, self.end_token = other.finish_reason, other.end_token
        self.text = TextReleaser(self._stops)
        return self.text.feed(bytes(self.data))

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the answer."""
        return self._grammar is not None

    def handoff_span(self, span: int) -> int:
        """The tokens a hand-off of `span` may ask for: at most GRAMMAR_SPAN under a grammar."""
        return span if self._grammar is None else min(span, GRAMMAR_SPAN)

    def allows(self, token: int) -> bool:
        """Whether `token` may come next."""
        return self._grammar is None or self._grammar.allows(self.tokens, token)

    async def masked(self, logits: np.ndarray) -> np.ndarray:
        """Next-token `logits` with every token the grammar refuses next at -inf (off the event loop).
        Cancelled, it returns only once the thread has: the request frees the grammar as it unwinds."""
        work = asyncio.ensure_future(asyncio.to_thread(self._grammar.mask, self.tokens, logits))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            while not work.done():  # one mask is milliseconds of work: wait it out, whatever cancels again
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({work})
            raise

    def kept(self, written: Written | None) -> Written | None:
        """What an upstream wrote, as far as the grammar accepts it next; finished only if all of it was
        accepted and the grammar is complete there. A cut inside a character drops its bytes."""
        if self._grammar is None or written is None:
            return written
        vocabulary = self._vocabulary
        tokens = vocabulary.tokenize_text(written.text.encode("utf-8"))
        kept = self._grammar.accepted(self.tokens, tokens)
        kept_text = b"".join(vocabulary.token_bytes(t) for t in tokens[:kept]).decode("utf-8", "ignore")
        whole = kept == len(tokens)
        finished = written.finished and whole and self._grammar.allows(self.tokens + tokens, vocabulary.end_token)
        return Written(kept_text, finished, written.source, written.billed_tokens if whole else None)

    def close(self) -> None:
        """Free the grammar's parse state."""
        if self._grammar is not None:
            self._grammar.close()

    def _check_end(self) -> None:
        """End the answer at a stop string or at its limit."""
        if self.finish_reason is not None:
            return
        if self.text.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.limit:
            self.finish_reason = "length"

    def _retokenized_from(self) -> int:
        """The first answer token re-tokenized with upstream text: RETOKENIZED_TAIL back, moved to
        the start of a character (a token may end inside one)."""
        start = max(0, len(self.tokens) - RETOKENIZED_TAIL)
        while start > 0 and self._vocabulary.token_bytes(self.tokens[start])[:1] in CONTINUATION_BYTES:
            start -= 1
        return start
