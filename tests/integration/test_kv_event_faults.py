"""Issue 30's fault list, in process: a real mock publishing KV events (b0) and a plain mock (b1) under a
real gateway. Each fault — the subscriber's task cancelled, the publisher stopped and started, two
batches swapped — ends with the gateway's exact index holding exactly the engine's resident blocks
(`kv_events_support.assert_index_is_engine`), and no request through the gateway failing meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.integration.gateway_support import Gateway, backend_doc, poll, run_gateway, run_mocks
from tests.integration.kv_events_support import (
    EventMock,
    Prompts,
    Traffic,
    assert_index_is_engine,
    event_mock,
    kv_view,
    wait_exact,
)

pytestmark = pytest.mark.integration


@dataclass
class Rig:
    mock: EventMock
    gw: Gateway
    prompts: Prompts
    traffic: Traffic


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with event_mock() as mock, run_mocks(1) as (plain,), \
            run_gateway([backend_doc("b0", mock.url, kv_events=mock.kv_events_entry()), backend_doc("b1", plain)]) as gw:
        wait_exact(gw, "b0")
        yield Rig(mock, gw, Prompts(seed=31), Traffic(gw))


def warm(rig: Rig, n: int = 10) -> None:
    for _ in range(n):
        rig.mock.complete(rig.prompts.next())
    assert_index_is_engine(rig.gw, rig.mock.http, "b0")


def test_a_cancelled_subscriber_task_is_started_again_and_catches_up(rig: Rig) -> None:
    warm(rig)
    fleet = rig.gw.app.state.gateway.kv_events
    task = fleet.tasks["b0"]
    task.get_loop().call_soon_threadsafe(task.cancel)
    for _ in range(10):  # published while the subscriber is down or catching up
        rig.mock.complete(rig.prompts.next())
        assert rig.traffic.send(rig.prompts.next()) == 200
    poll(lambda: task.done() and fleet.tasks["b0"] is not task, "a new subscriber task")
    assert_index_is_engine(rig.gw, rig.mock.http, "b0")
    assert kv_view(rig.gw, "b0")["task_restarts"] == 1
    assert rig.traffic.failed == 0


def test_a_stopped_publisher_leaves_a_gap_that_is_replayed_when_it_starts(rig: Rig) -> None:
    warm(rig)
    before = kv_view(rig.gw, "b0")["batches"]
    stopped_at = rig.mock.fault(publisher="stop")["next_seq"]
    poll(lambda: kv_view(rig.gw, "b0")["mode"] == "approximate", "b0 approximate: its publisher is gone")
    for _ in range(20):
        rig.mock.complete(rig.prompts.next())
        assert rig.traffic.send(rig.prompts.next()) == 200
    assert rig.mock.fault(publisher="start")["next_seq"] >= stopped_at + 20
    rig.mock.complete(rig.prompts.next())
    assert_index_is_engine(rig.gw, rig.mock.http, "b0")
    assert kv_view(rig.gw, "b0")["batches"]["replayed"] - before["replayed"] >= 20
    assert rig.traffic.failed == 0


def test_swapped_batches_leave_the_index_exact(rig: Rig) -> None:
    warm(rig)
    before = kv_view(rig.gw, "b0")["batches"]
    for _ in range(5):
        assert rig.mock.fault(reorder_next_two=True)["reorder_armed"]
        rig.mock.complete(rig.prompts.next())  # held
        rig.mock.complete(rig.prompts.next())  # sent, then the held one
        assert rig.traffic.send(rig.prompts.next()) == 200
        assert_index_is_engine(rig.gw, rig.mock.http, "b0")
    after = kv_view(rig.gw, "b0")["batches"]
    assert after["gap"] - before["gap"] == 5 and after["duplicate"] - before["duplicate"] == 5
    assert rig.traffic.failed == 0


def test_the_same_prompt_twice_at_once_is_one_block_in_the_index(rig: Rig) -> None:
    """Two requests computing the same blocks in one step: the mock keeps one copy of each (it
    de-duplicates on sealing), so it must announce one store, or the index keeps a second copy that no
    removal ever takes away."""
    warm(rig)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(10):
            tokens = rig.prompts.next()
            list(pool.map(rig.mock.complete, [tokens, tokens]))
    for _ in range(30):  # evicts the doubled blocks from HBM and the host tier
        rig.mock.complete(rig.prompts.next())
    assert_index_is_engine(rig.gw, rig.mock.http, "b0")
