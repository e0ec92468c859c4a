"""The KV-event publisher's fault knobs (`mock_vllm.kv_events`), for the gateway's subscriber tests.

* ``GET /kappa/faults/kv_events``: the publisher's state (`ZmqEventPublisher.state`): running,
  bound addresses, next sequence number, pending knobs, buffered range, counters.
* ``POST /kappa/faults/kv_events`` ``{"drop_next_batches": int >= 0, "reorder_next_two": bool,
  "publisher": "stop" | "start" | null}`` (every key optional): drop the next N batches (added to
  any still pending; they are buffered for replay, not sent), hold the next batch and send it after
  the one that follows, close or reopen both sockets. Answers the state.
* ``DELETE /kappa/faults/kv_events``: no pending drops or reordering (a held batch is sent), and the
  publisher running again. Answers the state.

* ``GET /kappa/kv_events/blocks``: the engine's resident cached blocks by the hashes its events use
  (`EngineKvEvents.resident_blocks`) and the publisher's ``next_seq``, read in one step of the loop, so
  a test can check a subscriber's index against the engine's own cache by value.

Every route answers 404 (vLLM's error body) when the mock publishes no KV events.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from mock_vllm.kv_events import EngineKvEvents, ZmqEventPublisher
from mock_vllm.openai_api import ApiError

PATH = "/kappa/faults/kv_events"
BLOCKS_PATH = "/kappa/kv_events/blocks"
routes = APIRouter()


class KvEventsFault(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drop_next_batches: Annotated[int, Field(ge=0)] = 0
    reorder_next_two: bool = False
    publisher: Literal["stop", "start"] | None = None


def _events(request: Request) -> EngineKvEvents:
    events = request.state.mock.kv_events
    if events is None:
        raise ApiError(404, "This server publishes no KV events (start it with --kv-events-config).")
    return events


def _publisher(request: Request) -> ZmqEventPublisher:
    return _events(request).publisher


@routes.get(BLOCKS_PATH)
async def resident_blocks(request: Request) -> dict[str, Any]:
    events = _events(request)
    return {**events.resident_blocks(), "next_seq": events.publisher.state()["next_seq"]}


@routes.get(PATH)
async def kv_events_state(request: Request) -> dict[str, Any]:
    return _publisher(request).state()


@routes.post(PATH)
async def set_kv_events_fault(body: KvEventsFault, request: Request) -> dict[str, Any]:
    publisher = _publisher(request)
    if body.publisher == "stop":
        await publisher.stop()
    elif body.publisher == "start":
        await publisher.start()
    publisher.drop_next(body.drop_next_batches)
    if body.reorder_next_two:
        publisher.reorder_next_two()
    return publisher.state()


@routes.delete(PATH)
async def clear_kv_events_faults(request: Request) -> dict[str, Any]:
    publisher = _publisher(request)
    await publisher.start()
    publisher.clear_faults()  # a held batch goes out on the reopened socket
    return publisher.state()
