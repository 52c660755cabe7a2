"""The local engine's slot queue: a request with many sequences never keeps another request waiting
for the engine, and no tenant goes ahead of one holding fewer sequences."""

from __future__ import annotations

import asyncio

import pytest

from adapters.slot_queue import Claim, QueueFull, SlotQueue


def first_free(free: list[int]) -> int:
    return free[0]


async def granted(queue: SlotQueue, claim: Claim) -> asyncio.Task:
    """`claim`'s take, started; it has run up to its first wait."""
    task = asyncio.ensure_future(queue.take(claim, first_free))
    await asyncio.sleep(0)
    return task


async def test_a_request_never_takes_the_last_free_slot_while_it_holds_one():
    queue, heavy = SlotQueue(4, queue_limit=16), Claim("a", "heavy")
    sequences = [await granted(queue, heavy) for _ in range(8)]
    assert [task.done() for task in sequences] == [True, True, True] + [False] * 5
    newcomer = await granted(queue, Claim("b", "small"))
    assert newcomer.done() and queue.held == 4


async def test_a_freed_slot_goes_to_a_new_request_before_a_holding_requests_extras():
    queue, heavy = SlotQueue(2, queue_limit=16), Claim("a", "heavy")
    first, extra = await granted(queue, heavy), await granted(queue, heavy)
    other, newcomer = await granted(queue, Claim("b", "other")), await granted(queue, Claim("c", "small"))
    assert first.done() and other.done() and not extra.done() and not newcomer.done()
    queue.give_back(other.result())
    await asyncio.sleep(0)
    assert newcomer.done() and not extra.done()


async def test_a_request_holding_nothing_gets_its_extras_even_with_one_slot():
    queue, claim = SlotQueue(1, queue_limit=0), Claim("a", "r")
    first, second = await granted(queue, claim), await granted(queue, claim)
    assert first.done() and not second.done()
    queue.give_back(first.result())
    await asyncio.sleep(0)
    assert second.result() == 0


async def test_the_tenant_holding_fewest_slots_goes_first():
    queue = SlotQueue(3, queue_limit=16)
    held = [await granted(queue, Claim("busy", f"r{i}")) for i in range(2)] + [await granted(queue, Claim("idle", "x"))]
    busy, idle = await granted(queue, Claim("busy", "r9")), await granted(queue, Claim("idle", "y"))
    queue.give_back(held[2].result())
    await asyncio.sleep(0)
    assert idle.done() and not busy.done()  # "busy" holds two slots, "idle" none: the later waiter goes first
    queue.give_back(held[0].result())
    await asyncio.sleep(0)
    assert busy.done()


async def test_queue_full_counts_requests_waiting_for_their_first_slot_not_extras():
    queue, heavy = SlotQueue(2, queue_limit=2), Claim("a", "heavy")
    for _ in range(40):
        await granted(queue, heavy)
    await granted(queue, Claim("b", "b1"))  # takes the last slot
    queue.check_admission()  # 39 extras wait, but a newcomer would wait behind none of them
    for name in ("c1", "c2"):
        await granted(queue, Claim("c", name))
    with pytest.raises(QueueFull):
        queue.check_admission()


async def test_a_waiter_cancelled_before_or_after_its_grant_leaves_no_slot_held():
    queue = SlotQueue(1, queue_limit=16)
    holder = await granted(queue, Claim())
    waiting = await granted(queue, Claim())
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert queue.waiting == 0
    late = await granted(queue, Claim())
    queue.give_back(holder.result())  # granted to `late`, which is cancelled before it runs
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)
    assert queue.held == 0 and (await granted(queue, Claim())).done()


async def test_a_requests_extras_wait_while_another_request_holds_a_slot():
    queue, heavy = SlotQueue(4, queue_limit=16), Claim("a", "heavy")
    first, other = await granted(queue, heavy), await granted(queue, Claim("b", "other"))
    extra = await granted(queue, heavy)
    assert first.done() and other.done() and not extra.done() and queue.held == 2  # two slots stay free
    queue.give_back(other.result())
    await asyncio.sleep(0)
    assert extra.done()  # alone again: it takes the batch
