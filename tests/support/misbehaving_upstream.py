"""An OpenAI-shaped HTTP/1.1 upstream on raw asyncio sockets that misbehaves on request.

Imports none of the project's packages (STYLE.md B2). No HTTP framework: every byte on the
wire is the script's, so a test can make the faults a framework hides — an event split
inside a CRLF pair, ``[DONE]`` then a TCP reset, a chunked body that never terminates.

``GET /health``, ``/v1/models`` (lists ``llama-3.1-8b``) and ``/metrics`` always answer
(unless frozen); ``/health`` with `MisbehavingUpstream.health_status` (200 unless a test sets another). ``POST`` (any path) follows the request's headers — the gateway forwards
them — overridden per server by `MisbehavingUpstream.force` (a retry carries the same headers):

    x-scenario     json | sse (default: by the body's "stream") | status | silent (read the
                   request, answer nothing) | reset (RST at once) | close (FIN at once)
    x-status       for ``status``: the code (default 500), with an OpenAI error body
    x-error-type   for ``status``: the body's error type (default server_error) …
    x-error-message … and message (default "scripted <status>"), e.g. vLLM's context-length refusal
    x-delay-s      wait this long before the status line (slow first byte)
    x-prefill-s    wait this long after the headers before the first piece (a stream's
                   prefill: vLLM sends a stream's headers at once, its first event after it)
    x-newline      lf | crlf | cr: the SSE line ending (`upstream_wire.sse_events`)
    x-events       content events (default 3); ``x-usage: 0`` drops the usage chunk
    x-cuts         where the body is split into writes: byte offsets ("5,17"), or "all" (one
                   write); default one write per SSE event, the JSON body in one
    x-gap-s        wait between two writes, and before the end
    x-send-pieces  send only the first N pieces (0: the head alone)
    x-end          after the pieces: end (default: finish the body; keep-alive) | fin (close,
                   no chunked terminator) | reset (SO_LINGER 0: RST) | stall (silence, the
                   connection kept open until the peer closes it)

No ``100 Continue`` is ever sent: a body is read when it arrives. `freeze` makes it answer
nothing (``/health`` too) until `thaw`, like SIGSTOP; ``python -m tests.support.misbehaving_upstream
PORT`` runs it as a process to SIGSTOP. Every request is recorded (`Seen`), with when its peer
closed the connection.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.support.upstream_wire import (
    GETS,
    Conn,
    chunk,
    cut,
    error_body,
    event_offsets,
    head,
    json_body,
    sse_events,
)

STARTUP_TIMEOUT_S = 10.0
NOT_FOUND = b'{"detail": "Not Found"}'


@dataclass(eq=False)
class Seen:
    """One request as received (header names lower-cased), and the payload bytes sent back
    (without the chunked framing)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    conn: Conn
    received_s: float
    sent: bytes = b""

    @property
    def closed_s(self) -> float | None:
        """When the peer (the gateway) closed this request's connection (time.monotonic()); None while open."""
        return self.conn.closed_s


