"""The OpenAI-compatible wire format as vLLM speaks it: request models, errors, response bodies.

Source: vLLM's ``vllm/entrypoints/openai/protocol.py`` and ``serving_chat.py`` /
``serving_completion.py`` (REFERENCE.md §3). What the mock keeps of it:

* Requests are pydantic models that accept unknown fields (vLLM ignores extras such as
  ``priority``, ``session_id``); ``kv_transfer_params`` (an object) drives P/D
  (`mock_vllm.pd`), and non-streamed answers carry it (``null`` unless a prefill kept its KV
  for a remote decode), as vLLM's response models do; wrong types, a missing ``messages``
  or ``prompt`` and malformed JSON become 400s with vLLM's error body.
* ``n`` > 1 is refused with a 400: the mock generates one choice per request.
* Sampling fields (``temperature``, ``top_p``, ``seed``, …) are type-checked and otherwise
  ignored: the mock always generates exactly ``max_tokens`` deterministic tokens
  (finish_reason ``"length"``; EOS and ``stop`` are ignored so traces replay exactly).
* ``usage`` always carries ``prompt_tokens_details.cached_tokens`` (vLLM needs
  ``--enable-prompt-tokens-details`` for that).
* Errors are ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the integer
  HTTP status (vLLM ≥ 0.10.1).

SSE chunks are ``data: {json}\\n\\n`` with compact JSON, as vLLM's
``model_dump_json(exclude_unset=True)`` writes them; `ChunkWriter` pre-renders a response's
constant head once, since a streamed response sends one chunk per generated token.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

DONE_EVENT = "data: [DONE]\n\n"
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 500: "InternalServerError"}
PositiveInt = Annotated[int, Field(ge=1)]


class ApiError(Exception):
    """An error the client is told about with vLLM's error body and ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body; ``type`` is the OpenAI client's exception name for the status."""
    err_type = ERROR_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def validation_error(exc: RequestValidationError) -> ApiError:
    """Translate FastAPI's validation error into a 400 naming the first bad field."""
    errors = exc.errors()
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"JSON decode error: {detail}".rstrip(": "))
        else:
            parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid value')}")
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    if first.get("type") == "json_invalid":
        param = None
    noun = "error" if len(errors) == 1 else "errors"
    return ApiError(400, f"{len(errors)} validation {noun}: " + "; ".join(parts), param=param)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(_Model):
    type: str


class ChatMessage(_Model):
    role: str
    content: str | list[ContentPart] | None = None


class GenerationRequest(_Model):
    """Fields chat and completion requests share (vLLM names and meanings)."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    n: PositiveInt = 1
    stream: bool | None = False  # vLLM: Optional[bool]; null means not streamed
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: int | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def check_n(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported by the mock vLLM backend: it generates "
                                "one choice per request (send n=1 or omit it).", param="n")


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``, as in vLLM."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt as text or token ids; several prompts (a batch) are refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ApiError(400, "prompt must not be empty.", param="prompt")
        if isinstance(prompt[0], int):
            return list(prompt)  # type: ignore[arg-type]
        if len(prompt) != 1:
            raise ApiError(400, f"The mock vLLM backend takes one prompt per request, got a batch of "
                                f"{len(prompt)}; send them as separate requests.", param="prompt")
        return prompt[0]  # type: ignore[return-value]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def error_event(status: int, message: str) -> str:
    """A mid-stream error as vLLM sends it, followed by the closing ``[DONE]``."""
    return f"data: {_dumps(error_body(status, message))}\n\n{DONE_EVENT}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` with ``prompt_tokens_details`` always present."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ChunkWriter:
    """Renders one streamed response's SSE events (``chat.completion.chunk`` or ``text_completion``)."""

    def __init__(self, *, response_id: str, chat: bool, created: int, model: str) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = f'data: {{"id":{_dumps(response_id)},"object":"{obj}","created":{created},' \
                     f'"model":{_dumps(model)},"choices":'

    def _event(self, choices: list[dict[str, Any]], usage_info: dict[str, Any] | None) -> str:
        tail = "}" if usage_info is None else f',"usage":{_dumps(usage_info)}}}'
        return f"{self._head}{_dumps(choices)}{tail}\n\n"

    def role(self, usage_info: dict[str, Any] | None = None) -> str:
        """The first chat chunk: role ``assistant`` and empty content."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._event([choice], usage_info)

    def text(self, text: str, finish_reason: str | None, usage_info: dict[str, Any] | None = None) -> str:
        """A content chunk; the last one carries ``finish_reason`` and ``stop_reason``."""
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = None
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        return self._event([choice], usage_info)

    def usage(self, usage_info: dict[str, Any]) -> str:
        """The ``include_usage`` chunk: empty ``choices`` and the request's usage."""
        return self._event([], usage_info)


def chat_completion(*, response_id: str, created: int, model: str, text: str, finish_reason: str,
                    usage_info: dict[str, Any], kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` body."""
    message = {"role": "assistant", "content": text, "tool_calls": []}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_info, "prompt_logprobs": None,
            "kv_transfer_params": kv_transfer_params}


def text_completion(*, response_id: str, created: int, model: str, text: str, finish_reason: str,
                    usage_info: dict[str, Any], kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A non-streamed ``text_completion`` body."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
              "prompt_logprobs": None}
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_info, "kv_transfer_params": kv_transfer_params}


def model_list(*, served_model_name: str, root: str, created: int, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models``: vLLM's ``ModelList`` with one ``ModelCard``."""
    permission = {"id": f"modelperm-{served_model_name}", "object": "model_permission", "created": created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
            "parent": None, "max_model_len": max_model_len, "permission": [permission]}
    return {"object": "list", "data": [card]}
