"""A byte-limited LRU of KV-cache snapshots of prompt prefixes, for one llama.cpp context.

The context holds one sequence at a time; when requests with different system prompts take
turns, each switch would re-evaluate the whole prompt. A snapshot (llama_state_seq_* of sequence
0, far cheaper than llama-cpp-python's save_state, which also copies a logits array) lets a
prompt that shares a long prefix with an earlier one restore that KV and evaluate only the rest.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import llama_cpp

SEQUENCE = 0  # llama-cpp-python evaluates everything as sequence 0


class SnapshotRestoreFailed(Exception):
    """A snapshot could not be loaded; the context's KV state for the sequence is unknown."""


def common_prefix(held: list[int] | tuple[int, ...], tokens: list[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    if list(tokens[: len(held)]) == list(held):  # the usual case, checked at C speed
        return len(held)
    count, limit = 0, min(len(held), len(tokens))
    while count < limit and held[count] == tokens[count]:
        count += 1
    return count


class KVSnapshots:
    """Snapshots keyed by the tokens they hold; least recently used dropped past `limit_bytes`."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.hits = 0
        self._entries: OrderedDict[tuple[int, ...], bytes] = OrderedDict()

    def save(self, ctx, tokens: list[int]) -> None:
        """Snapshot the context, which must hold exactly `tokens`."""
        key = tuple(tokens)
        if self.limit_bytes <= 0 or key in self._entries:
            return
        size = llama_cpp.llama_state_seq_get_size(ctx, SEQUENCE)
        if size > self.limit_bytes:
            return
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, SEQUENCE)
        self._entries[key] = bytes(buffer)[:written]
        self.used_bytes += written
        while self.used_bytes > self.limit_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.used_bytes -= len(dropped)

    def restore_best(self, ctx, tokens: list[int], better_than: int) -> tuple[int, ...] | None:
        """Load the snapshot sharing the longest prefix with `tokens`, if it beats `better_than`.

        Returns the snapshot's tokens (the context now holds them), or None if none qualified.
        Raises SnapshotRestoreFailed if llama.cpp refused the data: the sequence is then in an
        unknown state and must be re-evaluated from scratch; the bad snapshot is dropped.
        """
        best, shared = None, better_than
        for key in self._entries:
            length = common_prefix(key, tokens)
            if length > shared:
                best, shared = key, length
        if best is None:
            return None
        data = self._entries[best]
        self._entries.move_to_end(best)
        source = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama_cpp.llama_state_seq_set_data(ctx, source, len(data), SEQUENCE) == 0:
            del self._entries[best]
            self.used_bytes -= len(data)
            raise SnapshotRestoreFailed(f"llama.cpp refused a {len(data)}-byte KV snapshot")
        self.hits += 1
        return best
