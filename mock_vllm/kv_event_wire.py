"""vLLM's KV-cache events and their msgpack wire forms (``vllm/distributed/kv_events.py``).

A batch is the msgspec struct ``KVEventBatch`` (``array_like``), so on the wire it is always the
positional array ``[ts, events, data_parallel_rank]``: ``ts`` the wall-clock time the scheduler
took the events (``time.time()``, float seconds), ``data_parallel_rank`` the publisher's rank (0).

Each event is a tagged msgspec struct with ``omit_defaults``, in one of two encodings:

* ``map`` (current vLLM, since vllm-project/vllm#42892 dropped ``array_like`` from the event
  structs): a map whose first key ``"type"`` is the tag, then the fields by name, fields whose
  value equals their default (``None``) left out. The default here.
* ``positional`` (vLLM before #42892): ``[tag, field1, field2, ...]`` in declaration order,
  trailing fields equal to their defaults left out.

Fields (declaration order; ``=None`` marks a field with a default):
``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys=None, group_idx=None, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None.
``BlockRemoved``: block_hashes, medium, group_idx=None. ``AllBlocksCleared``: none.

What the engine emits (`mock_vllm.kv_event_recorder`): HBM blocks as ``BlockPool`` does (medium
``"GPU"``, hashes as unsigned 64-bit ints, ``group_idx`` 0, ``kv_cache_spec_kind``
``"full_attention"``, one ``extra_keys`` entry per block); host-tier blocks as the
``OffloadingConnector`` does by default (medium ``"CPU"``, hashes the raw 32-byte digests as
msgpack bin, ``parent_block_hash`` None, ``token_ids`` [], ``block_size`` 0, no group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
FULL_ATTENTION = "full_attention"  # vLLM's kv_cache_spec_kind of a FullAttentionSpec group
Encoding = Literal["map", "positional"]
ENCODINGS: tuple[Encoding, ...] = ("map", "positional")
DEFAULT_ENCODING: Encoding = "map"

BlockHashValue = int | bytes  # vLLM's ExternalBlockHash: int (GPU events) or the 32-byte digest (offloading)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became resident in ``medium`` (``token_ids``: all of them, concatenated)."""

    block_hashes: list[BlockHashValue]
    parent_block_hash: BlockHashValue | None
    token_ids: list[int]
    block_size: int
    medium: str
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None

    def fields(self) -> list[tuple[str, Any, bool]]:
        """(name, value, has a default) in vLLM's declaration order."""
        return [("block_hashes", self.block_hashes, False), ("parent_block_hash", self.parent_block_hash, False),
                ("token_ids", self.token_ids, False), ("block_size", self.block_size, False),
                ("lora_id", None, False), ("medium", self.medium, False), ("lora_name", None, False),
                ("extra_keys", self.extra_keys, True), ("group_idx", self.group_idx, True),
                ("kv_cache_spec_kind", self.kv_cache_spec_kind, True), ("kv_cache_spec_sliding_window", None, True)]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that left ``medium``."""

    block_hashes: list[BlockHashValue]
    medium: str
    group_idx: int | None = None

    def fields(self) -> list[tuple[str, Any, bool]]:
        return [("block_hashes", self.block_hashes, False), ("medium", self.medium, False),
                ("group_idx", self.group_idx, True)]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset."""

    def fields(self) -> list[tuple[str, Any, bool]]:
        return []


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event(event: KVEvent, encoding: Encoding) -> dict[str, Any] | list[Any]:
    """One event as the msgpack-ready object msgspec would produce (module docstring).

    Raises:
        ValueError: an unknown encoding.
    """
    fields = event.fields()
    tag = type(event).__name__
    if encoding == "map":
        return {"type": tag, **{name: value for name, value, has_default in fields
                                if not (has_default and value is None)}}
    if encoding == "positional":
        while fields and fields[-1][2] and fields[-1][1] is None:  # msgspec omits only trailing defaults
            fields.pop()
        return [tag, *(value for _, value, _ in fields)]
    raise ValueError(f"unknown KV event encoding {encoding!r}; expected one of {ENCODINGS}")


def encode_batch(ts: float, events: list[KVEvent], encoding: Encoding, data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]``.

    Ints up to 2**64 − 1 pack as uint64, ``bytes`` as bin, ``str`` as str, tuples as arrays.
    """
    return msgpack.packb([float(ts), [encode_event(e, encoding) for e in events], data_parallel_rank],
                         use_bin_type=True)
