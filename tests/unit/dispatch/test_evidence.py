"""Answers' cached_tokens against the index's credit: outcomes, and when a holder becomes stale."""

from __future__ import annotations

import pytest

from dispatch.evidence import CachedTokensEvidence, Outcome
from prefix_index import KV_POOL_ID

BLOCK = 64.0  # tokens per index block


def answer(evidence: CachedTokensEvidence, *, local: int = 0, in_flight: int = 0, kv_pool: int = 0, reported: int,
           backend: str = "a", epoch: int = 0):
    return evidence.observe(backend, local_tokens=local, in_flight_tokens=in_flight, kv_pool_tokens=kv_pool,
                            reported_tokens=reported, block_tokens=BLOCK, epoch=epoch)


@pytest.mark.parametrize(("local", "kv_pool", "reported", "outcome"), [
    (0, 0, 0, Outcome.WITHIN_ONE_BLOCK),
    (1_023, 0, 1_008, Outcome.WITHIN_ONE_BLOCK),       # vLLM counts 16-token blocks, never the last token
    (1_000, 0, 1_064, Outcome.WITHIN_ONE_BLOCK),       # exactly one block apart
    (1_000, 0, 1_065, Outcome.UNDER),
    (512, 4_000, 4_000, Outcome.OVER),                 # the pool part was not there
    (0, 0, 3_072, Outcome.UNDER),                      # a prefix prefilled elsewhere reached the pool first
], ids=["cold", "block-rounding", "one-block", "under", "over", "under-pool-race"])
def test_outcome_is_within_one_index_block(local: int, kv_pool: int, reported: int, outcome: str) -> None:
    assert answer(CachedTokensEvidence(), local=local, kv_pool=kv_pool, reported=reported).outcome == outcome


def test_three_short_answers_in_a_row_make_a_backend_stale() -> None:
    evidence = CachedTokensEvidence()
    assert answer(evidence, local=4_000, reported=0).stale == ()
    assert answer(evidence, local=6_000, reported=512).stale == ()
    assert answer(evidence, local=2_000, reported=0).stale == ("a",)
    assert answer(evidence, local=2_000, reported=0).stale == ()  # the count starts again


def test_an_answer_that_bears_the_credit_out_breaks_the_run() -> None:
    evidence = CachedTokensEvidence()
    answer(evidence, local=4_000, reported=0)
    answer(evidence, local=4_000, reported=0)
    assert answer(evidence, local=4_000, reported=2_500).stale == ()  # evicted in part: more than half there
    assert answer(evidence, local=4_000, reported=0).stale == ()
    assert answer(evidence, local=4_000, reported=0).stale == ()
    assert answer(evidence, local=4_000, reported=0).stale == ("a",)


@pytest.mark.parametrize(("local", "in_flight", "reported"), [
    (255, 0, 0),         # under four blocks: rounding alone could explain it
    (1_024, 1_024, 0),   # all of it from a prefill still in flight: vLLM caches it chunk by chunk
], ids=["too-little-credit", "in-flight-only"])
def test_no_evidence(local: int, in_flight: int, reported: int) -> None:
    evidence = CachedTokensEvidence()
    for _ in range(5):
        assert answer(evidence, local=local, in_flight=in_flight, reported=reported).stale == ()


def test_backends_keep_their_own_runs_and_the_pool_one_over_all() -> None:
    evidence = CachedTokensEvidence()
    assert answer(evidence, backend="a", local=4_000, reported=0).stale == ()
    assert answer(evidence, backend="b", local=4_000, reported=0).stale == ()
    # The pool's credit missing on three different backends: the pool is stale, no backend is.
    assert answer(evidence, backend="a", kv_pool=9_000, reported=0).stale == ()
    assert answer(evidence, backend="b", kv_pool=9_000, reported=300).stale == ()
    assert answer(evidence, backend="c", local=512, kv_pool=9_000, reported=512).stale == (KV_POOL_ID,)
    # Both short at once, a third time for each: both stale.
    evidence = CachedTokensEvidence()
    for _ in range(2):
        assert answer(evidence, local=4_000, kv_pool=9_000, reported=0).stale == ()
    assert answer(evidence, local=4_000, kv_pool=9_000, reported=0).stale == ("a", KV_POOL_ID)


def test_the_pool_delivering_its_part_is_no_miss() -> None:
    evidence = CachedTokensEvidence()
    for _ in range(5):
        assert answer(evidence, local=512, kv_pool=9_000, reported=9_472).stale == ()


def test_answers_routed_before_a_forget_are_ignored() -> None:
    evidence = CachedTokensEvidence()
    answer(evidence, local=4_000, reported=0, epoch=0)
    evidence.forgotten("a", epoch=1)
    for _ in range(5):  # requests routed on the dropped entries, still coming back
        assert answer(evidence, local=4_000, reported=0, epoch=0).stale == ()
    answer(evidence, local=4_000, reported=0, epoch=1)
    answer(evidence, local=4_000, reported=0, epoch=1)
    assert answer(evidence, local=4_000, reported=0, epoch=2).stale == ("a",)
