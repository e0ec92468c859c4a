"""Prefix invalidation (issue 27, item 7): per-message fingerprints and the detector, table-driven.

Each row sends an earlier request F, then a request R, and names the finding R must get: the
cause and which of F's messages it re-prefills. Append-only continuations count nothing, always.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest

from prefix_index import (
    InvalidationDetector,
    MessageFingerprint,
    chain_seed,
    chat_canonical_bytes,
    message_fingerprint,
)
from prefix_index import invalidation
from prefix_index.invalidation import CONVERSATION_OVERHEAD_BYTES, DEFAULT_MAX_CONVERSATIONS, MESSAGE_BYTES

SEED = chain_seed("llama-3.1-8b", None)
SYSTEM = {"role": "system", "content": "You answer questions about the fleet. " * 20}


def user(i: int) -> dict:
    return {"role": "user", "content": f"question {i}: " + "why is the cache cold? " * 10}


def answer(i: int) -> dict:
    return {"role": "assistant", "content": f"answer {i}: " + "the front of the context changed. " * 25}


def chat(turns: int, *, system: bool = True) -> list[dict]:
    """System prompt, ``turns`` finished (user, answer) pairs, then the next question."""
    out = [SYSTEM] if system else []
    for i in range(turns):
        out += [user(i), answer(i)]
    return out + [user(turns)]


def fingerprint(messages: list[dict], seed: int = SEED, **fields: object) -> MessageFingerprint:
    return message_fingerprint(chat_canonical_bytes({"messages": messages, **fields}), seed)


def size(message: dict) -> int:
    """A message's element bytes: its canonical record without the leading RS."""
    return len(chat_canonical_bytes({"messages": [message]})) - 1


EARLIER = chat(4)  # F: system, 4 pairs, question 4
NEXT = EARLIER + [answer(4), user(5)]

CASES = [
    # (id, R, cause, F's messages R re-prefills)
    ("append-only", NEXT, None, []),
    ("repeat", EARLIER, None, []),
    ("sliding-window", [SYSTEM] + EARLIER[3:] + [answer(4), user(5)], "front_truncation", EARLIER[3:]),
    ("window-drops-system-too", EARLIER[5:] + [answer(4), user(5)], "front_truncation", EARLIER[5:]),
    ("summary-for-oldest", [SYSTEM, {"role": "system", "content": "Summary: earlier questions."}] + EARLIER[5:]
     + [answer(4), user(5)], "compaction", EARLIER[5:]),
    ("edited-message", EARLIER[:3] + [{"role": "user", "content": "question 1, reworded"}] + EARLIER[4:]
     + [answer(4), user(5)], "edit", EARLIER[4:]),
    ("deleted-middle-pair", EARLIER[:3] + EARLIER[5:] + [answer(4), user(5)], "edit", EARLIER[5:]),
    ("reordered", [SYSTEM] + EARLIER[3:5] + EARLIER[1:3] + EARLIER[5:] + [answer(4), user(5)], "reorder",
     EARLIER[1:]),
    ("regenerated-last-question", EARLIER[:-1] + [{"role": "user", "content": "question 4, asked again"}], None, []),
]