class MisbehavingUpstream:
    """The server, on 127.0.0.1 in a background thread (`start`, `stop`); see the module docstring."""

    def __init__(self, force: dict[str, str] | None = None, port: int = 0) -> None:
        self.force = dict(force or {})  # header values that override the request's, e.g. {"x-scenario": "silent"}
        self.health_status = 200  # what GET /health answers (a health check failing while requests are served)
        self.seen: list[Seen] = []
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thawed = asyncio.Event()
        self._stop = asyncio.Event()
        self._started = threading.Event()
        self._conns: dict[asyncio.StreamWriter, Conn] = {}
        self._thread = threading.Thread(target=self._run, daemon=True, name="misbehaving-upstream")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def posts(self) -> list[Seen]:
        """The POST requests (health probes and scrapes left out)."""
        return [s for s in self.seen if s.method == "POST"]

    def start(self) -> MisbehavingUpstream:
        self._thread.start()
        if not self._started.wait(STARTUP_TIMEOUT_S):  # set by the server thread once it listens
            raise TimeoutError("the misbehaving upstream did not start")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(STARTUP_TIMEOUT_S)

    def freeze(self) -> None:
        """Answer nothing more (new requests are read but neither recorded nor answered)."""
        self._call(self._thawed.clear)

    def thaw(self) -> None:
        self._call(self._thawed.set)

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server's loop; return once it has run."""
        self._loop.call_soon_threadsafe(fn)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result(STARTUP_TIMEOUT_S)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._thawed.set()
        server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        await self._stop.wait()
        self._thawed.set()
        # Stop accepting, but close the server only once every accepted connection has ended:
        # Python 3.11 leaks a socket accepted just before Server.close() (its _attach asserts).
        for sock in server.sockets:
            asyncio.get_running_loop().remove_reader(sock.fileno())
        await asyncio.sleep(0)  # one loop turn: an accept already scheduled runs; its task is awaited below
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (others := asyncio.all_tasks() - {asyncio.current_task()}) and time.monotonic() < deadline:
            for writer, conn in list(self._conns.items()):  # each handler then ends on its own
                conn.by_us = True
                writer.transport.abort()
            await asyncio.wait(others, timeout=0.05)  # then looks again for connections accepted meanwhile
        server.close()
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._conns[writer] = Conn()
        pump = asyncio.create_task(conn.pump(reader))
        try:
            while await self._one(conn, writer):
                pass
        except OSError:
            pass  # the peer went away while we wrote
        finally:
            conn.by_us = conn.by_us or not conn.closed.is_set()  # our close now is not the peer's
            writer.close()
            await asyncio.gather(pump, return_exceptions=True)  # ends at the close
            del self._conns[writer]

    async def _one(self, conn: Conn, writer: asyncio.StreamWriter) -> bool:
        """Read and answer one request; False when the connection is done."""
        request = await conn.read_request()
        if request is None:
            return False
        method, path, headers, body = request
        await self._thawed.wait()  # frozen: read, but neither recorded nor answered
        seen = Seen(method, path, headers, body, conn, time.monotonic())
        self.seen.append(seen)
        if method != "POST":
            payload, ctype = GETS.get(path, (NOT_FOUND, "application/json"))
            status = (self.health_status if path == "/health" else 200) if path in GETS else 404
            await self._write(writer, head(status, ctype, len(payload)) + payload)
            return True
        return await self._script(conn, writer, seen, {**headers, **self.force})

    async def _script(self, conn: Conn, writer: asyncio.StreamWriter, seen: Seen, h: dict[str, str]) -> bool:
        try:
            stream = json.loads(seen.body).get("stream") is True
        except (ValueError, AttributeError):
            stream = False
        scenario = h.get("x-scenario", "sse" if stream else "json")
        if await conn.pause(float(h.get("x-delay-s", "0"))):
            return False
        if scenario in ("reset", "close"):
            return conn.close(writer, reset=scenario == "reset")
        if scenario == "silent":
            await conn.closed.wait()
            return False
        if scenario == "status":
            status = int(h.get("x-status", "500"))
            seen.sent = error_body(status, h.get("x-error-type", "server_error"),
                                   h.get("x-error-message", f"scripted {status}"))
            await self._write(writer, head(status, "application/json", len(seen.sent)) + seen.sent)
            return True
        sse = scenario == "sse"
        if sse:
            events = sse_events(h.get("x-newline", "lf"), int(h.get("x-events", "3")), h.get("x-usage", "1") != "0")
            data, offsets = b"".join(events), event_offsets(events)
        else:
            data, offsets = json_body(), []
        await self._write(writer, head(200, "text/event-stream" if sse else "application/json",
                                       None if sse else len(data)))
        spec = h.get("x-cuts")
        if spec is not None:
            offsets = [] if spec == "all" else [int(x) for x in spec.split(",")]
        gap_s = float(h.get("x-gap-s", "0"))
        if await conn.pause(float(h.get("x-prefill-s", "0"))):
            return False
        for i, piece in enumerate(cut(data, offsets)[: int(h.get("x-send-pieces", "1000000"))]):
            if i and await conn.pause(gap_s):
                return False
            seen.sent += piece  # recorded before it goes out: the client may read it before this thread resumes
            await self._write(writer, chunk(piece) if sse else piece)
        end = h.get("x-end", "end")
        if seen.sent and await conn.pause(gap_s):  # the gap before the end too: a reset never races the data
            return False
        if end in ("fin", "reset"):
            return conn.close(writer, reset=end == "reset")
        if end == "stall":
            await conn.closed.wait()
            return False
        if sse:
            await self._write(writer, b"0\r\n\r\n")
        return "close" not in h.get("connection", "").lower()

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        await self._thawed.wait()
        writer.write(data)
        await writer.drain()


@contextmanager
def misbehaving_upstream(force: dict[str, str] | None = None) -> Iterator[MisbehavingUpstream]:
    """A started `MisbehavingUpstream`, stopped on exit."""
    upstream = MisbehavingUpstream(force).start()
    try:
        yield upstream
    finally:
        upstream.stop()


if __name__ == "__main__":
    MisbehavingUpstream(port=int(sys.argv[1])).start()
    threading.Event().wait()  # serve until a signal ends the process
