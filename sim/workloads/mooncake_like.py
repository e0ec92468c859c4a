"""Synthetic workloads as `sim.traces.TraceRequest` lists (the same records the trace loaders give).

`mooncake_like`: conversations with the statistics of the Mooncake conversation trace
(Kimi, FAST'25; ``shared/data/traces/mooncake/conversation_trace.jsonl``), for machines
without the trace. The trace's statistics (12,031 requests, 512-token blocks):
every request starts with block 0 (a shared system prefix); 61% reuse only that block (new
conversations), the rest continue an earlier prompt; input tokens p10/p50/p90 = 964 / 6,909
/ 27,367 (max 126,195); output p10/p50/p90 = 24 / 350 / 597; κ_ratio with an infinite cache
p50 ≈ 0.6, p90 ≈ 18, p99 ≈ 890 (REFERENCE.md §1).

The generator draws new conversations' lengths from a log-normal fitted to that median and
p90 (σ = ln(27,367/6,909)/1.2816 = 1.07), continues an earlier conversation otherwise — the
one last active a sampled turn gap ago (log-normal, median 123 s, p90 483 s, as in the trace)
(its previous prompt's full blocks, then new user text, log-normal with median 200 tokens and
σ 1.6), draws 15% of new conversations short (600–1,500 tokens),
and draws outputs from a mixture (12% short, 1–60 tokens; the rest log-normal around 350).
Arrivals are Poisson at ``rate_rps``. Deterministic for a seed.

tests/unit/sim/test_workloads.py checks its input and κ_ratio quantiles against the trace's.
The longest, tersest conversations are not reproduced: its κ_ratio tail (p99) falls far short
of the trace's.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

from sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

NEW_CONVERSATION_SHARE = 0.61
NEW_INPUT_MEDIAN_TOKENS = 6_909
NEW_INPUT_SIGMA = math.log(27_367 / 6_909) / 1.2816
TURN_INPUT_MEDIAN_TOKENS = 200
TURN_INPUT_SIGMA = 1.6
SHORT_NEW_SHARE = 0.15  # new conversations of 600–1,500 tokens (the trace's κ median needs them)
OUTPUT_MEDIAN_TOKENS = 350
OUTPUT_SIGMA = 0.45
SHORT_OUTPUT_SHARE = 0.12
SYSTEM_BLOCK_ID = 0
# Seconds from a conversation's previous request to its next turn: median 123 s, p90 483 s in
# the trace (measured: the latest earlier request sharing ≥ 2 leading blocks), so most turns
# find their prefix pushed out of HBM by ~400 other requests.
TURN_GAP_MEDIAN_S = 123.0
TURN_GAP_SIGMA = math.log(483.0 / 123.0) / 1.2816
OLDEST_SHARE = 0.1  # a gap longer than the history so far picks among the oldest 10%


@dataclass
class _Conversation:
    hash_ids: list[int]
    input_tokens: int
    output_tokens: int
    last_s: float


def mooncake_like(n: int, *, rate_rps: float, seed: int = 0, max_input_tokens: int = 126_000,
                  max_output_tokens: int = 2_048) -> list[TraceRequest]:
    """``n`` requests shaped like the Mooncake conversation trace (see the module docstring).

    Args:
        n: number of requests, ≥ 0.
        rate_rps: mean arrival rate, requests/s (> 0).
        seed: random seed.
        max_input_tokens, max_output_tokens: clip lengths (the context must fit the fleet).

    Raises:
        ValueError: ``rate_rps`` ≤ 0 or ``n`` < 0.
    """
    if rate_rps <= 0 or n < 0:
        raise ValueError("rate_rps must be > 0 and n >= 0")
    rng = random.Random(seed)
    next_block = itertools.count(1)
    conversations: list[_Conversation] = []  # ordered by last request time
    out, now = [], 0.0
    for _ in range(n):
        now += rng.expovariate(rate_rps)
        output = _output_tokens(rng, max_output_tokens)
        if conversations and rng.random() > NEW_CONVERSATION_SHARE:
            conv = conversations.pop(_pick_by_gap(rng, conversations, now))
            history = conv.input_tokens + conv.output_tokens
            turn = max(int(rng.lognormvariate(math.log(TURN_INPUT_MEDIAN_TOKENS), TURN_INPUT_SIGMA)), 8)
            tokens = min(history + turn, max_input_tokens)
            kept = conv.hash_ids[: conv.input_tokens // MOONCAKE_BLOCK_TOKENS]  # its full blocks
            conv.hash_ids = kept + [next(next_block) for _ in range(_blocks(tokens) - len(kept))]
            conv.input_tokens, conv.output_tokens, conv.last_s = tokens, output, now
            conversations.append(conv)
        else:
            if rng.random() < SHORT_NEW_SHARE:
                tokens = rng.randint(600, 1_500)
            else:
                tokens = int(rng.lognormvariate(math.log(NEW_INPUT_MEDIAN_TOKENS), NEW_INPUT_SIGMA))
            tokens = min(max(tokens, MOONCAKE_BLOCK_TOKENS + 1), max_input_tokens)
            ids = [SYSTEM_BLOCK_ID] + [next(next_block) for _ in range(_blocks(tokens) - 1)]
            conv = _Conversation(ids, tokens, output, now)
            conversations.append(conv)
        out.append(TraceRequest(arrival_s=now, input_tokens=conv.input_tokens, output_tokens=output,
                                hash_ids=tuple(conv.hash_ids[: _blocks(conv.input_tokens)])))
    return out


def _pick_by_gap(rng: random.Random, conversations: list[_Conversation], now: float) -> int:
    """Index of the conversation whose last request is nearest ``now`` − a sampled turn gap."""
    target = now - rng.lognormvariate(math.log(TURN_GAP_MEDIAN_S), TURN_GAP_SIGMA)
    i = bisect.bisect_left([c.last_s for c in conversations], target)
    if i == 0:
        return rng.randrange(max(1, int(len(conversations) * OLDEST_SHARE)))
    return min(i, len(conversations) - 1)


def _blocks(tokens: int) -> int:
    return -(-tokens // MOONCAKE_BLOCK_TOKENS)


def _output_tokens(rng: random.Random, cap: int) -> int:
    if rng.random() < SHORT_OUTPUT_SHARE:
        return rng.randint(1, 60)
    return min(max(int(rng.lognormvariate(math.log(OUTPUT_MEDIAN_TOKENS), OUTPUT_SIGMA)), 1), cap)
