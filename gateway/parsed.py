"""A request body as routing sees it: loaded, its output estimate, the fields routing keeps.

`load_body` reads JSON (a leading UTF-8 BOM ignored, as vLLM's server accepts it); `ParsedRequest`
is what `gateway.routing.RoutingService.parse` derives from a validated body; `max_tokens_of` and
`sequences_of` read the fields the KV charge needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from dispatch import RoutableRequest
from gateway.errors import BadRequest
from gateway.invalidation import PendingFinding

__all__ = ["DEFAULT_MAX_TOKENS_ESTIMATE", "Kind", "ParsedRequest", "load_body", "max_tokens_of", "sequences_of"]

Kind = Literal["chat", "completion"]
# KV the gateway charges for the output of a request that sets no max_tokens (vLLM would
# fill the context; most clients stop far earlier): an estimate, named as one.
DEFAULT_MAX_TOKENS_ESTIMATE = 256
UTF8_BOM = b"\xef\xbb\xbf"


def load_body(raw: bytes) -> Any:
    """The JSON value of a request body (orjson; a leading UTF-8 BOM ignored: module docstring).

    Raises:
        BadRequest: not JSON that orjson accepts; the message says why and where.
    """
    try:
        return orjson.loads(raw[len(UTF8_BOM):] if raw.startswith(UTF8_BOM) else raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None


@dataclass(frozen=True, slots=True)
class ParsedRequest(RoutableRequest):
    """What routing derived from a validated body (model, hashes, sizes). The parsed body
    itself is not kept: it is as large as the body, and the raw bytes are what goes upstream.

    ``load_only_reason``: why the body has no prefix hashes and is routed on load alone
    (``NestingTooDeep.reason``), or None for a body canonicalised and hashed as usual.
    ``invalidation``: a chat body's prefix-invalidation work (`gateway.invalidation.PendingFinding`),
    None otherwise.
    ``client_kv_transfer``: the client sent its own ``kv_transfer_params`` (non-null): its own P/D
    flow, whose KV lives where the client put it. Relayed as sent to one backend, never retried
    elsewhere (the params name one KV location), and a 5xx it gets (a failed KV load) is not the
    backend's fault: not counted toward its ejection (`gateway.proxy.attempts`).
    ``splittable``: on a P/D fleet the request may be split (`gateway.proxy.disagg`): not when the
    client sent its own ``kv_transfer_params`` (relayed as sent, never split) or asked for several
    sequences (``n`` > 1: one prefill per sequence is not what vLLM's P/D flow runs).
    """

    kind: Kind
    stream: bool
    load_only_reason: str | None = None
    invalidation: PendingFinding | None = None
    splittable: bool = True
    client_kv_transfer: bool = False
    token_ids: tuple[int, ...] | None = None  # for the event-fed index (`request_token_ids`), when known
    cache_salt: str | None = None
    # A long prompt's body, until `RoutingService.plan` has its token ids (encoded in a worker thread).
    tokenize_body: dict[str, Any] | None = None


def max_tokens_of(body: dict[str, Any], kind: Kind) -> int:
    keys = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer.", param=key)
        return value
    return DEFAULT_MAX_TOKENS_ESTIMATE


def sequences_of(body: dict[str, Any]) -> int:
    """Output sequences the request makes the backend hold: OpenAI's ``n`` (choices, default 1), or
    ``best_of`` when larger (legacy completions: that many are generated server-side and the best
    ``n`` returned, OpenAI's API reference). Each holds its own output KV (`router.cost.kv_demand_bytes`).

    Raises:
        BadRequest: ``n`` or ``best_of`` present and not a positive integer.
    """
    sequences = 1
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer.", param=key)
        sequences = max(sequences, value)
    return sequences
