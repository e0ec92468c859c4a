"""vLLM's KV-cache event messages, built by hand for tests (imports none of our packages).

Source: ``vllm/distributed/kv_events.py``. A PUB message is ``(topic, seq as 8 bytes big-endian,
msgpack EventBatch)``. Two encodings, as msgspec writes them: ``form="map"`` (current vLLM: each
event a map tagged by ``"type"``; fields without a default always present, defaulted ones omitted
when at their default) and ``form="array"`` (``array_like``: ``[tag, field, ...]`` in declaration
order, trailing defaults omitted). The batch is ``[ts, events, data_parallel_rank]`` (``array_like``)
unless ``batch_form="map"``.
"""

from __future__ import annotations

from typing import Any

import msgpack

REPLAY_END = (-1).to_bytes(8, "big", signed=True)  # vLLM's ZmqEventPublisher.END_SEQ


def stored(hashes: list[Any], parent: Any, tokens: list[int], block_size: int, *, medium: str | None = "GPU",
           lora_id: int | None = None, lora_name: str | None = None, extra_keys: list[Any] | None = None,
           group_idx: int | None = None, form: str = "map") -> Any:
    """A ``BlockStored`` event."""
    if form == "array":
        fields: list[Any] = ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name,
                             extra_keys, group_idx]
        while fields[-1] is None and len(fields) > 7:  # omit_defaults: trailing defaults dropped
            fields.pop()
        return fields
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                             "token_ids": tokens, "block_size": block_size, "lora_id": lora_id, "medium": medium,
                             "lora_name": lora_name}
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def removed(hashes: list[Any], *, medium: str | None = "GPU", form: str = "map") -> Any:
    """A ``BlockRemoved`` event."""
    if form == "array":
        return ["BlockRemoved", hashes, medium]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared(*, form: str = "map") -> Any:
    """An ``AllBlocksCleared`` event."""
    return ["AllBlocksCleared"] if form == "array" else {"type": "AllBlocksCleared"}


def batch(ts: float, events: list[Any], *, dp_rank: int | None = 0, batch_form: str = "array") -> bytes:
    """An ``EventBatch`` payload."""
    if batch_form == "map":
        return msgpack.packb({"ts": ts, "events": events, "data_parallel_rank": dp_rank}, use_bin_type=True)
    return msgpack.packb([ts, events] + ([] if dp_rank is None else [dp_rank]), use_bin_type=True)


def seq_frame(seq: int) -> bytes:
    """A sequence number frame: 8 bytes big-endian."""
    return seq.to_bytes(8, "big")
