"""Prefix invalidation: a chat request that repeats an earlier one's context except at its front or middle.

A prefix cache only hits on a request's leading tokens, so a client that rewrites the front of
its context — a sliding window dropping the oldest messages, a summary standing for them
(compaction), an edited or reordered message — has every later token prefilled again, and
nothing in the serving stack reports a fault (issue 27: a sliding window cut one production
deployment's hit rate from 85% to 45%). This module finds such requests from their message
fingerprints (`prefix_index.messages`) and says how many bytes were re-prefilled because of it.

**Finding the earlier context.** Each conversation keeps the fingerprint of its latest request
F, found again through the hash of F's last element (a request continues F whether it appends to
it or rewrites its front: it still holds F's newest message). A request R looks its elements up
from its end; the first hit is F.

**Classifying R against F** (l = the elements R and F share from the start; n = F's):

- *append-only*: F is a prefix of R (a repeat included) — never a finding, 0 bytes;
- otherwise let F[j:n] be the longest run of F's newest elements that R holds in order after l
  (ending with F's last element), starting at R[p]; R[l:p] are then *inserted* (not in F's run)
  and F[l:j] *dropped*:

  ====================  =====================================================================
  ``front_truncation``  nothing inserted, F[l:j] dropped, and R kept only F's head (its leading
                        preamble and system messages) or less: a sliding window
  ``compaction``        fewer inserted elements than dropped ones stand in their place: a summary
  ``edit``              as many inserted as dropped, or more (a message changed, added or deleted
                        after a kept non-system prefix)
  ``reorder``           a dropped element of F appears elsewhere in R: F's messages out of order
  ====================  =====================================================================

- re-prefilled bytes: F[j:n]'s (they would have been prefix hits had R only appended to F); for
  ``reorder``, R's elements after l that F held past l (each of F's counted once).

One shared newest message is no evidence of one conversation ("thanks" ends many): a run of one
element counts only when R also shares more than F's head with F. Conversations longer than
`DEFAULT_MAX_MESSAGES` elements are not tracked (a miss, never a false alarm).

**Memory.** Bounded by `InvalidationDetector`'s limits: at most ``max_conversations`` fingerprints
holding at most ``max_total_messages`` elements, the least recently continued dropped first. A
conversation costs ≤ `CONVERSATION_OVERHEAD_BYTES` plus `MESSAGE_BYTES` per element, so the
defaults hold ≤ 8,192 × 700 + 262,144 × 12 = 8.9 MB (5.7 MB + 3.1 MB; measured with tracemalloc by
``tests/unit/prefix_index/test_invalidation.py``: ~440–600 B a conversation, the most after
eviction churn has left its tables' slack). Pure: no I/O, no clock; one
detector per process (``serve --workers``: per worker; replicas do not share it).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass

from prefix_index.messages import MessageFingerprint

__all__ = ["CAUSES", "Finding", "InvalidationDetector", "classify"]

CAUSES = ("front_truncation", "compaction", "edit", "reorder")
"""The closed set of invalidation causes (a metric label's values)."""
DEFAULT_MAX_CONVERSATIONS = 8_192
"""Conversations remembered: ~35 minutes of new conversations at 4 per second (a chat service at
~60 requests/s with 15 turns each), longer than a typical conversation's pauses."""
DEFAULT_MAX_TOTAL_MESSAGES = 262_144
"""Elements held over all conversations: 32 per conversation on average (a 15-turn chat has 31)."""
DEFAULT_MAX_MESSAGES = 1_024
"""A request with more elements is not tracked (a long agent loop; its misses are never false alarms)."""
CONVERSATION_OVERHEAD_BYTES = 700
"""Upper bound of one conversation's fixed memory (its LRU entry, record, two arrays, lookup key and
their tables' slack), bytes: measured ≤ 604."""
MESSAGE_BYTES = 12
"""Memory per element held: an 8-byte hash and a 4-byte size, bytes."""


@dataclass(frozen=True, slots=True)
class Finding:
    """What a chat request's messages say about the earlier context they continue.

    Attributes:
        cause: one of `CAUSES`, or None: an append-only continuation (a repeat included), a
            request with no earlier conversation found, or one not tracked.
        invalidated_bytes: canonical bytes re-prefilled because of ``cause`` (module
            docstring), 0 when ``cause`` is None.
        invalidated_tokens: those bytes in tokens (bytes / the bytes-per-token given), rounded.
        conversation: the earlier conversation's id (an int ≥ 1, per detector), None when none
            was found.
        earlier_messages: that conversation's latest request's elements (0: none found).
        common_prefix_messages: elements the request shares with it from the start.
        messages: the request's elements.
    """

    cause: str | None
    invalidated_bytes: int
    invalidated_tokens: int
    conversation: int | None
    earlier_messages: int
    common_prefix_messages: int
    messages: int

    def as_dict(self) -> dict[str, object]:
        """JSON-ready, the names as above (``/v1/kappa/route``'s ``invalidation``)."""
        return {"cause": self.cause, "invalidated_tokens": self.invalidated_tokens,
                "invalidated_bytes": self.invalidated_bytes, "conversation": self.conversation,
                "earlier_messages": self.earlier_messages, "common_prefix_messages": self.common_prefix_messages,
                "messages": self.messages}



def classify(request: MessageFingerprint, hashes: array, sizes: array, head: int) -> tuple[str | None, int, int]:
    """Classify ``request`` (R) against an earlier request F (module docstring).

    Args:
        request: R's fingerprint.
        hashes, sizes, head: F's element hashes (``array('Q')``), sizes in bytes (``array('I')``)
            and head (leading preamble and system elements).

    Returns:
        ``(cause, invalidated_bytes, common_prefix_messages)``; cause None (0 bytes) for an
        append-only continuation or no evidence of one conversation.
    """
    r, n = request.hashes, len(hashes)
    if len(r) >= n and array("Q", r[:n]) == hashes:
        return None, 0, n
    common = 0
    for a, b in zip(r, hashes):
        if a != b:
            break
        common += 1
    try:
        last = r.index(hashes[n - 1], common)
    except ValueError:  # F's newest element is not past the common prefix: nothing of F repeats
        return None, 0, common
    run = 1
    while run <= last - common and run < n - common and r[last - run] == hashes[n - 1 - run]:
        run += 1
    kept_from, starts_at = n - run, last - run + 1  # F[kept_from:] == R[starts_at:last + 1]
    dropped = set(hashes[common:kept_from])
    if dropped and any(h in dropped for h in r[common:starts_at] + r[last + 1:]):
        return _reordered(r, hashes, sizes, common)
    if run < 2 and common <= head:
        return None, 0, common
    invalidated = sum(sizes[kept_from:])
    inserted, removed = starts_at - common, kept_from - common
    if inserted == 0:
        return ("front_truncation" if common <= head else "edit"), invalidated, common
    return ("compaction" if removed > inserted else "edit"), invalidated, common


def _reordered(r: tuple[int, ...], hashes: array, sizes: array, common: int) -> tuple[str | None, int, int]:
    """R's elements after the common prefix that F held past it, each of F's counted once."""
    held = Counter(hashes[common:])
    size_of = dict(zip(hashes[common:], sizes[common:]))
    invalidated = matched = 0
    for h in r[common:]:
        if held[h] > 0:
            held[h] -= 1
            invalidated += size_of[h]
            matched += 1
    return ("reorder", invalidated, common) if matched >= 2 else (None, 0, common)


class _Conversation:
    __slots__ = ("hashes", "sizes", "head")

    def __init__(self, fingerprint: MessageFingerprint) -> None:
        self.hashes = array("Q", fingerprint.hashes)
        self.sizes = array("I", fingerprint.sizes)
        self.head = fingerprint.head


class InvalidationDetector:
    """Per-conversation fingerprints in a bounded LRU, and the findings of new requests against them.

    Args:
        max_conversations: conversations remembered, ≥ 1.
        max_total_messages: elements held over all of them, ≥ 1.
        max_messages: a request with more elements is not tracked, in [1, max_total_messages].

    Memory: ≤ max_conversations × `CONVERSATION_OVERHEAD_BYTES` + max_total_messages × `MESSAGE_BYTES`.

    Raises:
        ValueError: a limit below 1, or max_messages above max_total_messages.
    """

    def __init__(self, *, max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
                 max_total_messages: int = DEFAULT_MAX_TOTAL_MESSAGES, max_messages: int = DEFAULT_MAX_MESSAGES) -> None:
        if min(max_conversations, max_total_messages, max_messages) < 1 or max_messages > max_total_messages:
            raise ValueError("the detector's limits must be >= 1, and max_messages <= max_total_messages")
        self.max_conversations, self.max_total_messages = max_conversations, max_total_messages
        self.max_messages = max_messages
        self._conversations: OrderedDict[int, _Conversation] = OrderedDict()
        self._by_last: dict[int, int] = {}  # hash of a conversation's newest element -> its id
        self._next_id = 1
        self.held_messages = 0

    def __len__(self) -> int:
        return len(self._conversations)

    @property
    def memory_bound_bytes(self) -> int:
        """The most memory this detector holds, bytes (class docstring)."""
        return self.max_conversations * CONVERSATION_OVERHEAD_BYTES + self.max_total_messages * MESSAGE_BYTES

    def inspect(self, request: MessageFingerprint, *, bytes_per_token: float) -> Finding:
        """The request's finding against what the detector holds; changes nothing (a dry run).

        Args:
            request: the request's fingerprint.
            bytes_per_token: canonical bytes per token (> 0) for ``invalidated_tokens``.
        """
        return self._find(request, bytes_per_token)[0]

    def observe(self, request: MessageFingerprint, *, bytes_per_token: float) -> Finding:
        """`inspect`, then remember the request as its conversation's latest (a new conversation
        when it continues none); the least recently continued are forgotten beyond the limits."""
        finding, conversation = self._find(request, bytes_per_token)
        if finding.messages > self.max_messages or not request.hashes:
            return finding
        if conversation is None:
            conversation = self._next_id
            self._next_id += 1
        else:
            self._forget(conversation)
        stored = _Conversation(request)
        self._conversations[conversation] = stored
        self._by_last[request.hashes[-1]] = conversation
        self.held_messages += len(stored.hashes)
        while len(self._conversations) > self.max_conversations or self.held_messages > self.max_total_messages:
            self._forget(next(iter(self._conversations)))
        return finding

    def _find(self, request: MessageFingerprint, bytes_per_token: float) -> tuple[Finding, int | None]:
        r = request.hashes
        if len(r) > self.max_messages:
            return Finding(None, 0, 0, None, 0, 0, len(r)), None
        conversation = None
        for h in reversed(r):
            conversation = self._by_last.get(h)
            if conversation is not None:
                break
        if conversation is None:
            return Finding(None, 0, 0, None, 0, 0, len(r)), None
        f = self._conversations[conversation]
        cause, invalidated, common = classify(request, f.hashes, f.sizes, f.head)
        if cause is None and common < len(f.hashes) and common <= f.head:
            # Nothing of F repeats past its head: another conversation behind a shared message.
            return Finding(None, 0, 0, None, 0, 0, len(r)), None
        return Finding(cause, invalidated, round(invalidated / bytes_per_token), conversation, len(f.hashes), common,
                       len(r)), conversation

    def _forget(self, conversation: int) -> None:
        stored = self._conversations.pop(conversation)
        self.held_messages -= len(stored.hashes)
        last = stored.hashes[len(stored.hashes) - 1]
        if self._by_last.get(last) == conversation:
            del self._by_last[last]
