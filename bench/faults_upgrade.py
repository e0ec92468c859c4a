"""The ``upgrade_flood`` fault of `faults.py` (issue 28): Upgrade requests up to the connection cap.

At t0 ``FLOOD_CAP`` connections open at once, as fast as the loop can, each sending one
``POST /v1/chat/completions`` with ``Connection: Upgrade`` + ``Upgrade: websocket`` and a whole
JSON body, then nothing more: the cheap denial of service of issue 28 item 2 (before the fix
uvicorn handed each to its WebSocket protocol, which never answered a POST nor closed, so they
held the cap and every other client got 503). Each flood connection reads until the gateway
closes it. Its **deadline** is the longest bound that may apply to it, counted from its last
byte sent: the head, body and keep-alive timeouts this fault sets (`flood_gateway_keys`), the
largest of them plus ``DEADLINE_SLACK_S``. A connection still open then is **left open past its
deadline** (must be 0). Meanwhile a liveness probe opens a fresh connection to ``/health`` on
the admin port (``gateway.admin_port``, as a kubelet's probe would) every ``HEALTH_EVERY_S``:
its latency during the flood must stay within ``HEALTH_BOUND_S`` (100 ms). The window closes
``post_s`` after the last flood connection ended (or its deadline passed).

Notes (`FLOOD_NOTES`): ``flood_connections``, ``flood_answered`` (got a response head: 200 when
answered, 503 when refused at the cap), ``flood_refused``, ``left_open_past_deadline``,
``health_p50_ms``, ``health_max_ms``, ``health_failed`` (probes not answered 200), ``health_probes``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from typing import Any

FLOOD_CAP = 256  # the gateway's max_client_connections in this bench, and the flood's size
FLOOD_TIMEOUT_S = 3.0  # head, body and keep-alive timeouts while flooding
DEADLINE_SLACK_S = 2.0
HEALTH_EVERY_S = 0.05
HEALTH_BOUND_S = 0.1
FLOOD_NOTES = ("flood_connections", "flood_answered", "flood_refused", "left_open_past_deadline", "health_p50_ms",
               "health_max_ms", "health_failed")

_BODY = json.dumps({"model": "llama-3.1-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
           b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           b"Sec-WebSocket-Version: 13\r\nContent-Length: %d\r\n\r\n" % len(_BODY)) + _BODY


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flood_gateway_keys() -> dict[str, Any]:
    """The gateway: keys this fault needs: the cap, an admin port, and short read and keep-alive
    timeouts (the deadlines it checks)."""
    return {"max_client_connections": FLOOD_CAP, "admin_port": _free_port(),
            "client_header_timeout_s": FLOOD_TIMEOUT_S, "client_body_timeout_s": FLOOD_TIMEOUT_S,
            "keep_alive_timeout_s": FLOOD_TIMEOUT_S}


async def _flood_one(port: int, deadline_s: float) -> tuple[bool, int | None]:
    """(closed within its deadline, the status of the answer or None)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True, None  # refused at the listener: nothing held
    status = None
    try:
        writer.write(REQUEST)
        await writer.drain()
        async with asyncio.timeout(deadline_s):
            data = b""
            while chunk := await reader.read(65536):
                data += chunk
                if status is None and data.startswith(b"HTTP/1.1 ") and len(data) >= 12:
                    status = int(data[9:12])
        return True, status
    except (ConnectionError, OSError):
        return True, status  # reset by the gateway: closed
    except TimeoutError:
        return False, status
    finally:
        writer.close()


async def _health_probes(port: int, stop: asyncio.Event, samples: list[tuple[float, int]]) -> None:
    while not stop.is_set():
        started = time.monotonic()
        status = 0
        try:
            async with asyncio.timeout(1.0):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                writer.close()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass
        samples.append((time.monotonic() - started, status))
        await asyncio.sleep(HEALTH_EVERY_S)  # the probe's period


async def upgrade_flood(run: Any, w: Any) -> Any:
    """The fault, as a `faults.Run` method: flood, probe liveness, then the post-fault load."""
    section = run.fleet.config["gateway"]
    deadline_s = max(section["client_header_timeout_s"], section["client_body_timeout_s"],
                     section["keep_alive_timeout_s"]) + DEADLINE_SLACK_S
    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    prober = asyncio.create_task(_health_probes(section["admin_port"], stop, samples))
    w.t0 = run.clock()
    results = await asyncio.gather(*(_flood_one(section["port"], deadline_s) for _ in range(FLOOD_CAP)))
    stop.set()
    await prober
    w.notes["resumed_s"] = round(run.clock() - w.t0, 2)
    latencies = [s for s, status in samples if status == 200]
    w.notes.update(
        flood_connections=len(results), flood_answered=sum(status is not None for _, status in results),
        flood_refused=sum(status == 503 for _, status in results),
        left_open_past_deadline=sum(not closed for closed, _ in results), health_probes=len(samples),
        health_failed=len(samples) - len(latencies),
        health_p50_ms=round(statistics.median(latencies) * 1000, 1) if latencies else None,
        health_max_ms=round(max(latencies) * 1000, 1) if latencies else None)
    return await run._post(w)  # noqa: SLF001 -- the Run's own post-fault phase
