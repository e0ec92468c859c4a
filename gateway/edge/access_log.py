"""One access-log line per request, on logger ``kappa_gateway.access`` at INFO.

Fields (``-`` where a request never got that far)::

    ts           wall-clock time the request ended, ISO 8601 UTC
    request_id   the client's ``X-Request-Id`` (when it is a safe token, `gateway.proxy.handler`) or the gateway's
    route        chat | completion
    model        the served model name (only a configured name: never a client's raw value)
    backend      the backend that answered, or none
    status       the HTTP status the client got (a stream that began is 200 whatever its end)
    outcome      ok | client_disconnect | upstream_error | upstream_timeout | shutdown | upstream_4xx | ...
    cached_tokens, uncached_prompt_tokens, kappa_ratio, regime
                 the routing figures on the chosen backend (K, T, K/T, compute|transfer)
    ttft_s, e2e_s
                 time to the first streamed token; from receipt to the last byte, s
    request_bytes, response_bytes
                 body bytes received (decoded) and relayed
    invalidated_tokens, invalidation_cause
                 chat requests: the prompt tokens re-prefilled because the request rewrote the front or
                 middle of an earlier request's context (0 when it did not), and why
                 (front_truncation | compaction | edit | reorder; `prefix_index.invalidation`)

``text`` format: ``key=value`` pairs; ``json``: one JSON object per line. No line carries a
secret, a header other than the request id, or any prompt or completion text.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from prefix_index import Finding

ACCESS_LOGGER = "kappa_gateway.access"
FIELDS = ("ts", "request_id", "route", "model", "backend", "status", "outcome", "cached_tokens",
          "uncached_prompt_tokens", "kappa_ratio", "regime", "ttft_s", "e2e_s", "request_bytes", "response_bytes",
          "invalidated_tokens", "invalidation_cause", "prefill_backend")

log = logging.getLogger(ACCESS_LOGGER)


def invalidation_fields(finding: Finding | None) -> dict[str, Any]:
    """The invalidation fields of a request's line: none without a finding (not a chat request)."""
    if finding is None:
        return {}
    return {"invalidated_tokens": finding.invalidated_tokens, "invalidation_cause": finding.cause}


class AccessLog:
    """Writes the lines, when enabled.

    Args:
        enabled: ``gateway.edge.access_log``.
        json_lines: ``gateway.access_log_format == "json"``.
    """

    __slots__ = ("enabled", "json_lines")

    def __init__(self, enabled: bool, json_lines: bool) -> None:
        self.enabled, self.json_lines = enabled, json_lines

    def writes(self) -> bool:
        """Whether `write` writes a line now (enabled, and the logger at INFO or below): a caller
        whose fields cost something to gather (the relay's, once per request) asks first."""
        return self.enabled and log.isEnabledFor(logging.INFO)

    def write(self, **fields: Any) -> None:
        """Log one request; unknown fields are a programming error (``KeyError`` in tests)."""
        if not self.writes():
            return
        unknown = fields.keys() - set(FIELDS)
        if unknown:
            raise KeyError(f"not access-log fields: {sorted(unknown)}")
        record = {name: fields.get(name) for name in FIELDS}
        now = time.time()
        record["ts"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
        for name in ("kappa_ratio", "ttft_s", "e2e_s"):
            if isinstance(record[name], float):
                record[name] = round(record[name], 6)
        if self.json_lines:
            log.info(orjson.dumps(record).decode())
        else:
            log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in record.items()))
