"""``Upgrade`` requests answered as plain HTTP/1.1: the gateway offers no protocol switch.

RFC 9110 §7.8: "A server MAY ignore a received Upgrade header field if it wishes to continue
using the current protocol on that connection. Upgrade cannot be used to insist on a protocol
change." The gateway serves no WebSocket route and no HTTP/2 over cleartext (RFC 9113 §3.1
deprecates the ``h2c`` upgrade), so it ignores every ``Upgrade``: the request is read and
answered as if the header had not been sent (what uvicorn does for ``h2c`` since 0.19, and
what nginx and Envoy do for upgrade types not enabled by ``proxy_set_header Upgrade`` /
``upgrade_configs``).

Why the head is parsed twice: llhttp (httptools 0.7) treats a request with ``Connection:
upgrade`` and an ``Upgrade`` header as switching protocols right after its head. It skips the
body (``Content-Length`` or chunked), ends the message without it and raises
``HttpParserUpgrade`` with the offset where "the other protocol" starts. uvicorn then either
handed the socket to its WebSocket protocol, which never answered a ``POST`` nor closed
(the connection slipped past every read timeout), or ran the request with an empty body (400
"zero-length document" for ``curl --http2``). Nothing in llhttp turns that off, so the edge
(`gateway.serving.connections.EdgeProtocol`) feeds a fresh parser the same head without the
upgrade (`plain_head`) and then the bytes after it: the body is read as HTTP/1.1 framing says.

``CONNECT`` cannot be ignored that way: what follows its head is a tunnel's bytes, with no
HTTP framing to read them by. The gateway is no forward proxy: it answers 405 and closes.
"""

from __future__ import annotations

# Headers that only mean something to the protocol switch (RFC 9113 §3.2.1 HTTP2-Settings is a
# connection-specific header); the switch itself is the "upgrade" connection option.
SWITCH_HEADERS = frozenset((b"upgrade", b"http2-settings"))


def _connection_options(value: bytes) -> bytes:
    kept = [t.strip() for t in value.split(b",") if t.strip() and t.strip().lower() not in SWITCH_HEADERS]
    return b", ".join(kept)


def plain_head(method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request head ``method target HTTP/version`` with ``headers`` (names lower-cased, as
    uvicorn keeps them), less what asks for a protocol switch: the ``Upgrade`` and
    ``HTTP2-Settings`` fields and the ``upgrade`` / ``http2-settings`` connection options (an
    emptied ``Connection`` field is left out). Everything else, framing included, is kept
    byte for byte, so the body that follows parses as it would have without the upgrade."""
    lines = [method, b" ", target, b" HTTP/", version.encode("ascii"), b"\r\n"]
    for name, value in headers:
        if name in SWITCH_HEADERS:
            continue
        if name == b"connection":
            value = _connection_options(value)
            if not value:
                continue
        lines += [name, b": ", value, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)
