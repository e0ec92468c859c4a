"""Admission: how many requests, and how many body bytes, the gateway holds at once.

Each proxy or routing-explanation request takes a `Slot` before its body is read and gives
it back when its answer has been sent (a stream: when the stream ends). A slot reserves the
body's bytes as they are known: the declared ``Content-Length`` up front, else chunk by chunk,
and a decoded (``Content-Encoding``) body's size once decoded; the bytes are released as soon
as the body is no longer needed (the first byte came back: no retry can re-send it).

Above either cap the request is refused with 503 ``service_unavailable_error`` and
``Retry-After`` (`Overloaded`), as Envoy's overload manager refuses when a resource is spent:
the gateway is full, not the client wrong, and a load balancer in front may retry elsewhere.
Nothing waits in a queue here: the backends' queues are the ones routing reasons about.
"""

from __future__ import annotations

from gateway.errors import Overloaded


class Admission:
    """The caps, and what is held now.

    Args:
        max_requests: requests held at once.
        max_body_bytes: body bytes held at once, over all requests.
    """

    __slots__ = ("max_requests", "max_body_bytes", "requests", "body_bytes")

    def __init__(self, max_requests: int, max_body_bytes: int) -> None:
        self.max_requests, self.max_body_bytes = max_requests, max_body_bytes
        self.requests = 0
        self.body_bytes = 0

    def admit(self) -> Slot:
        """A slot for one request.

        Raises:
            Overloaded: ``max_requests`` are already held.
        """
        if self.requests >= self.max_requests:
            raise Overloaded(f"The gateway holds as many requests as it may at once ({self.max_requests}); "
                             "retry shortly.")
        self.requests += 1
        return Slot(self)


class Slot:
    """One admitted request's hold on the caps; `release` is idempotent."""

    __slots__ = ("_admission", "body_bytes", "_held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.body_bytes = 0
        self._held = True

    def reserve(self, size_bytes: int) -> None:
        """Hold ``size_bytes`` more of body.

        Raises:
            Overloaded: the bytes held over all requests would pass the cap.
        """
        a = self._admission
        if a.body_bytes + size_bytes > a.max_body_bytes:
            raise Overloaded(f"The gateway holds too many request-body bytes at once (limit {a.max_body_bytes}); "
                             "retry shortly.")
        a.body_bytes += size_bytes
        self.body_bytes += size_bytes

    def release_body(self) -> None:
        """The body is no longer needed: give its bytes back."""
        self._admission.body_bytes -= self.body_bytes
        self.body_bytes = 0

    def release(self) -> None:
        """The request is over: give back the slot and any bytes still held."""
        if self._held:
            self._held = False
            self.release_body()
            self._admission.requests -= 1
