"""The daemon's in-flight budget (:mod:`kvstore.daemon.server.inflight`): first come first served, a taker that
times out takes nothing and lets those behind it through, a cancelled taker leaves nothing taken."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.daemon.server.inflight import InflightBudget


def test_takers_wait_in_order_and_a_timed_out_one_takes_nothing() -> None:
    async def run() -> None:
        budget = InflightBudget(100)
        assert await budget.take(60, 1.0) and budget.used == 60
        big = asyncio.create_task(budget.take(80, 0.2))  # cannot fit until 60 are given back
        await asyncio.sleep(0.01)
        small = asyncio.create_task(budget.take(30, 5.0))  # would fit now, but waits behind the big one
        await asyncio.sleep(0.05)
        assert not small.done() and budget.used == 60
        assert await big is False  # timed out: nothing taken, and the one behind it goes through
        assert await small is True and budget.used == 90
        assert (budget.waited, budget.refused) == (2, 1)
        budget.give(90)
        assert budget.used == 0

    asyncio.run(run())


def test_a_cancelled_taker_leaves_nothing_taken_and_a_give_wakes_the_next() -> None:
    async def run() -> None:
        budget = InflightBudget(100)
        assert await budget.take(100, 1.0)
        waiting = asyncio.create_task(budget.take(50, 5.0))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        after = asyncio.create_task(budget.take(70, 5.0))
        await asyncio.sleep(0.01)
        budget.give(100)
        assert await after is True and budget.used == 70  # the cancelled one took nothing
        with pytest.raises(ValueError, match="can never fit"):
            await budget.take(101, 1.0)

    asyncio.run(run())
