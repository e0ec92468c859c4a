"""vLLM's KV-cache events, decoded: payload bytes -> typed events, or a clear error.

Source: ``vllm/distributed/kv_events.py`` (REFERENCE.md §4). A ZMQ PUB message has three frames:
the topic, the sequence number as 8 bytes big-endian (`decode_seq`), and a msgpack ``EventBatch``
(`decode_batch`). vLLM encodes with msgspec, and two encodings are in use, both accepted here:

- positional (``array_like=True``, older vLLM, SGLang, llm-d's Go structs): the batch is
  ``[ts, events, data_parallel_rank?]`` and each event ``[tag, field, ...]`` in declaration order,
  trailing defaults omitted (``omit_defaults``);
- maps tagged by ``"type"`` (current vLLM's events): ``{"type": "BlockStored", "block_hashes": ...}``;
  the batch as ``{"ts", "events", "data_parallel_rank"}`` is accepted too.

Events: ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, ...}`` (a run of consecutive full blocks: block ``i`` chains
from block ``i-1``, the first from ``parent_block_hash``; ``token_ids`` holds ``block_size``
tokens per block), ``BlockRemoved{block_hashes, medium, group_idx}``, ``AllBlocksCleared{}``.
A ``BlockStored`` with no token ids is a placeholder that names blocks by hash only: vLLM's
``OffloadingConnector`` announces a block copied to its CPU tier so (``token_ids=[]``,
``block_size=0``, ``parent_block_hash`` None; ``offloading_connector.py``, ``take_events``);
`BlockStored.placeholder` says so, and the index places such blocks by their hash alone.
A block hash is an int, or the 32-byte digest when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is
off; `engine_hash` takes the low 64 bits either way (vLLM's ``maybe_convert_block_hash``; llm-d's
``getHashAsUint64``). ``medium`` is ``"GPU"`` (or absent: the GPU pool) or ``"CPU"`` (an offload
tier); `Tier` names where the block lives. An event of an unknown type is skipped and counted
(``EventBatch.unknown_events``); a payload that is not such a batch raises `MalformedEvents`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from prefix_index.engine_chain import TOKEN_ID_LIMIT, canonical_extra
from prefix_index.errors import PrefixIndexError

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "MalformedEvents", "REPLAY_END_SEQ", "Tier",
    "decode_batch", "decode_seq", "encode_seq", "engine_hash", "tier_of",
]

_U64 = (1 << 64) - 1
# The replay stream's end marker: vLLM sends (-1).to_bytes(8, "big", signed=True) and an empty payload.
REPLAY_END_SEQ = -1
# Field order of the positional encoding (vllm/distributed/kv_events.py declaration order).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedEvents(PrefixIndexError, ValueError):
    """A KV-event message that is not vLLM's format; the message names what is wrong."""


class Tier(enum.Enum):
    """Where a block lives: ``HBM`` (vLLM medium ``GPU``), ``HOST`` (``CPU``, an offload tier)."""

    HBM = "hbm"
    HOST = "host"


def tier_of(medium: str | None) -> Tier | None:
    """``GPU`` or no medium -> HBM, ``CPU`` -> host (case-insensitive); another medium (a disk tier) -> None."""
    if medium is None or medium.upper() == "GPU":
        return Tier.HBM
    if medium.upper() == "CPU":
        return Tier.HOST
    return None


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks now cached. ``extra_keys``: per block its `engine_chain.canonical_extra` bytes or None."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[bytes | None, ...] | None = None
    group_idx: int | None = None

    @property
    def placeholder(self) -> bool:
        """No token ids: blocks named by hash only (the offloading connector's CPU-tier stores)."""
        return not self.token_ids


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from ``medium``."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message's events. ``ts``: the engine's wall clock (s since the epoch) at publication."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    unknown_events: int = 0


def encode_seq(seq: int) -> bytes:
    """A sequence number as vLLM sends it: 8 bytes big-endian (-1, the replay end, as signed)."""
    return seq.to_bytes(8, "big", signed=seq < 0)


def decode_seq(frame: bytes) -> int:
    """The sequence frame as an int in [0, 2**64), or `REPLAY_END_SEQ` for the replay end marker.

    Raises:
        MalformedEvents: not exactly 8 bytes.
    """
    if len(frame) != 8:
        raise MalformedEvents(f"sequence frame must be 8 bytes, got {len(frame)}")
    if frame == b"\xff" * 8:
        return REPLAY_END_SEQ
    return int.from_bytes(frame, "big")


