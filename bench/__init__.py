"""Benchmarks that print measured ratios; helpers they share."""

from __future__ import annotations

import functools
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.memory_store import MemoryStore
from adapters.store import Limits
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.tenancy.budget import HandoffGate, Ledger


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


@dataclass(frozen=True)
class BatchedBenchRow:
    """One line of llama-batched-bench's table: prompt (PP) and generation (TG) time and speed."""

    t_pp: float
    s_pp: float
    t_tg: float
    s_tg: float


@functools.cache
def _tools_dir() -> str:
    root = Path(__file__).resolve().parent.parent
    return subprocess.run(["bash", str(root / "scripts/build-llama-tools.sh"), "llama-batched-bench"],
                          capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


def llama_batched_bench(model: Path, threads: int, prompt: int, generated: int, sequences: list[int],
                        context: int = 8192) -> dict[int, BatchedBenchRow]:
    """Run llama.cpp's own llama-batched-bench (built in setup's tree by scripts/build-llama-tools.sh)
    with `sequences` parallel sequences of `prompt` prompt and `generated` generated tokens each,
    batch = ubatch = 512; its rows by the number of sequences."""
    command = [f"{_tools_dir()}/llama-batched-bench", "-m", str(model), "-c", str(context), "-b", "512", "-ub", "512",
               "-npp", str(prompt), "-ntg", str(generated), "-npl", ",".join(map(str, sequences)),
               "-t", str(threads), "-tb", str(threads)]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():  # | PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | ...
            rows[int(cells[2])] = BatchedBenchRow(*map(float, cells[4:8]))
    if set(rows) != set(sequences):
        raise RuntimeError(f"llama-batched-bench printed no row for some of {sequences}:\n{output}")
    return rows
