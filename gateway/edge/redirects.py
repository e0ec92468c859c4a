"""Redirects that do not trust the client's ``Host``: Starlette's trailing-slash 307, made relative.

Starlette's router answers a path that only differs by a trailing slash (``/health/``) with a
307 whose ``Location`` is an absolute URL built from the request's ``Host`` header
(``starlette/routing.py``, ``redirect_slashes``): a client, or anything in front of the gateway
that passes ``Host`` through, chooses where the redirect points (a cache in front would serve
that to others). RFC 9110 §10.2.2 allows a relative reference in ``Location``, resolved
against the request's own URL, so `RelativeRedirects` keeps only the path and query: the
redirect stays on whatever host the client reached. The gateway makes no other redirect.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REDIRECTS = frozenset((301, 302, 303, 307, 308))


def relative_location(location: bytes) -> bytes:
    """``location`` without its scheme and authority: ``http://evil/health?x`` → ``/health?x``;
    an already relative one unchanged. A path beginning ``//`` keeps one slash, so the result is
    never read as a network-path reference to another host."""
    parts = urlsplit(location.decode("latin-1"))
    path = "/" + parts.path.lstrip("/")
    return (path + ("?" + parts.query if parts.query else "")).encode("latin-1")


class RelativeRedirects:
    """ASGI middleware: every redirect's ``Location`` made relative (module docstring).

    Args:
        app: the wrapped application (FastAPI's router).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_relative(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in REDIRECTS:
                message["headers"] = [(k, relative_location(v) if k.lower() == b"location" else v)
                                      for k, v in message.get("headers", ())]
            await send(message)

        await self.app(scope, receive, send_relative)
