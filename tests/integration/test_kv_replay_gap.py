"""Issue 30's Done-when: "a replay gap of 1,000 events is repaired without losing a block" — a real mock
(24 HBM blocks, an 8-block host tier: the traffic evicts, offloads and reloads) publishing vLLM's KV
events, a real gateway subscribed to it. The mock drops the next 1,000 batches (buffered for replay,
never sent); the next batch shows the gap; the gateway replays and its exact index then holds exactly
the engine's resident blocks, by value (`kv_events_support.assert_index_is_engine`).
"""

from __future__ import annotations

import pytest

from tests.integration.gateway_support import backend_doc, run_gateway
from tests.integration.kv_events_support import (
    FAULTS,
    Prompts,
    assert_index_is_engine,
    engine_blocks,
    event_mock,
    kv_view,
    wait_exact,
)

pytestmark = pytest.mark.integration

GAP = 1_000


def test_a_gap_of_1000_batches_is_replayed_without_losing_a_block() -> None:
    prompts = Prompts(seed=30)
    with event_mock(buffer_steps=2 * GAP) as mock, \
            run_gateway([backend_doc("b0", mock.url, kv_events=mock.kv_events_entry())]) as gw:
        wait_exact(gw, "b0")
        for _ in range(40):
            mock.complete(prompts.next())
        assert_index_is_engine(gw, mock.http, "b0")
        before = kv_view(gw, "b0")["batches"]

        start = mock.fault(drop_next_batches=GAP)["next_seq"]
        while mock.http.get(FAULTS).json()["drop_next_batches"]:  # every request completes a block: a batch
            mock.complete(prompts.next())
        state = mock.http.get(FAULTS).json()
        assert state["next_seq"] - start == GAP and state["fault_dropped_batches_total"] == GAP
        assert kv_view(gw, "b0")["last_seq"] == start - 1  # the gateway heard none of them

        mock.complete(prompts.next())  # sent: the gateway sees seq start + GAP, a gap of GAP
        assert_index_is_engine(gw, mock.http, "b0")
        after = kv_view(gw, "b0")["batches"]
        assert after["gap"] - before["gap"] == 1
        assert after["replayed"] - before["replayed"] == GAP + 1  # the lost ones and the one that showed the gap
        engine = engine_blocks(mock.http)
        # Nearly full HBM (a freed partial block is anonymous) and a full host tier: blocks came and went meanwhile.
        assert len(engine["GPU"]) >= 20 and len(engine["CPU"]) == 8
