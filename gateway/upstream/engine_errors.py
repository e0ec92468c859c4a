"""An engine's error answer that says the request itself is bad: relayed as sent, never retried.

vLLM refuses a prompt longer than the model's context with 400 and an OpenAI-shaped body,
type ``BadRequestError``, message "This model's maximum context length is N tokens. However,
you requested M tokens ..." (vllm/entrypoints/openai/serving_engine.py, the input validation
of ``OpenAIServing``; the mock's ``mock_vllm.engine`` says the same). Some engines and
proxies answer such errors with a 500 and the same body. No backend can serve that request,
so a retry only doubles the work and turns the engine's clear answer into a 502: a 5xx whose
body says the request is bad (`says_request_is_bad`) goes to the client unchanged, status and
body, and counts as neither a failure of the backend nor a success.

The body decides: an OpenAI error type for the client's mistakes (``invalid_request_error``;
vLLM's ``BadRequestError``), OpenAI's ``context_length_exceeded`` code, or the context-length
message, in ``{"error": {...}}`` (OpenAI, vLLM ≥ 0.10.1) or in vLLM's older flat
``{"object": "error", "message", "type", "code"}``.
"""

from __future__ import annotations

import json
from typing import Any

REQUEST_ERROR_TYPES = frozenset({"invalid_request_error", "BadRequestError"})
REQUEST_ERROR_CODES = frozenset({"context_length_exceeded"})
CONTEXT_LENGTH_PHRASES = ("maximum context length",)


def says_request_is_bad(body: bytes) -> bool:
    """Whether an engine's error body (its first few kB) blames the request, not the engine."""
    text = body.decode("utf-8", "replace")
    try:
        doc: Any = json.loads(text)
    except ValueError:
        return _mentions_context_length(text)
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict):
        error = doc if isinstance(doc, dict) else {}
    if error.get("type") in REQUEST_ERROR_TYPES or error.get("code") in REQUEST_ERROR_CODES:
        return True
    message = error.get("message")
    return isinstance(message, str) and _mentions_context_length(message)


def _mentions_context_length(text: str) -> bool:
    lower = text.lower()
    return any(phrase in lower for phrase in CONTEXT_LENGTH_PHRASES)