@pytest.mark.parametrize(("request_messages", "cause", "reprefilled"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_finding_of_a_request_against_the_earlier_one(request_messages: list[dict], cause: str | None,
                                                      reprefilled: list[dict]) -> None:
    detector = InvalidationDetector()
    first = detector.observe(fingerprint(EARLIER), bytes_per_token=4.0)
    assert first.cause is None and first.conversation is None  # a new conversation
    finding = detector.observe(fingerprint(request_messages), bytes_per_token=4.0)
    assert finding.cause == cause
    assert finding.invalidated_bytes == sum(size(m) for m in reprefilled)
    assert finding.invalidated_tokens == round(finding.invalidated_bytes / 4.0)
    if cause is not None:
        assert finding.conversation == 1 and finding.earlier_messages == len(EARLIER)


def test_an_append_only_conversation_never_counts() -> None:
    detector = InvalidationDetector()
    for turns in range(30):
        finding = detector.observe(fingerprint(chat(turns)), bytes_per_token=4.0)
        assert finding.cause is None and finding.invalidated_bytes == 0
        assert finding.conversation == (None if turns == 0 else 1)  # found again every turn
    assert len(detector) == 1


def test_a_window_sliding_every_turn_counts_the_kept_messages_each_time() -> None:
    detector = InvalidationDetector()
    history: list[dict] = []
    counted = []
    for turn in range(12):
        kept = history[-6:]  # the last three pairs
        finding = detector.observe(fingerprint([SYSTEM] + kept + [user(turn)]), bytes_per_token=4.0)
        counted.append((finding.cause, finding.invalidated_bytes))
        history += [user(turn), answer(turn)]
    # Turns 0-3 append (the window is not full); from turn 4 the window drops a pair each turn, and what
    # the previous turn kept after the system prompt (its two newest pairs and its question) is prefilled again.
    assert counted[:4] == [(None, 0)] * 4
    for turn in range(4, 12):
        again = [user(turn - 3), answer(turn - 3), user(turn - 2), answer(turn - 2), user(turn - 1)]
        assert counted[turn] == ("front_truncation", sum(size(m) for m in again)), turn


@pytest.mark.parametrize(
    ("other", "why"),
    [([SYSTEM, user(9), answer(9), user(4)], "another chat ending on the same question"),
     ([SYSTEM, user(7)], "a new chat behind the same system prompt"),
     (chat(4, system=False)[:1], "F's first question alone, nothing else of F")],
    ids=["shared-last-message", "shared-system-prompt", "one-shared-message"],
)
def test_one_shared_message_is_no_evidence_of_one_conversation(other: list[dict], why: str) -> None:
    detector = InvalidationDetector()
    detector.observe(fingerprint(EARLIER), bytes_per_token=4.0)
    finding = detector.observe(fingerprint(other), bytes_per_token=4.0)
    assert finding.cause is None and finding.invalidated_bytes == 0, why


def test_models_and_salts_are_kept_apart_by_the_seed() -> None:
    detector = InvalidationDetector()
    detector.observe(fingerprint(EARLIER), bytes_per_token=4.0)
    window = [SYSTEM] + EARLIER[3:] + [answer(4), user(5)]
    for seed in (chain_seed("llama-3.1-70b", None), chain_seed("llama-3.1-8b", "tenant-b")):
        assert detector.inspect(fingerprint(window, seed), bytes_per_token=4.0).conversation is None
    assert detector.inspect(fingerprint(window), bytes_per_token=4.0).cause == "front_truncation"


def test_changed_tools_are_an_edit_of_the_preamble() -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    detector = InvalidationDetector()
    detector.observe(fingerprint(EARLIER, tools=tools), bytes_per_token=4.0)
    finding = detector.observe(fingerprint(NEXT, tools=tools + tools), bytes_per_token=4.0)
    assert finding.cause == "edit" and finding.common_prefix_messages == 0
    assert finding.invalidated_bytes == sum(size(m) for m in EARLIER)


def test_fingerprint_elements_split_exactly_at_messages() -> None:
    tricky = [SYSTEM, {"role": "developer", "content": "rules"}, {"role": "user", "content": "a\x1eb \x1f c"}]
    fp = fingerprint(tricky, tools=[{"type": "function", "function": {"name": "x\x1e"}}])
    assert len(fp.hashes) == len(fp.sizes) == 4  # the tools preamble and three messages
    assert fp.head == 3  # preamble, system, developer
    assert fp.total_bytes == len(chat_canonical_bytes({"messages": tricky, "tools": [
        {"type": "function", "function": {"name": "x\x1e"}}]})) - 3  # each message's RS is not counted
    assert fingerprint(tricky).hashes == fp.hashes[1:]  # a message hashes alike wherever it stands


def test_inspect_changes_nothing() -> None:
    detector = InvalidationDetector(max_conversations=2)
    detector.observe(fingerprint(EARLIER), bytes_per_token=4.0)
    window = [SYSTEM] + EARLIER[3:] + [answer(4), user(5)]
    for _ in range(3):
        assert detector.inspect(window_fp := fingerprint(window), bytes_per_token=4.0).cause == "front_truncation"
        assert detector.inspect(fingerprint(chat(2, system=False)), bytes_per_token=4.0).conversation is None
    assert len(detector) == 1 and detector.observe(window_fp, bytes_per_token=4.0).cause == "front_truncation"


def test_least_recently_continued_conversation_is_forgotten_first() -> None:
    detector = InvalidationDetector(max_conversations=2)
    chats = [[{"role": "user", "content": f"chat {c} turn {t}"} for t in range(3)] for c in range(3)]
    detector.observe(fingerprint(chats[0][:1]), bytes_per_token=4.0)
    detector.observe(fingerprint(chats[1][:1]), bytes_per_token=4.0)
    detector.observe(fingerprint(chats[0][:2]), bytes_per_token=4.0)  # chat 0 continued: chat 1 is now the oldest
    detector.observe(fingerprint(chats[2][:1]), bytes_per_token=4.0)  # a third: chat 1 goes
    assert detector.inspect(fingerprint(chats[0][:3]), bytes_per_token=4.0).conversation == 1
    assert detector.inspect(fingerprint(chats[1][:2]), bytes_per_token=4.0).conversation is None


def test_a_request_over_the_message_limit_is_not_tracked() -> None:
    detector = InvalidationDetector(max_messages=8, max_total_messages=64)
    finding = detector.observe(fingerprint(chat(4)), bytes_per_token=4.0)  # 10 elements
    assert finding.cause is None and len(detector) == 0 and finding.messages == 10


@pytest.mark.parametrize("kwargs", [{"max_conversations": 0}, {"max_messages": 10, "max_total_messages": 5}])
def test_limits_are_validated(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        InvalidationDetector(**kwargs)


def _held_bytes() -> int:
    """Bytes traced to the detector's code and to this file (the hash ints its keys keep alive)."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, invalidation.__file__), tracemalloc.Filter(True, __file__)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.parametrize(("conversations", "messages_each"), [(DEFAULT_MAX_CONVERSATIONS, 1), (1_000, 48)],
                         ids=["many-short", "message-bound"])
def test_memory_stays_within_the_stated_bound(conversations: int, messages_each: int) -> None:
    """Three times the conversations the detector may hold (so eviction churns and leaves its tables'
    slack), each of fresh hashes: the traced memory stays within `memory_bound_bytes`, and within
    the per-part bound of what it holds."""
    rng = random.Random(7)
    tracemalloc.start()
    try:
        base = _held_bytes()
        detector = InvalidationDetector(max_conversations=conversations, max_total_messages=conversations * 32)
        for _ in range(3 * conversations):
            fp = MessageFingerprint(tuple(rng.getrandbits(64) for _ in range(messages_each)),
                                    tuple(rng.randrange(1, 10_000) for _ in range(messages_each)), 1)
            detector.observe(fp, bytes_per_token=4.0)
        used = _held_bytes() - base
    finally:
        tracemalloc.stop()
    assert len(detector) <= conversations and detector.held_messages <= conversations * 32
    assert used <= len(detector) * CONVERSATION_OVERHEAD_BYTES + detector.held_messages * MESSAGE_BYTES
    assert used <= detector.memory_bound_bytes
    assert InvalidationDetector().memory_bound_bytes == 8_192 * 700 + 262_144 * 12  # the module docstring's 8.9 MB
