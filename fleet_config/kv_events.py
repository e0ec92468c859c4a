"""Where a backend publishes its KV-cache events, and which tokenizer a model's engines use (issue 30).

vLLM publishes block-level KV-cache events when started with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "..."}'``
(``vllm/config/kv_events.py``, ``vllm/distributed/kv_events.py``; REFERENCE.md §4): a ZMQ PUB
socket sends ``(topic, 8-byte big-endian sequence number, msgpack EventBatch)``, and an optional
ROUTER socket replays batches a subscriber missed. A backend entry names the addresses the gateway
*connects* to (so ``tcp://127.0.0.1:5557``, not the engine's bind address ``tcp://*:5557``).

A model's ``tokenizer`` is a directory holding a Hugging Face ``tokenizer.json`` and a
``tokenizer_config.json`` (with its ``chat_template``), the files vLLM loads for that model. With
it the gateway turns a request into the engine's token ids, and so can read the engine's events
exactly; without it the index stays approximate (byte blocks), as before.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from fleet_config.sections import StrictSection

__all__ = ["KvEventsEntry", "resolve_tokenizer_dir"]


def _zmq_tcp(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None or parts.hostname == "*":
        raise ValueError(f"must be tcp://host:port that the gateway can connect to, got {value!r}")
    return value


class KvEventsEntry(StrictSection):
    """One backend's KV-event publisher, as the gateway reaches it.

    Attributes:
        endpoint: the PUB socket, ``tcp://host:port`` (vLLM's ``endpoint``, host made concrete).
        replay_endpoint: the ROUTER socket that replays missed batches (vLLM's
            ``replay_endpoint``); without it a gap can only be repaired by dropping the backend's
            entries until the engine republishes them.
        topic: the topic vLLM prefixes every message with (``""``: all topics).
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _tcp(cls, value: str | None) -> str | None:
        return None if value is None else _zmq_tcp(value)


def resolve_tokenizer_dir(value: str, config_dir: Path | None) -> Path:
    """A model's ``tokenizer`` directory as a path: relative paths are taken from the config file's
    directory first, then from the working directory.

    Raises:
        ValueError: neither place holds a directory with a ``tokenizer.json``.
    """
    raw = Path(value)
    candidates = [raw] if raw.is_absolute() else [p for p in ((config_dir / raw) if config_dir else None, raw) if p]
    candidates = list(dict.fromkeys(p.resolve() for p in candidates))  # one line per place, absolute
    for path in candidates:
        if (path / "tokenizer.json").is_file():
            return path.resolve()
    raise ValueError(f"no tokenizer.json in {value!r} (looked in {', '.join(str(p) for p in candidates)})")
