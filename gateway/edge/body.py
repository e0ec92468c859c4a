"""Reading a request body: the size limit, admission's byte budget, ``Content-Encoding``.

One buffer per body: with a declared ``Content-Length`` the bytes land in a buffer of that
size as they arrive (no list of chunks joined at the end, which would hold the body twice);
the parser and the upstream client take that buffer as it is. A 31 MiB body is then held
once, plus its parsed form while routing reads it.

``Content-Encoding: gzip`` / ``deflate`` (or a list of them, applied in order) is decoded,
bounded by the same ``max_body_bytes`` as a plain body (a decompression bomb stops at the
limit, 413), and the decoded body is what is routed and forwarded (without the header).
Other codings (``br``, ``zstd``, ``compress``) are answered 415 naming the coding: the
gateway must read the prompt to route it.
"""

from __future__ import annotations

import zlib

from starlette.requests import Request

from gateway.edge.admission import Slot
from gateway.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType, excerpt

DECODABLE = ("gzip", "x-gzip", "deflate", "identity")
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # gzip header and trailer (RFC 1952)
_ZLIB_WBITS = zlib.MAX_WBITS  # "deflate" is RFC 1950 zlib data (RFC 9110 §8.4.1.2) ...
_RAW_DEFLATE_WBITS = -zlib.MAX_WBITS  # ... which some clients send without its header


def content_codings(header: str | None) -> list[str]:
    """The codings a ``Content-Encoding`` value lists, in the order they were applied.

    Raises:
        UnsupportedMediaType: a coding other than gzip, deflate or identity.
    """
    if not header:
        return []
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    for coding in codings:
        if coding not in DECODABLE:
            raise UnsupportedMediaType(f"Content-Encoding {excerpt(coding, 40)!r} is not supported: send the body "
                                       "uncompressed, or gzip or deflate.")
    return [c for c in codings if c != "identity"]


def check_content_type(header: str | None) -> None:
    """The body must be JSON: a ``Content-Type`` of ``application/json`` or ``application/*+json``
    (parameters such as ``charset`` ignored), or none at all, which FastAPI — and so vLLM's server —
    also parses as JSON. Anything else (curl's ``-d`` sends ``application/x-www-form-urlencoded``)
    is what vLLM answers with a validation error that does not name the header.

    Raises:
        UnsupportedMediaType: another media type; the message names it and the one wanted.
    """
    if not header:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise UnsupportedMediaType(f"Content-Type {excerpt(media, 60)!r} is not supported: send the body as JSON with "
                               "Content-Type: application/json (curl: -H 'Content-Type: application/json').")


async def read_body(request: Request, limit_bytes: int, slot: Slot | None = None) -> bytes | bytearray:
    """The whole request body, decoded, refusing more than ``limit_bytes`` (before and after decoding).

    Args:
        request: the incoming request.
        limit_bytes: the most body bytes accepted, encoded or decoded.
        slot: admission's hold for this request; the body's bytes are reserved on it.

    Raises:
        PayloadTooLarge: the body (or its decoded form) is over ``limit_bytes``.
        UnsupportedMediaType: a ``Content-Type`` that is not JSON (`check_content_type`), or a
            ``Content-Encoding`` other than gzip/deflate/identity.
        BadRequest: a gzip/deflate body that does not decode.
        Overloaded: the gateway's body-byte budget is spent (`gateway.edge.admission`).
        starlette.requests.ClientDisconnect: the client left mid-body.
    """
    check_content_type(request.headers.get("content-type"))
    codings = content_codings(request.headers.get("content-encoding"))
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > limit_bytes:
        raise PayloadTooLarge(f"Request body of {size} bytes exceeds the limit of {limit_bytes} bytes.")
    if slot is not None and size:
        slot.reserve(size)
    raw = await _receive(request, limit_bytes, size, slot)
    for coding in reversed(codings):
        decoded = decode(raw, coding, limit_bytes)
        if slot is not None:
            slot.reserve(len(decoded) - len(raw))
        raw = decoded
    return raw


async def _receive(request: Request, limit_bytes: int, size: int | None, slot: Slot | None) -> bytes | bytearray:
    buf = bytearray(size or 0)
    view, filled = memoryview(buf), 0
    async for chunk in request.stream():
        end = filled + len(chunk)
        if end > limit_bytes:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit_bytes} bytes.")
        if size is not None and end <= size:
            view[filled:end] = chunk
        else:  # no declared length (chunked), or more than declared
            view.release()
            if slot is not None:
                slot.reserve(end - max(filled, size or 0))
            del buf[filled:]
            buf += chunk
            view = memoryview(buf)
        filled = end
    view.release()
    if filled < len(buf):
        del buf[filled:]
    return buf


def decode(data: bytes | bytearray, coding: str, limit_bytes: int) -> bytearray:
    """``data`` decoded from one coding (gzip, x-gzip or deflate), at most ``limit_bytes`` of output.

    Raises:
        PayloadTooLarge: the decoded body passes ``limit_bytes``.
        BadRequest: the data is not valid for the coding (or is truncated).
    """
    if coding == "deflate":
        try:
            return _inflate(data, _ZLIB_WBITS, limit_bytes)
        except zlib.error:
            pass  # raw deflate, as some clients send it
        wbits = _RAW_DEFLATE_WBITS
    else:
        wbits = _GZIP_WBITS
    try:
        return _inflate(data, wbits, limit_bytes)
    except zlib.error as exc:
        raise BadRequest(f"The request body is not valid {coding} data ({exc}).") from None


def _inflate(data: bytes | bytearray, wbits: int, limit_bytes: int) -> bytearray:
    out = bytearray()
    pending = memoryview(data)
    while pending:  # one pass per gzip member (RFC 1952 allows several, concatenated)
        d = zlib.decompressobj(wbits)
        tail: bytes | memoryview = pending
        while tail:
            out += d.decompress(tail, limit_bytes + 1 - len(out))
            if len(out) > limit_bytes:
                raise PayloadTooLarge(f"The decoded request body exceeds the limit of {limit_bytes} bytes.")
            tail = d.unconsumed_tail
            if d.eof:
                break
        out += d.flush()
        if len(out) > limit_bytes:
            raise PayloadTooLarge(f"The decoded request body exceeds the limit of {limit_bytes} bytes.")
        if not d.eof:
            raise zlib.error("the compressed data is truncated")
        pending = memoryview(d.unused_data) if wbits == _GZIP_WBITS else memoryview(b"")
    return out
