"""Appending what the upstream wrote (mixed into Decoding): its text is re-tokenized with the local
tokenizer at the join, kept only as far as the answer's grammar accepts it, cut at the answer's
limit, and counted as a direct call would bill it (for the cost ceiling).
"""

from __future__ import annotations

from adapters.engine import Sequence, common_prefix
from gateway.decoding.values import Piece, Written
from policies import Signal

RETOKENIZED_TAIL = 8  # answer tokens re-tokenized with upstream text: room for a word re-merging at the join
CONTINUATION_BYTES = frozenset(bytes([b]) for b in range(0x80, 0xC0))  # UTF-8 bytes inside a character


class Appending:
    """Decoding's appending of upstream text; it reads and writes its answer state."""

    async def _append_upstream(self, sequence: Sequence, text: str, finished: bool, source: str,
                               billed_tokens: int | None, signal: Signal, to_limit: bool = False) -> Piece:
        """Append what a call wrote (a Written, unpacked). `to_limit`: the call was asked for all the
        answer's limit allows, uncut; if it stopped by length, so does the answer, as a direct call
        would have (its text may re-tokenize into fewer local tokens than the upstream counted, and
        another call for the difference would bill the whole prompt again)."""
        length_before = len(self.answer_tokens)
        first_new, added = self._append_text(text, source)
        # kept whole (not cut at the limit), its end token, if any, counted with the answer's end
        if to_limit and billed_tokens is not None and added == text.encode("utf-8"):
            self._upstream_count_extra += billed_tokens - finished - (len(self.answer_tokens) - length_before)
        delta = self.text.feed(added)
        if finished and len(self.answer_tokens) < self.limit:  # else a direct call would have stopped by length
            self.finish_reason, self._end_token = "stop", not self.text.stopped
        elif to_limit and not finished:
            self.finish_reason = "length"
        self._check_end()
        logprobs = await self._score(sequence, first_new) if self.request.logprobs else ()
        return Piece(delta, tuple(self.answer_tokens[first_new:]), source, signal, logprobs)

    def _grammar_cut(self, text: str, finished: bool, source: str, billed_tokens: int | None) -> Written:
        """The upstream's text as far as the grammar accepts it; finished only if all of it was
        accepted and the grammar is complete there. A cut inside a character drops its bytes."""
        tokens = self.local.tokenize_text(text.encode("utf-8"))
        kept = self._grammar.accepted(self.answer_tokens, tokens)
        kept_text = b"".join(self.local.token_bytes(t) for t in tokens[:kept]).decode("utf-8", "ignore")
        whole = kept == len(tokens)
        finished = finished and whole and self._grammar.allows(self.answer_tokens + tokens, self.local.end_token)
        return Written(kept_text, finished, source, billed_tokens if whole else None)

    def _append_text(self, text: str, source: str) -> tuple[int, bytes]:
        """Append upstream text, re-tokenized locally; return (first new token index, new bytes).

        The answer's last few tokens are re-tokenized with the text, so a boundary that merges
        ("Par" + "is" -> "Paris") becomes the token the local model would have seen; tokens past
        the common prefix are replaced, and the next forward() rewinds the KV cache to that prefix.
        Earlier tokens stand as written: re-tokenizing the whole answer would undo a split the local
        model chose far back, rewind the cache to it and count every token after it as the
        upstream's. Tokens past the answer's limit are dropped with their text.
        """
        before = len(self.answer_bytes)
        keep = self._retokenized_from()
        # the answer's bytes are its tokens' bytes, so the kept prefix ends where the tail's begin
        kept_bytes = before - sum(len(self.local.token_bytes(t)) for t in self.answer_tokens[keep:])
        self.answer_bytes += text.encode("utf-8")
        tokens = self.answer_tokens[:keep] + self.local.tokenize_text(bytes(self.answer_bytes[kept_bytes:]))
        if len(tokens) > self.limit:
            tokens = tokens[: self.limit]
            self.answer_bytes = bytearray(b"".join(self.local.token_bytes(t) for t in tokens))
        common = common_prefix(self.answer_tokens, tokens)
        self.answer_tokens = tokens
        self.sources = self.sources[:common] + [source] * (len(tokens) - common)
        return common, bytes(self.answer_bytes[before:])

    def _retokenized_from(self) -> int:
        """The first answer token re-tokenized with upstream text: RETOKENIZED_TAIL back, moved to
        the start of a character (a token may end inside one)."""
        start = max(0, len(self.answer_tokens) - RETOKENIZED_TAIL)
        while start > 0 and self.local.token_bytes(self.answer_tokens[start])[:1] in CONTINUATION_BYTES:
            start -= 1
        return start
