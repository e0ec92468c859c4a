"""The proxy path: routing a body, attempts for a first byte, the upstream seam, the relay and SSE."""
