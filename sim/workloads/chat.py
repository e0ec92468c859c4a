"""Multi-turn chat, whole or under a sliding-window truncation of its history.

Every conversation starts with one shared system prompt (`CHAT_SYSTEM_TOKENS`, two
blocks) and grows by a user message and an answer per turn; a turn's prompt is the system
prompt, the history and the new user message (ShareGPT-style chat, REFERENCE.md §1: its
κ_ratio grows with the conversation).

With ``window_tokens`` set, a prompt longer than the window drops the oldest (user,
answer) pairs until it fits — what a client that keeps "the last N tokens of context" does
(LangChain ``trim_messages``, a 4,096-token window as Mistral-7B's sliding window). Each turn
after the window fills drops one more pair, so the prompt no longer begins with the previous
prompt: everything after the system prompt is a new stream (`sim.workloads.sessions`) and
the prefix cache finds only the system prompt. Nothing errors and nothing warns — the hit
rate silently collapses, which the simulator shows (`tests/unit/sim/test_workloads_sessions.py`
measures it without any engine).

With ``messages=True`` every record also carries the chat it sends (`sim.traces.TraceRequest.messages`,
and its conversation as ``session_id``): the system prompt (the head blocks' text,
`sim.traces.prompt_text`), then each kept (user, answer) pair and the new user message, each text
drawn from its conversation, turn and role alone (`sim.traces.unique_words`, one word a token), so
the windowed chat sends the whole chat's messages minus its oldest pairs — what a live gateway sees
of a sliding window (`prefix_index.invalidation`). Token counts and arrivals are those of the
records without messages; the simulator takes only those (`sim.prompts.prepare_trace`).

Assumed figures (no public trace gives them together; chosen to be plausible and stated):
turns per conversation log-normal, median `CHAT_TURNS_MEDIAN`; user messages median
`CHAT_USER_MEDIAN_TOKENS`; answers median `CHAT_ANSWER_MEDIAN_TOKENS`; the next turn comes
a think time (median `CHAT_THINK_MEDIAN_S`) after the previous request. Conversations
start as a Poisson process at ``rate_rps`` / the mean number of turns, so requests arrive at
about ``rate_rps``. Deterministic for a seed; the windowed and the whole workload with the
same seed hold the same conversations (same messages, same arrivals), only truncated (unless
a whole conversation reaches `MAX_CONTEXT_TOKENS` and ends early: ~80 long turns).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from sim.traces import TraceRequest, prompt_text, unique_words
from sim.workloads.sessions import BLOCK_TOKENS, BlockNamer, Turn, interleave, lognormal_int

CHAT_SYSTEM_TOKENS = 2 * BLOCK_TOKENS
"""The shared system prompt, tokens (two 512-token blocks)."""
CHAT_TURNS_MEDIAN, CHAT_TURNS_SIGMA, CHAT_TURNS_MAX = 14, 0.6, 80
CHAT_USER_MEDIAN_TOKENS, CHAT_USER_SIGMA, CHAT_USER_MAX_TOKENS = 120, 0.9, 2_000
CHAT_ANSWER_MEDIAN_TOKENS, CHAT_ANSWER_SIGMA = 350, 0.5
CHAT_THINK_MEDIAN_S, CHAT_THINK_SIGMA = 30.0, 0.8
DEFAULT_WINDOW_TOKENS = 4_096
"""The sliding window: 4,096 tokens (Mistral-7B-v0.1's attention window, REFERENCE.md §1)."""
MAX_CONTEXT_TOKENS = 120_000
"""A conversation ends before its prompt would pass this (Llama-3.1's 128k context, less answers)."""


def _mean_turns() -> float:
    return CHAT_TURNS_MEDIAN * math.exp(CHAT_TURNS_SIGMA ** 2 / 2)


WARMUP_S = 2 * CHAT_TURNS_MEDIAN * math.exp(CHAT_TURNS_SIGMA ** 2 / 2) * CHAT_THINK_MEDIAN_S * math.exp(
    CHAT_THINK_SIGMA ** 2 / 2)
"""Sessions run this long before the trace starts (`sessions.interleave`): twice a mean
conversation's length, 2 × 16.7 turns × 41 s ≈ 1,370 s."""


def multi_turn_chat(n: int, *, rate_rps: float, seed: int = 0, window_tokens: int | None = None,
                    messages: bool = False) -> list[TraceRequest]:
    """``n`` chat requests (see the module docstring), whole or sliding-window truncated.

    Args:
        n: requests, ≥ 0.
        rate_rps: mean request arrival rate, requests/s (> 0).
        seed: random seed.
        window_tokens: the sliding window, tokens (≥ `CHAT_SYSTEM_TOKENS` + the longest user
            message, so every turn fits); None keeps the whole history.
        messages: also give each record its chat messages and conversation (module docstring).

    Raises:
        ValueError: ``n`` < 0, ``rate_rps`` ≤ 0, or a window no larger than the system prompt.
    """
    if window_tokens is not None and window_tokens < CHAT_SYSTEM_TOKENS + CHAT_USER_MAX_TOKENS:
        raise ValueError(f"window_tokens must be at least {CHAT_SYSTEM_TOKENS + CHAT_USER_MAX_TOKENS}, "
                         f"got {window_tokens}")
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    namer = BlockNamer(CHAT_SYSTEM_TOKENS // BLOCK_TOKENS)
    limit = window_tokens if window_tokens is not None else MAX_CONTEXT_TOKENS
    system = {"role": "system", "content": prompt_text(TraceRequest(0.0, CHAT_SYSTEM_TOKENS, 1, namer.head_ids))}

    def conversation(rng: random.Random, number: int) -> Iterator[Turn]:
        turns = lognormal_int(rng, CHAT_TURNS_MEDIAN, CHAT_TURNS_SIGMA, 1, CHAT_TURNS_MAX)
        pairs: list[int] = []  # tokens of each finished (user, answer) pair
        first = 0  # the oldest pair still in the prompt
        body = 0  # tokens of pairs[first:]
        history: list[dict] = []  # with messages: each finished pair's user and answer message
        session = f"chat-{seed}-{number}"
        for turn in range(turns):
            user = lognormal_int(rng, CHAT_USER_MEDIAN_TOKENS, CHAT_USER_SIGMA, 4, CHAT_USER_MAX_TOKENS)
            answer = lognormal_int(rng, CHAT_ANSWER_MEDIAN_TOKENS, CHAT_ANSWER_SIGMA, 8, 2_000)
            while CHAT_SYSTEM_TOKENS + body + user > limit and first < len(pairs) and window_tokens is not None:
                body -= pairs[first]
                first += 1
            stream = body + user
            if CHAT_SYSTEM_TOKENS + stream > limit:
                return  # the whole history reached the model's context: the chat ends
            gap = rng.lognormvariate(math.log(CHAT_THINK_MEDIAN_S), CHAT_THINK_SIGMA)
            if not messages:
                yield Turn(CHAT_SYSTEM_TOKENS + stream, answer, namer.prompt((number, first), stream), gap)
            else:
                asked = {"role": "user", "content": unique_words(f"{session}-{turn}-user", user)}
                yield Turn(CHAT_SYSTEM_TOKENS + stream, answer, namer.prompt((number, first), stream), gap,
                           messages=(system, *history[2 * first:], asked), session_id=session)
                history += (asked, {"role": "assistant", "content": unique_words(f"{session}-{turn}-answer", answer)})
            pairs.append(user + answer)
            body += user + answer

    # The windowed and whole chats draw the same conversations: both seed their sessions as "chat".
    return interleave(n, session_rate_rps=rate_rps / _mean_turns(), seed=seed, name="chat", session=conversation,
                      warmup_s=WARMUP_S)
