"""Benchmarks that print measured ratios; helpers they share."""

from __future__ import annotations

import time
from typing import Any

from adapters.store import Limits, MemoryStore
from gateway.admission.budget import HandoffGate, Ledger
from gateway.decoding.decoder import DecodeRequest, Decoding


def decoding_for(local: Any, upstream: Any, request: DecodeRequest) -> Decoding:
    """A decoding with an unlimited budget of its own (upstream allowed when there is one)."""
    gate = HandoffGate(Ledger(MemoryStore()), "bench", Limits(), allowed=upstream is not None)
    return Decoding(local, upstream, gate, request)


async def timed(decoding: Decoding) -> float:
    """Decode to the end; the wall seconds it took."""
    started = time.perf_counter()
    async for _ in decoding.pieces():
        pass
    return time.perf_counter() - started
