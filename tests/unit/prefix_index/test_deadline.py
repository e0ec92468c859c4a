"""`prefix_index.deadline.Deadline`: it expires on a silent store, not on a stalled loop.

The stalls are real (``time.sleep`` inside a callback holds the loop, as CPU-bound work
does); the "store" is a future resolved by a loop callback, as a socket read resolves
one. ``asyncio.timeout`` is run beside it on the same script to show the difference.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from prefix_index.deadline import GRACE_RATIO, Deadline

BUDGET_S = 0.02


async def wait_with(make_timeout, answer_after_s: float | None, stall_s: float) -> tuple[bool, float]:
    """Await a future the loop resolves ``answer_after_s`` after the start (never if None), while
    the loop is stalled for ``stall_s`` right away. Returns (timed out, elapsed seconds)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()
    if answer_after_s is not None:
        loop.call_later(answer_after_s, future.set_result, "answer")
    if stall_s:
        loop.call_soon(time.sleep, stall_s)  # a CPU-bound callback holding the loop
    start = time.monotonic()
    try:
        async with make_timeout(BUDGET_S):
            await future
    except TimeoutError:
        return True, time.monotonic() - start
    return False, time.monotonic() - start


async def test_an_answer_that_came_during_a_stall_is_not_a_timeout() -> None:
    # The store answers after 1 ms; the loop is held for 2.5 budgets from the start, so it
    # reads the answer and finds the budget passed in the same pass.
    timed_out, elapsed = await wait_with(Deadline, answer_after_s=0.001, stall_s=2.5 * BUDGET_S)
    assert not timed_out and elapsed >= 2.5 * BUDGET_S
    # asyncio.timeout, on the same script, cancels the call whose answer had arrived.
    timed_out, _ = await wait_with(asyncio.timeout, answer_after_s=0.001, stall_s=2.5 * BUDGET_S)
    assert timed_out


async def test_however_long_the_stall_an_answer_that_came_during_it_counts() -> None:
    timed_out, _ = await wait_with(Deadline, answer_after_s=0.001, stall_s=10 * BUDGET_S)
    assert not timed_out


async def test_a_silent_store_times_out_after_budget_and_grace() -> None:
    timed_out, elapsed = await wait_with(Deadline, answer_after_s=None, stall_s=0)
    assert timed_out
    assert BUDGET_S * (1 + GRACE_RATIO) <= elapsed < BUDGET_S * 2


async def test_a_late_answer_within_the_grace_counts_and_one_after_it_does_not() -> None:
    timed_out, _ = await wait_with(Deadline, answer_after_s=BUDGET_S * (1 + GRACE_RATIO / 4), stall_s=0)
    assert not timed_out
    timed_out, _ = await wait_with(Deadline, answer_after_s=BUDGET_S * 3, stall_s=0)
    assert timed_out


async def test_a_silent_store_behind_a_loop_that_stays_busy_still_times_out() -> None:
    loop = asyncio.get_running_loop()
    busy = True

    def stall_again() -> None:  # the behaviour under test: a loop that never runs a timer on time (6 ms stalls)
        time.sleep(0.006)
        if busy:
            loop.call_soon(stall_again)

    loop.call_soon(stall_again)
    try:
        timed_out, elapsed = await wait_with(Deadline, answer_after_s=None, stall_s=0)
    finally:
        busy = False
    assert timed_out
    assert elapsed < 0.5  # budget and grace, each late by a stall or two; not re-armed for ever


def test_bad_budgets_are_refused() -> None:
    for budget, grace in ((0.0, None), (float("inf"), None), (-1.0, None), (1.0, -0.1), (1.0, float("nan"))):
        with pytest.raises(ValueError):
            Deadline(budget, grace)
