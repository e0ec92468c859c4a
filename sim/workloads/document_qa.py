"""Document QA: a few long documents, many short questions about them.

Each request is a shared system prompt (one block), one of ``documents`` long documents and
a short question; the answer is short. With the document cached, K is the document (tens of
thousands of tokens) and T the question (tens), so κ_ratio is in the thousands — the regime
of NarrativeQA (≈5,000) and FinQA (≈10,000) in REFERENCE.md §1, where moving a cached
prefix over a slow link can cost more than the prefill it saves, and where keeping every
document resident everywhere does not fit: the documents together (`DOC_MIN_TOKENS` –
`DOC_MAX_TOKENS` each, ~670k tokens for twelve) outgrow one backend's HBM KV cache
(config/fleets/*.yaml: 0.5–1.5M tokens, part of it held by running requests).

Documents are drawn by a Zipf popularity (weight 1/rank), questions arrive as a Poisson
process at ``rate_rps``. Question lengths log-normal median `QUESTION_MEDIAN_TOKENS`,
answers median `ANSWER_MEDIAN_TOKENS` (assumed, stated). Documents are whole blocks, so a
question starts a block of its own and never shares it. Deterministic for a seed.
"""

from __future__ import annotations

import random

from sim.traces import TraceRequest
from sim.workloads.sessions import BLOCK_TOKENS, BlockNamer, lognormal_int

DOC_SYSTEM_TOKENS = BLOCK_TOKENS
"""The shared instructions, tokens (one 512-token block)."""
DEFAULT_DOCUMENTS = 12
DOC_MIN_TOKENS, DOC_MAX_TOKENS = 16_384, 98_304
"""Document lengths, uniform in whole 512-token blocks between these (16k–96k tokens)."""
QUESTION_MEDIAN_TOKENS, QUESTION_SIGMA = 24, 0.5
ANSWER_MEDIAN_TOKENS, ANSWER_SIGMA = 80, 0.6


def document_qa(n: int, *, rate_rps: float, seed: int = 0, documents: int = DEFAULT_DOCUMENTS) -> list[TraceRequest]:
    """``n`` questions about ``documents`` long documents (see the module docstring).

    Args:
        n: requests, ≥ 0.
        rate_rps: mean arrival rate, requests/s (> 0).
        seed: random seed (document lengths, choices, questions, arrivals).
        documents: how many documents, ≥ 1.

    Raises:
        ValueError: ``n`` < 0, ``rate_rps`` ≤ 0 or ``documents`` < 1.
    """
    if n < 0 or rate_rps <= 0 or documents < 1:
        raise ValueError("n must be >= 0, rate_rps > 0 and documents >= 1")
    rng = random.Random(f"document-qa-{seed}")
    namer = BlockNamer(DOC_SYSTEM_TOKENS // BLOCK_TOKENS)
    doc_tokens = [rng.randint(DOC_MIN_TOKENS // BLOCK_TOKENS, DOC_MAX_TOKENS // BLOCK_TOKENS) * BLOCK_TOKENS
                  for _ in range(documents)]
    weights = [1.0 / rank for rank in range(1, documents + 1)]
    out, now = [], 0.0
    for i in range(n):
        now += rng.expovariate(rate_rps)
        doc = rng.choices(range(documents), weights)[0]
        question = lognormal_int(rng, QUESTION_MEDIAN_TOKENS, QUESTION_SIGMA, 4, BLOCK_TOKENS)
        answer = lognormal_int(rng, ANSWER_MEDIAN_TOKENS, ANSWER_SIGMA, 4, 512)
        hash_ids = namer.prompt(("doc", doc), doc_tokens[doc]) + tuple(namer.stream(("question", i), question))
        out.append(TraceRequest(arrival_s=now, input_tokens=DOC_SYSTEM_TOKENS + doc_tokens[doc] + question,
                                output_tokens=answer, hash_ids=hash_ids))
    return out

