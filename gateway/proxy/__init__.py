"""The proxy path: attempts for a first byte, the upstream seam, the relay and SSE."""
