"""OpenAI response bodies and stream chunks from decoder pieces."""

from __future__ import annotations

from typing import Any

from gateway.chat import Admitted
from gateway.decoder import Piece, TokenLogprob


def usage_of(admitted: Admitted) -> dict[str, Any]:
    decoding = admitted.decoding
    counts = decoding.source_counts()
    routing = decoding.usage
    return {
        "prompt_tokens": len(decoding.prompt_tokens),
        "completion_tokens": len(decoding.answer_tokens),
        "total_tokens": len(decoding.prompt_tokens) + len(decoding.answer_tokens),
        "routing": {
            "policy": routing.policy,
            "local_tokens": counts["local"],
            "upstream_tokens": counts["upstream"],
            "cache_tokens": counts["cache"],
            "guess_kept_tokens": routing.guess_kept_tokens,
            "upstream_calls": routing.upstream_calls,
            "upstream_prompt_tokens": routing.upstream_prompt_tokens,
            "upstream_completion_tokens": routing.upstream_completion_tokens,
            "upstream_cost_usd": round(routing.upstream_cost_usd, 8),
            "degraded": list(routing.degraded),
        },
    }


def routing_header(admitted: Admitted) -> str:
    """A one-line summary for the `x-routing-summary` response header."""
    routing = usage_of(admitted)["routing"]
    parts = [f"policy={routing['policy']}", f"local={routing['local_tokens']}", f"upstream={routing['upstream_tokens']}",
             f"cache={routing['cache_tokens']}", f"calls={routing['upstream_calls']}"]
    if routing["degraded"]:
        parts.append("degraded=" + ",".join(routing["degraded"]))
    return "; ".join(parts)


def _token_entry(token: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(token)}


def logprobs_of(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {**_token_entry(e.text, e.logprob), "top_logprobs": [_token_entry(text, lp) for _, text, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_body(admitted: Admitted, pieces: list[Piece]) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(p.text for p in pieces), "refusal": None},
        "finish_reason": admitted.decoding.finish_reason,
        "logprobs": None,
    }
    if admitted.body.logprobs:
        choice["logprobs"] = logprobs_of([e for p in pieces for e in p.logprobs])
    return {
        "id": admitted.id, "object": "chat.completion", "created": admitted.created, "model": admitted.body.model,
        "choices": [choice], "usage": usage_of(admitted), "system_fingerprint": None,
    }


def chunk(admitted: Admitted, delta: dict[str, Any], finish_reason: str | None = None,
          piece: Piece | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    if piece is not None and admitted.body.logprobs:
        choice["logprobs"] = logprobs_of(list(piece.logprobs))
    body: dict[str, Any] = {
        "id": admitted.id, "object": "chat.completion.chunk", "created": admitted.created,
        "model": admitted.body.model, "choices": [choice], "system_fingerprint": None,
    }
    if piece is not None:
        signal = piece.signal
        body["routing"] = {
            "source": piece.source,
            "entropy": round(signal.entropy, 6) if signal else None,
            "top1": round(signal.top1, 6) if signal else None,
        }
    return body


def usage_chunk(admitted: Admitted) -> dict[str, Any]:
    return {
        "id": admitted.id, "object": "chat.completion.chunk", "created": admitted.created,
        "model": admitted.body.model, "choices": [], "usage": usage_of(admitted), "system_fingerprint": None,
    }
