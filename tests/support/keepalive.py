"""One HTTP/1.1 keep-alive connection that is never silently reopened, and what an answer was.

Imports none of the project's packages (STYLE.md B2), so the fuzz test and ``bench/fuzz.py``
share it. Pooling clients (httpx, aiohttp, requests) reconnect behind the caller's back when
a server closes a keep-alive connection, which hides exactly the failure the fuzz looks
for: a server that answers an error and then drops the connection, so the client's next
request on it fails. The stdlib's `http.client.HTTPConnection` holds one socket; a reset
raises, and a close after an answer is seen as the socket going away.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

# Every gateway answer to a relayed request carries this header; the gateway's own errors do not.
BACKEND_HEADER = "x-kappa-backend"


class ConnectionLost(Exception):
    """The server reset or closed the connection (``after``: what was being done)."""


@dataclass(frozen=True)
class Answer:
    """One response: status, headers (names lower-cased) and the whole body."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def relayed(self) -> bool:
        """A backend answered it (the gateway labels relayed responses with ``x-kappa-backend``)."""
        return BACKEND_HEADER in self.headers


class OneConnection:
    """A single keep-alive connection to ``base_url`` (``http://host:port``).

    Args:
        base_url: the server's base URL.
        timeout_s: socket timeout for connect and each read, s.

    `post` raises `ConnectionLost` if the server reset the connection, or closed it after the
    previous answer; `reopen` starts a new one (and `reopened` counts them).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 30.0) -> None:
        parts = urlsplit(base_url)
        self._host, self._port, self._timeout_s = parts.hostname or "127.0.0.1", parts.port or 80, timeout_s
        self.reopened = 0
        self._conn = self._open()

    def _open(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        conn.connect()
        self._sock = conn.sock
        return conn

    def reopen(self) -> None:
        self._conn.close()
        self._conn = self._open()
        self.reopened += 1

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> Answer:
        """POST ``body`` (``content-type: application/json`` unless ``headers`` say otherwise).

        Raises:
            ConnectionLost: the connection was closed by the server after the last answer, or
                was reset or closed during this request.
        """
        if self._conn.sock is None or self._conn.sock is not self._sock:
            raise ConnectionLost("the server closed the connection after the previous answer")
        try:
            self._conn.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})})
            resp = self._conn.getresponse()
            data = resp.read()
        except (ConnectionError, http.client.HTTPException, TimeoutError) as exc:
            raise ConnectionLost(f"{exc.__class__.__name__}: {exc}") from exc
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)

    def close(self) -> None:
        self._conn.close()


def is_openai_error(answer: Answer) -> bool:
    """The body is ``{"error": {"message": str, "type": str, "code": <the status>, ...}}``."""
    try:
        doc = json.loads(answer.body)
    except ValueError:
        return False
    error = doc.get("error") if isinstance(doc, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and type(error.get("code")) is int and error["code"] == answer.status)
