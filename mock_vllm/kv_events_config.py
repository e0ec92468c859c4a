"""The mock's ``--kv-events-config``: vLLM's ``KVEventsConfig`` and the mock's own choices (issue 30)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from mock_vllm.kv_event_wire import DEFAULT_ENCODING, ENCODINGS, Encoding


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``, same names and defaults) plus the mock's
    ``encoding`` (`mock_vllm.kv_event_wire`), ``python_hash_seed`` (the ``PYTHONHASHSEED`` vLLM would
    see, for ``NONE_HASH``) and ``bind`` (``None``: vLLM's bind-or-connect rule; True: bind)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled, as vLLM resolves it
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: Encoding = DEFAULT_ENCODING
    python_hash_seed: str | None = None
    bind: bool | None = None

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 1:
            raise ValueError("buffer_steps, hwm and max_queue_size must be >= 1")

    @property
    def active(self) -> bool:
        """Events are enabled and go to a ZMQ publisher (vLLM: ``publisher`` defaults to zmq when enabled)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_json(cls, text: str, **mock_fields: Any) -> KvEventsConfig:
        """Parse vLLM's ``--kv-events-config`` JSON; ``mock_fields``: ``encoding``, ``python_hash_seed``, ``bind``.

        Raises:
            ValueError: not a JSON object, an unknown key (vLLM rejects them too), or a bad value.
        """
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        vllm_keys = {f.name for f in fields(cls)} - {"encoding", "python_hash_seed", "bind"}
        if not isinstance(doc, dict) or set(doc) - vllm_keys:
            raise ValueError(f"--kv-events-config must be an object with keys among {sorted(vllm_keys)}")
        return cls(**doc, **mock_fields)
