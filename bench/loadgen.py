"""Closed-loop HTTP load from its own process: N keep-alive connections, one request in flight each.

``bench/overhead.py`` runs one of these per measurement cell, so the load never shares an
event loop (or a GIL) with the server under test. It is made to cost the servers as little
CPU as possible on a 2-core machine: uvloop, one ``asyncio.Protocol`` per connection,
requests pre-encoded once, responses parsed by httptools (C; it handles chunked SSE). Each
latency is from the first byte written to the end of the response. It imports none of the
project's packages.

    python bench/loadgen.py '{"port": 8000, "path": "/v1/chat/completions", "bodies_file": "F",
                             "concurrency": 32, "requests": 2000, "warmup": 64, "max_s": 20,
                             "out_file": "R.json"}'

Writes one JSON object to ``out_file``: latencies_s (measured requests, in completion order), elapsed_s,
completed, warmup (requests before the measurement), errors (non-200 or dropped
connections), statuses (count per status code).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

import httptools
import uvloop


def load_bodies(path: str) -> list[bytes]:
    """Request bodies, one per line (JSON bodies hold no raw newline)."""
    with open(path, "rb") as f:
        return [line for line in f.read().split(b"\n") if line]


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; `request` sends one and waits for its whole response."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.lost = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, head: bytes, body: bytes) -> int:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head)
        self.transport.write(body)
        return await self.waiter


def _heads(port: int, path: str, bodies: list[bytes]) -> list[bytes]:
    return [(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
             f"Authorization: Bearer bench\r\nContent-Length: {len(b)}\r\n\r\n").encode() for b in bodies]


async def run(spec: dict) -> dict:
    """Warm up, then measure ``requests`` requests (or until ``max_s``) at ``concurrency``."""
    port, concurrency = spec["port"], spec["concurrency"]
    bodies = load_bodies(spec["bodies_file"])
    heads = _heads(port, spec["path"], bodies)
    loop = asyncio.get_running_loop()
    conns: list[_Connection] = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(_Connection, "127.0.0.1", port)
        conns.append(proto)
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    state = {"next": 0, "issued": 0, "errors": 0}

    async def worker(conn: _Connection, budget: int, deadline: float, record: bool) -> None:
        while state["issued"] < budget and time.perf_counter() < deadline:
            state["issued"] += 1
            i = state["next"] % len(bodies)
            state["next"] += 1
            start = time.perf_counter()
            try:
                if conn.lost:
                    raise ConnectionError("connection closed by the server")
                status = await conn.request(heads[i], bodies[i])
            except ConnectionError:
                state["errors"] += 1
                statuses[0] += 1
                _, conn = await loop.create_connection(_Connection, "127.0.0.1", port)
                continue
            if record:
                latencies.append(time.perf_counter() - start)
                statuses[status] += 1
                if status != 200:
                    state["errors"] += 1

    warm_deadline = time.perf_counter() + spec["max_s"]
    await asyncio.gather(*(worker(c, spec["warmup"], warm_deadline, False) for c in conns))
    warmed = state["issued"]
    state.update(issued=0, errors=0)
    statuses.clear()
    start = time.perf_counter()
    deadline = start + spec["max_s"]
    await asyncio.gather(*(worker(c, spec["requests"], deadline, True) for c in conns))
    elapsed = time.perf_counter() - start
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    return {"latencies_s": latencies, "elapsed_s": elapsed, "completed": len(latencies), "warmup": warmed,
            "errors": state["errors"], "statuses": {str(k): v for k, v in statuses.items()}}


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = json.dumps(uvloop.run(run(spec)))
    with open(spec["out_file"], "w", encoding="utf-8") as f:  # a file, not a pipe: results can be MBs
        f.write(result)


if __name__ == "__main__":
    main()