def engine_hash(value: object) -> int:
    """An engine block hash as an int in [0, 2**64): an int modulo 2**64 (a signed int64 wraps), the
    last 8 bytes of a digest read big-endian (vLLM's ``maybe_convert_block_hash``).

    Raises:
        MalformedEvents: neither an int nor non-empty bytes.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < -(1 << 63) or value > _U64:
            raise MalformedEvents(f"block hash {value} is outside 64 bits")
        return value & _U64
    if isinstance(value, (bytes, bytearray)) and value:
        return int.from_bytes(value[-8:], "big")
    raise MalformedEvents(f"block hash must be an int or bytes, got {type(value).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a msgpack ``EventBatch`` (either encoding, see the module docstring).

    Raises:
        MalformedEvents: not msgpack, not a batch, or an event of a known type with a missing or
            ill-typed field (a hash that is not 64 bits, token ids that do not fill the blocks, ...).
    """
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise MalformedEvents(f"payload is not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    else:
        raise MalformedEvents(f"batch must be [ts, events, dp_rank] or a map, got {_kind(raw)}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise MalformedEvents("batch needs a numeric ts and a list of events")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise MalformedEvents(f"data_parallel_rank must be an int, got {_kind(rank)}")
    decoded: list[Event] = []
    unknown = 0
    for i, raw_event in enumerate(events):
        event = _event(raw_event, i)
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return EventBatch(float(ts), tuple(decoded), rank, unknown)


def _event(raw: Any, i: int) -> Event | None:
    """One event, or None for an unknown tag."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, fields = raw[0], _positional(raw[0], raw[1:])
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, fields = raw["type"], raw
    else:
        raise MalformedEvents(f"events[{i}] is neither a tagged array nor a map with a 'type', got {_kind(raw)}")
    try:
        if tag == "BlockStored":
            return _stored(fields)
        if tag == "BlockRemoved":
            return BlockRemoved(_hashes(fields.get("block_hashes")), _opt_str(fields.get("medium"), "medium"),
                                _opt_int(fields.get("group_idx"), "group_idx"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except MalformedEvents as exc:
        raise MalformedEvents(f"events[{i}] ({tag}): {exc}") from None
    return None


def _positional(tag: str, values: list[Any]) -> dict[str, Any]:
    names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
    return dict(zip(names, values))


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"))
    size = f.get("block_size")
    tokens = f.get("token_ids")
    placeholder = tokens == [] and isinstance(size, int) and not isinstance(size, bool) and size >= 0
    if not placeholder and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise MalformedEvents(f"block_size must be a positive int, got {size!r}")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < TOKEN_ID_LIMIT
                                           for t in tokens):
        raise MalformedEvents("token_ids must be a list of ints in [0, 2**32)")
    assert isinstance(size, int)  # both branches above checked it (for mypy, which cannot follow `placeholder`)
    if not placeholder and len(tokens) != len(hashes) * size:
        raise MalformedEvents(f"{len(tokens)} token ids for {len(hashes)} blocks of {size}")
    parent = f.get("parent_block_hash")
    return BlockStored(hashes, None if parent is None else engine_hash(parent), tuple(tokens), size,
                       _opt_str(f.get("medium"), "medium"), _opt_str(f.get("lora_name"), "lora_name"),
                       _extras(f.get("extra_keys"), len(hashes)), _opt_int(f.get("group_idx"), "group_idx"))


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise MalformedEvents(f"block_hashes must be a list, got {_kind(value)}")
    return tuple(engine_hash(v) for v in value)


def _extras(value: Any, n_blocks: int) -> tuple[bytes | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n_blocks:
        raise MalformedEvents(f"extra_keys must be a list of one entry per block ({n_blocks})")
    try:
        return tuple(None if entry is None else canonical_extra(entry) for entry in value)
    except ValueError as exc:
        raise MalformedEvents(f"extra_keys: {exc}") from None


def _opt_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise MalformedEvents(f"{name} must be a string, got {_kind(value)}")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise MalformedEvents(f"{name} must be an int, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return type(value).__name__

