"""OpenAI response bodies and stream chunks from decoder pieces."""

from __future__ import annotations

from typing import Any

from gateway.admission.chat import Admitted
from gateway.decoding.cost_ceiling import cost_ratio
from gateway.decoding.decoder import Piece, TokenLogprob


def usage_of(admitted: Admitted) -> dict[str, Any]:
    """Usage of all choices together (each prompt counted once, as OpenAI does)."""
    decodings = admitted.decodings
    counts = {source: sum(d.source_counts()[source] for d in decodings) for source in ("local", "upstream", "cache")}
    usages = [d.usage for d in decodings]
    prompt = sum(len(d.prompt_tokens) for d in decodings[::admitted.body.n])  # each prompt once (n choices each)
    completion = sum(len(d.answer_tokens) for d in decodings)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "routing": {
            "mode": "token_level",
            "policy": usages[0].policy,
            "local_tokens": counts["local"],
            "upstream_tokens": counts["upstream"],
            "cache_tokens": counts["cache"],
            "guess_kept_tokens": sum(u.guess_kept_tokens for u in usages),
            "upstream_calls": sum(u.upstream_calls for u in usages),
            "upstream_prompt_tokens": sum(u.upstream_prompt_tokens for u in usages),
            "upstream_completion_tokens": sum(u.upstream_completion_tokens for u in usages),
            "upstream_cached_tokens": sum(u.upstream_cached_tokens for u in usages),
            "upstream_compute_ms": round(sum(u.upstream_compute_ms for u in usages), 1),
            "upstream_cost_usd": round(sum(u.upstream_cost_usd for u in usages), 8),
            "upstream_predicted_cost_usd": round(sum(u.predicted_cost_usd for u in usages), 8),
            "cost_ratio": cost_ratio(decodings),
            "escalated": any(u.escalated for u in usages),
            "afresh": sum(u.afresh for u in usages),
            "discarded_tokens": sum(u.discarded_tokens for u in usages),
            "answer_confidence": _confidence(usages),
            **_agreement(usages),
            "price_vetoes": sum(u.price_vetoes for u in usages),
            "draft_hand_offs": sum(u.draft_hand_offs for u in usages),
            **_combined(usages),
            "degraded": list(dict.fromkeys(reason for u in usages for reason in u.degraded)),
        },
    }


def _combined(usages: list[Any]) -> dict[str, Any]:
    """Routed steps by how their token was chosen (taken, agreed, changed, fell_back), where any was."""
    counts: dict[str, int] = {}
    for usage in usages:
        for how, count in usage.combined.items():
            counts[how] = counts.get(how, 0) + count
    return {"combined": counts} if counts else {}


def _confidence(usages: list[Any]) -> float | list[float] | None:
    """The answer check's rating of the local answer (one per choice for n > 1; None without a check)."""
    rated = [u.answer_confidence for u in usages]
    if all(r is None for r in rated):
        return None
    return rated[0] if len(rated) == 1 else rated


def _agreement(usages: list[Any]) -> dict[str, Any]:
    """The agreement check's figures (none without one): answers decoded per choice, each choice's
    agreement and whether it kept the majority's sampled answer (one value each for n = 1), and the
    local tokens the sampled answers took."""
    rated = [u.agreement for u in usages]
    if all(r is None for r in rated):
        return {}
    majority = [u.majority for u in usages]
    return {"samples": usages[0].samples, "agreement": rated[0] if len(rated) == 1 else rated,
            "majority": majority[0] if len(majority) == 1 else majority,
            "sample_tokens": sum(u.sample_tokens for u in usages)}


def routing_header(admitted: Admitted) -> str:
    """A one-line summary for the `x-routing-summary` response header."""
    routing = usage_of(admitted)["routing"]
    parts = [f"policy={routing['policy']}", f"local={routing['local_tokens']}", f"upstream={routing['upstream_tokens']}",
             f"cache={routing['cache_tokens']}", f"calls={routing['upstream_calls']}"]
    if routing["afresh"]:
        parts.append(f"afresh={routing['afresh']}")
    elif routing["escalated"]:
        parts.append("escalated=1")
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


def completion_body(admitted: Admitted, pieces: list[list[Piece]]) -> dict[str, Any]:
    """The response body; `pieces` holds each choice's pieces."""
    choices = []
    for index, (decoding, chosen) in enumerate(zip(admitted.decodings, pieces)):
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": "".join(p.text for p in chosen), "refusal": None},
            "finish_reason": decoding.finish_reason,
            "logprobs": None,
        }
        if admitted.body.logprobs:
            choice["logprobs"] = logprobs_of([e for p in chosen for e in p.logprobs])
        choices.append(choice)
    return {
        "id": admitted.id, "object": "chat.completion", "created": admitted.created, "model": admitted.body.model,
        "choices": choices, "usage": usage_of(admitted), "system_fingerprint": None,
    }


def chunk(admitted: Admitted, delta: dict[str, Any], finish_reason: str | None = None,
          piece: Piece | None = None, index: int = 0) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
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
