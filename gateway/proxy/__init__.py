"""The proxy path: the handler, attempts for a first byte, the relay and SSE."""
