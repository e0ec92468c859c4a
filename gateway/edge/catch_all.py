"""The last word on an exception no handler answered: an OpenAI-shaped 500, connection kept.

Starlette's ``ServerErrorMiddleware`` answers an unhandled exception with a plain-text
``Internal Server Error`` and then re-raises it (``starlette/middleware/errors.py``), and
uvicorn, seeing an exception after a response began, closes the connection: the client's
next request on that keep-alive connection fails too. `CatchAll` sits inside it
(``app.add_middleware``), around FastAPI's exception middleware and the routes:

- an exception raised before the response started is answered with ``answer(exc)`` (the
  app's `gateway.app.error_response`: logged, ``{"error": {...}}`` with status 500 and type
  ``server_error``) and not re-raised, so uvicorn keeps the connection open;
- one raised after the response started cannot be answered any more: it goes on up, and
  uvicorn closes the connection, so the client sees a cut response, never a wrong one.

The proxy routes' fast path (`gateway.app.GatewayApp.__call__`) answers its own exceptions
the same way and never passes through here.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CatchAll:
    """ASGI middleware: answer an exception that escaped every handler, if nothing was sent yet.

    Args:
        app: the wrapped application (FastAPI's exception middleware and the routes).
        answer: the response for an exception (it logs what it did not expect).
    """

    def __init__(self, app: ASGIApp, *, answer: Callable[[Exception], Response]) -> None:
        self.app = app
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as exc:  # noqa: BLE001 -- the last handler: every failure is answered, OpenAI-style
            if started:
                raise
            await self.answer(exc)(scope, receive, send)
