"""FCFS admission under max_num_seqs: caps running sequences, counts the rest as waiting."""

from __future__ import annotations

import asyncio

import pytest

from beam_rl.standin.admission import Admission


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_cap_and_fifo_order():
    async def scenario():
        admission = Admission(max_num_seqs=3)
        order: list[str] = []

        async def run(name: str, n: int, hold: asyncio.Event) -> None:
            await admission.acquire(n)
            order.append(name)
            await hold.wait()
            admission.release(n)

        holds = {name: asyncio.Event() for name in "abcd"}
        tasks = [asyncio.create_task(run("a", 2, holds["a"]))]
        await _settle()
        tasks.append(asyncio.create_task(run("b", 2, holds["b"])))  # 2 + 2 > 3: waits
        await _settle()
        tasks.append(asyncio.create_task(run("c", 1, holds["c"])))  # would fit, but FIFO: waits behind b
        await _settle()
        assert (order, admission.running, admission.waiting) == (["a"], 2, 3)
        holds["a"].set()
        await _settle()
        assert (order, admission.running, admission.waiting) == (["a", "b", "c"], 3, 0)
        tasks.append(asyncio.create_task(run("d", 5, holds["d"])))  # larger than the cap
        holds["b"].set()
        holds["c"].set()
        await _settle()
        # A request larger than the cap runs alone instead of waiting forever.
        assert (order[-1], admission.running, admission.max_running) == ("d", 5, 5)
        holds["d"].set()
        await asyncio.gather(*tasks)
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_queue_and_unblocks_others():
    async def scenario():
        admission = Admission(max_num_seqs=2)
        await admission.acquire(1)
        big = asyncio.create_task(admission.acquire(2))  # waits: 1 + 2 > 2
        await _settle()
        small = asyncio.create_task(admission.acquire(1))  # FIFO: queued behind the big one
        await _settle()
        assert admission.waiting == 3
        big.cancel()
        await _settle()
        assert big.cancelled() and small.done()
        assert (admission.running, admission.waiting) == (2, 0)

    asyncio.run(scenario())


def test_drained_waits_for_running_and_queued():
    async def scenario():
        admission = Admission(max_num_seqs=1)
        await admission.acquire(1)
        queued = asyncio.create_task(admission.acquire(1))
        drained = asyncio.create_task(admission.drained())
        await _settle()
        admission.release(1)  # hands the slot to the queued request: not drained yet
        await _settle()
        assert queued.done() and not drained.done()
        admission.release(1)
        await _settle()
        assert drained.done()

    asyncio.run(scenario())


def test_invalid_cap():
    with pytest.raises(ValueError, match="max_num_seqs"):
        Admission(0)


def test_busy_seconds_count_only_time_with_something_running():
    async def scenario():
        admission = Admission(2)
        assert admission.busy_seconds == 0.0
        await admission.acquire(1)
        await asyncio.sleep(0.05)
        admission.release(1)
        busy = admission.busy_seconds
        await asyncio.sleep(0.05)  # idle: not counted
        return busy, admission.busy_seconds

    busy, later = asyncio.run(scenario())
    assert busy >= 0.04 and later == busy  # asyncio.sleep(0.05) ran with one sequence in
