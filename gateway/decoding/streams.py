"""Async streams decoupled from their consumer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def merged(*sources: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Every source's items as (source index, item), in the order they are produced.

    Each source is drained by a task of its own into an unbounded queue, so a source never waits
    for the consumer (a slow client cannot hold up decoding). An exception in a source is raised
    here; closing this iterator cancels every source.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as exc:  # noqa: BLE001 - raised by the consumer below
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(drain(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _DONE:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
