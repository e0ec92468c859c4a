"""Asking a vLLM engine to replay the KV-event batches a subscriber missed (its ROUTER socket).

Protocol (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``): the client
sends the first sequence number it wants as 8 bytes big-endian, behind an empty delimiter frame
(the ROUTER sees ``[identity, b"", start_seq]``); the engine answers with every buffered batch
from that number on, one message each, in order, then an end marker whose seq is -1 (8 signed
bytes). Two reply shapes are in use, and both are read: vLLM before its topic frame on replies
sends ``[b"", seq, payload]`` and ``[b"", END, b""]``; current vLLM (and the mock) sends
``[b"", topic, seq, payload]`` and ``[b"", b"", END, b""]``. The last two frames are always seq
and payload. A REQ socket accepts one reply only, so the
client is a DEALER that sends the delimiter itself. vLLM keeps the last ``buffer_steps`` batches
(10,000 by default): a start older than that is answered from the oldest it still has.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from prefix_index.engine_events import REPLAY_END_SEQ, MalformedEvents, decode_seq, encode_seq

__all__ = ["ReplayFailed", "replay"]


class ReplayFailed(Exception):
    """The replay endpoint did not answer in time, or answered out of protocol."""


async def replay(context: zmq.asyncio.Context, endpoint: str, from_seq: int, *,
                 timeout_s: float) -> list[tuple[int, bytes]]:
    """The batches the engine still buffers from ``from_seq`` on, in order.

    Args:
        context: the gateway's ZMQ context.
        endpoint: the engine's replay (ROUTER) address, ``tcp://host:port``.
        from_seq: the first sequence number wanted, >= 0.
        timeout_s: the longest wait for each message of the answer, in seconds.

    Returns:
        ``(seq, payload)`` per batch, seqs increasing (possibly starting after ``from_seq``: the
        buffer lost the older ones), empty when the engine has nothing from ``from_seq`` on.

    Raises:
        ReplayFailed: no answer within ``timeout_s`` (an endpoint down, or no ROUTER there), or a
            message that is not ``[b"", seq, payload]``.
    """
    dealer = context.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        dealer.connect(endpoint)
        await dealer.send_multipart([b"", encode_seq(from_seq)])
        out: list[tuple[int, bytes]] = []
        while True:
            try:
                frames = await asyncio.wait_for(dealer.recv_multipart(), timeout_s)
            except TimeoutError:
                raise ReplayFailed(f"no replay answer from {endpoint} within {timeout_s:g} s") from None
            if len(frames) not in (3, 4) or frames[0]:
                raise ReplayFailed(f"replay answer of {len(frames)} frames from {endpoint}, expected "
                                   "[b'', seq, payload] or [b'', topic, seq, payload]")
            try:
                seq = decode_seq(frames[-2])
            except MalformedEvents as exc:
                raise ReplayFailed(f"replay answer from {endpoint}: {exc}") from None
            if seq == REPLAY_END_SEQ:
                return out
            if out and seq <= out[-1][0]:
                raise ReplayFailed(f"replay from {endpoint} went back from seq {out[-1][0]} to {seq}")
            out.append((seq, frames[-1]))
    except zmq.ZMQError as exc:
        raise ReplayFailed(f"replay from {endpoint} failed: {exc}") from exc
    finally:
        dealer.close(linger=0)
