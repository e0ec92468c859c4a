"""Which scrape intervals feed the fit (`dispatch.prefill_feed`): counts, merges, spoilers, tiers."""

from __future__ import annotations

import pytest

from dispatch.prefill_feed import MAX_MERGED_SCRAPES, PrefillFeed, single_step_tokens, tiers
from router.cost import BackendSpec
from tests.unit.dispatch.feed_support import CATALOG, SPEC, candidate, step, usage


def alone(feed: PrefillFeed, at_s: float, prompt: int = 1_000) -> int:
    """A streamed request of ``prompt`` new tokens sent at ``at_s``, alone there: first token 50 ms
    later, done 100 ms later."""
    sequence = feed.sent(at_s, candidate(prompt))
    feed.first_token(sequence, at_s + 0.05)
    feed.completed_request(sequence, usage(prompt), at_s + 0.1)
    return sequence


@pytest.mark.parametrize(("hardware", "tokens"), [("h100-sxm", 8_192), ("b200", 8_192), ("a100-80gb", 2_048),
                                                  ("l4", 2_048)])
def test_single_step_tokens_follow_vllms_defaults(hardware: str, tokens: int) -> None:
    spec = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw(hardware))
    assert single_step_tokens(spec) == tokens


def test_an_interval_counts_when_the_backends_count_grew_by_ours() -> None:
    feed = PrefillFeed(SPEC)
    assert feed.scraped(10, 5.0, end_s=0.0) == []  # the first scrape only sets the baseline
    alone(feed, 1.0, 1_000)
    alone(feed, 2.0, 2_000)
    [interval] = feed.scraped(12, 5.5, end_s=3.0)
    assert interval.prefill_s == pytest.approx(0.5) and interval.end_s == 3.0
    assert interval.requests == (step([(1_000, 0)]), step([(2_000, 0)]))
    assert feed.scraped(12, 5.5, end_s=4.0) == []  # nothing finished


@pytest.mark.parametrize("case", ["ended-otherwise", "not-fed", "restart", "not-exported"])
def test_an_interval_is_dropped_when_it_cannot_be_attributed(case: str) -> None:
    feed = PrefillFeed(SPEC)
    feed.scraped(10, 5.0, end_s=0.0)
    alone(feed, 1.0)
    count, total = 11, 5.2
    if case == "ended-otherwise":
        feed.ended_otherwise(feed.sent(1.5, candidate(500)), 1.6)
    elif case == "not-fed":  # a split's decode phase
        feed.completed_request(-1, usage(500), 1.6)
        count += 1
    elif case == "restart":
        count = 1
    assert feed.scraped(None if case == "not-exported" else count, total, end_s=3.0) == []


def test_a_late_end_merges_two_intervals_into_one() -> None:
    """A request whose end reached the gateway after the scrape that counted it: that interval
    stays open until the next scrape, where the counts agree again and both requests' prefills
    are one sample."""
    feed = PrefillFeed(SPEC)
    feed.scraped(0, 0.0, end_s=0.0)
    alone(feed, 1.0)
    assert feed.scraped(2, 0.7, end_s=2.0) == []  # the engine counted two; the gateway one so far
    alone(feed, 2.05)
    [interval] = feed.scraped(2, 0.7, end_s=3.0)
    assert interval.prefill_s == pytest.approx(0.7) and len(interval.requests) == 2
    alone(feed, 4.0)
    [interval] = feed.scraped(3, 1.0, end_s=5.0)  # and the count goes on from there
    assert interval.prefill_s == pytest.approx(0.3) and len(interval.requests) == 1


def test_counts_that_stay_apart_drop_the_interval_and_start_afresh() -> None:
    """Another client's request there: the counts never agree again. After MAX_MERGED_SCRAPES
    open scrapes the interval is dropped, and the next one is counted from the new difference."""
    feed = PrefillFeed(SPEC)
    feed.scraped(0, 0.0, end_s=0.0)
    count, total = 0, 0.0
    for k in range(MAX_MERGED_SCRAPES + 1):
        alone(feed, 1.0 + k)
        count, total = count + 2, total + 0.5  # ours and a foreign one each time
        assert feed.scraped(count, total, end_s=1.5 + k) == []
    alone(feed, 10.0)
    [interval] = feed.scraped(count + 1, total + 0.2, end_s=11.0)
    assert interval.prefill_s == pytest.approx(0.2) and len(interval.requests) == 1


def test_a_request_that_ends_otherwise_spoils_only_its_own_interval() -> None:
    feed = PrefillFeed(SPEC)
    feed.scraped(0, 0.0, end_s=0.0)
    alone(feed, 1.0)
    feed.failed(feed.sent(1.2, candidate(800)), 1.3)
    assert feed.scraped(1, 0.1, end_s=2.0) == []
    alone(feed, 3.0)
    [interval] = feed.scraped(2, 0.2, end_s=4.0)
    assert interval.requests == (step([(1_000, 0)]),)


@pytest.mark.parametrize(
    ("hbm", "host", "cached", "expected"),
    [
        (0, 4_096, 4_096, (0.0, 4_096.0, 0.0)),  # as the index said
        (1_024, 3_072, 4_000, (1_000.0, 3_000.0, 0.0)),  # 96 fewer (within 128): scaled by 4000/4096
        (0, 4_096, 0, None),  # the engine had nothing: which tier is unknown
    ],
)
def test_tiers_scale_the_index_split_to_the_reported_count(hbm: int, host: int, cached: int,
                                                           expected: tuple[float, float, float] | None) -> None:
    tokens, by_tier = tiers(candidate(10_000, hbm=hbm, host=host), usage(10_000, cached))
    assert tokens == (10_000, cached)
    assert by_tier == (pytest.approx(expected) if expected else None)
