"""The shared machinery of the session workloads: content-addressed blocks and interleaved sessions.

Prompts are described as `sim.traces.TraceRequest` records of 512-token hash blocks
(`sim.traces.MOONCAKE_BLOCK_TOKENS`), the same records the Mooncake loader gives, so
`sim.prompts` turns them into engine tokens and gateway text with exactly the prefix sharing
the ids say. Here a block id names the block's *content*: a shared head (a system prompt, a
whole number of blocks, ids fixed per workload) followed by a stream's text, where a stream
is a piece of text that only ever grows at its end (a conversation from a given first message,
an agent's context, a document). Block ``i`` of stream ``key`` always gets the same id, so:

- two prompts that start with the same head and the same stream share exactly their common
  blocks (a prompt's last, partial block shares its first tokens with the next prompt's
  full block of the same id, as the real text would: `sim.prompts` cuts a block to its
  leading tokens);
- a prompt whose stream changes (a sliding window dropping the oldest messages starts a new
  stream) shares only the head with what came before.

`interleave` turns per-session request sequences into one trace: sessions start as a
Poisson process and each session's next request comes a session-drawn gap after its
previous one (an open loop: the gap does not wait for the previous answer, as in any replayed
trace). Every session draws from its own `random.Random` seeded by the workload seed and its
number, so a session's content does not depend on how it interleaves with others.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

from sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

BLOCK_TOKENS = MOONCAKE_BLOCK_TOKENS
"""Tokens per hash block, as the Mooncake records (`sim.prompts` reads hash ids at this size)."""


def blocks(tokens: int) -> int:
    """Hash blocks covering ``tokens`` tokens (the last may be partial)."""
    return -(-tokens // BLOCK_TOKENS)


def lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A log-normal draw with the given median and σ (of ln), rounded down and clipped to [low, high]."""
    return min(max(int(rng.lognormvariate(math.log(median), sigma)), low), high)


class BlockNamer:
    """Content-addressed block ids: ``(stream key, block position)`` → an id, the same every time.

    Args:
        head_blocks: ids ``0 .. head_blocks − 1`` are the shared head; stream ids follow.
    """

    def __init__(self, head_blocks: int = 0) -> None:
        self.head_ids: tuple[int, ...] = tuple(range(head_blocks))
        self._ids: dict[tuple[Hashable, int], int] = {}
        self._next = itertools.count(head_blocks)

    def stream(self, key: Hashable, tokens: int) -> list[int]:
        """Ids of the blocks covering the first ``tokens`` tokens of stream ``key``."""
        out = []
        for position in range(blocks(tokens)):
            block_id = self._ids.get((key, position))
            if block_id is None:
                block_id = self._ids[(key, position)] = next(self._next)
            out.append(block_id)
        return out

    def prompt(self, key: Hashable, stream_tokens: int) -> tuple[int, ...]:
        """The head's ids, then stream ``key``'s for ``stream_tokens`` tokens."""
        return self.head_ids + tuple(self.stream(key, stream_tokens))


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session and the wait before the session's next one (``messages`` and
    ``session_id``: the chat messages it sends and its conversation, where the workload gives them)."""

    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    gap_after_s: float
    messages: tuple[dict, ...] | None = None
    session_id: str | None = None


Session = Callable[[random.Random, int], Iterator[Turn]]
"""(the session's own generator, session number) → its requests in order."""


def interleave(n: int, *, session_rate_rps: float, seed: int, name: str, session: Session,
               warmup_s: float = 0.0) -> list[TraceRequest]:
    """The first ``n`` requests, by arrival, of sessions starting as a Poisson process.

    Sessions start from time 0 but requests before ``warmup_s`` are dropped and the rest
    shifted by it, so the trace opens on a steady mix of young and old sessions (as a
    trace cut from a running service does), not on a fleet of first turns. The caches
    start cold all the same: the dropped requests were never served.

    Args:
        n: requests wanted, ≥ 0.
        session_rate_rps: new sessions per second, > 0.
        seed: the workload seed (arrivals and every session's own generator).
        name: the workload's name, mixed into the sessions' seeds.
        session: builds one session's turns.
        warmup_s: seconds of sessions generated and dropped before the trace starts, ≥ 0.

    Returns:
        ``n`` records in arrival order (fewer never: sessions keep starting).

    Raises:
        ValueError: ``n`` < 0 or ``session_rate_rps`` ≤ 0.
    """
    if n < 0 or session_rate_rps <= 0:
        raise ValueError("n must be >= 0 and the rate > 0")
    arrivals = random.Random(f"{name}-arrivals-{seed}")
    heap: list[tuple[float, int, Iterator[Turn]]] = []
    order = itertools.count()
    next_start = arrivals.expovariate(session_rate_rps)
    started = 0
    out: list[TraceRequest] = []
    while len(out) < n:
        if heap and heap[0][0] <= next_start:
            now, _, turns = heapq.heappop(heap)
        else:
            now, turns = next_start, session(random.Random(f"{name}-session-{seed}-{started}"), started)
            started += 1
            next_start += arrivals.expovariate(session_rate_rps)
        turn = next(turns, None)
        if turn is None:
            continue
        heapq.heappush(heap, (now + turn.gap_after_s, next(order), turns))
        if now < warmup_s:
            continue
        out.append(TraceRequest(arrival_s=now - warmup_s, input_tokens=turn.input_tokens, output_tokens=turn.output_tokens,
                                hash_ids=turn.hash_ids, messages=turn.messages, session_id=turn.session_id))
    return out


def shareable_prefix_tokens(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, the tokens of its prompt that some earlier request's prompt began with.

    Walks each record's hash ids against every id seen before (in arrival order, trace order
    on ties) with the most tokens any earlier prompt held of that block: a block counts in
    full when an earlier prompt held all of it, and the walk stops at the first block no
    earlier prompt held in full. With content-addressed ids (this package, Mooncake's
    prefix-chained ids) that is the longest common prefix with any earlier prompt: the hit
    of an infinite cache shared by the whole fleet. Records without hash ids share nothing.

    Returns:
        Tokens, one per record in the input order, each ≤ that record's ``input_tokens``.
    """
    held: dict[int, int] = {}
    out = [0] * len(requests)
    for i in sorted(range(len(requests)), key=lambda j: (requests[j].arrival_s, j)):
        req = requests[i]
        remaining, shared = req.input_tokens, 0
        for block_id in req.hash_ids:
            size = min(remaining, BLOCK_TOKENS)
            if size <= 0:
                break
            earlier = held.get(block_id, 0)
            shared += min(earlier, size)
            if earlier < size or size < BLOCK_TOKENS:
                break
            remaining -= size
        out[i] = shared
        remaining = req.input_tokens
        for block_id in req.hash_ids:
            size = min(remaining, BLOCK_TOKENS)
            if size <= 0:
                break
            if held.get(block_id, 0) < size:
                held[block_id] = size
            remaining -= size
    return out
