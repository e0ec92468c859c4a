"""Agentic coding: long contexts that only ever grow at their end.

A session is one agent solving one task: a shared system prompt (instructions and tool
schemas, `AGENT_SYSTEM_TOKENS`), the task and the code it reads first, then a loop — the
model answers (a tool call or an edit), the tool's result (a file, a diff, a test log) is
appended, and the whole context goes back. Nothing is ever removed, so each request's
prompt is the previous prompt plus one answer and one tool result: the prefix cache holds
almost all of it when the session stays on one backend and its blocks survive, and κ_ratio
grows with the session (tens, with contexts of tens of thousands of tokens).

Assumed figures (stated, not measured from a public trace): task context log-normal
median `AGENT_TASK_MEDIAN_TOKENS`; steps per session median `AGENT_STEPS_MEDIAN`; answers
median `AGENT_ANSWER_MEDIAN_TOKENS`; tool results median `AGENT_TOOL_MEDIAN_TOKENS` with a
heavy tail (σ 1.0: a log or a whole file now and then); the next request comes a median
`AGENT_GAP_MEDIAN_S` after the previous one (the answer's decoding plus the tool's run, as
an open loop). A session ends after its steps or before its context would pass
`MAX_CONTEXT_TOKENS`. Sessions start as a Poisson process at ``rate_rps`` / the mean
number of steps. Deterministic for a seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from sim.traces import TraceRequest
from sim.workloads.sessions import BLOCK_TOKENS, BlockNamer, Turn, interleave, lognormal_int

AGENT_SYSTEM_TOKENS = 16 * BLOCK_TOKENS
"""The shared instructions and tool schemas, tokens (8,192: sixteen 512-token blocks)."""
AGENT_TASK_MEDIAN_TOKENS, AGENT_TASK_SIGMA = 6_000, 0.6
AGENT_STEPS_MEDIAN, AGENT_STEPS_SIGMA, AGENT_STEPS_MAX = 20, 0.5, 100
AGENT_ANSWER_MEDIAN_TOKENS, AGENT_ANSWER_SIGMA = 250, 0.6
AGENT_TOOL_MEDIAN_TOKENS, AGENT_TOOL_SIGMA = 1_200, 1.0
AGENT_GAP_MEDIAN_S, AGENT_GAP_SIGMA = 8.0, 0.7
MAX_CONTEXT_TOKENS = 120_000
"""A session stops before its prompt plus answer would pass this (Llama-3.1's 128k context)."""


def _mean_steps() -> float:
    return AGENT_STEPS_MEDIAN * math.exp(AGENT_STEPS_SIGMA ** 2 / 2)


WARMUP_S = 2 * AGENT_STEPS_MEDIAN * math.exp(AGENT_STEPS_SIGMA ** 2 / 2) * AGENT_GAP_MEDIAN_S * math.exp(
    AGENT_GAP_SIGMA ** 2 / 2)
"""Sessions run this long before the trace starts (`sessions.interleave`): twice a mean
session's length, 2 × 22.7 steps × 10.2 s ≈ 460 s."""


def agentic_coding(n: int, *, rate_rps: float, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests of coding-agent sessions (see the module docstring).

    Args:
        n: requests, ≥ 0.
        rate_rps: mean request arrival rate, requests/s (> 0).
        seed: random seed.

    Raises:
        ValueError: ``n`` < 0 or ``rate_rps`` ≤ 0.
    """
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    namer = BlockNamer(AGENT_SYSTEM_TOKENS // BLOCK_TOKENS)

    def session(rng: random.Random, number: int) -> Iterator[Turn]:
        steps = lognormal_int(rng, AGENT_STEPS_MEDIAN, AGENT_STEPS_SIGMA, 2, AGENT_STEPS_MAX)
        context = lognormal_int(rng, AGENT_TASK_MEDIAN_TOKENS, AGENT_TASK_SIGMA, 200, 40_000)
        for _ in range(steps):
            answer = lognormal_int(rng, AGENT_ANSWER_MEDIAN_TOKENS, AGENT_ANSWER_SIGMA, 8, 2_048)
            if AGENT_SYSTEM_TOKENS + context + answer > MAX_CONTEXT_TOKENS:
                return
            gap = rng.lognormvariate(math.log(AGENT_GAP_MEDIAN_S), AGENT_GAP_SIGMA)
            yield Turn(AGENT_SYSTEM_TOKENS + context, answer, namer.prompt(number, context), gap)
            context += answer + lognormal_int(rng, AGENT_TOOL_MEDIAN_TOKENS, AGENT_TOOL_SIGMA, 16, 32_000)

    return interleave(n, session_rate_rps=rate_rps / _mean_steps(), seed=seed, name="agentic", session=session,
                      warmup_s=WARMUP_S)
