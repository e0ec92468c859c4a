"""Which requests and scrape intervals feed the κ_crit fit (`dispatch.prefill_feed`)."""

from __future__ import annotations

import pytest

from fleet_config import default_catalog
from dispatch.prefill_feed import (
    MAX_MERGED_SCRAPES,
    QUEUE_SETTLE_S,
    DispatchTiming,
    PrefillFeed,
    single_step_tokens,
)
from router.cost import BackendSpec
from router.kappa_fit import PrefillPrediction

CATALOG = default_catalog()
R = PrefillPrediction(0.1, 0.0, 0.01)


def timing(*, ahead: tuple[tuple[float, int], ...] = (), overtaken: bool = False) -> DispatchTiming:
    return DispatchTiming(sent_s=10.0, ahead=ahead, overtaken=overtaken, headers_s=10.01, stream=True)


@pytest.mark.parametrize(
    ("t", "new_tokens", "alone"),
    [
        (timing(), 5_000, True),
        (timing(overtaken=True), 5_000, True),  # one step: a later request cannot join it once it runs
        (timing(overtaken=True), 9_000, False),  # chunked: a later request takes its last step's leftover budget
        (timing(ahead=((9.9, 1_000),)), 500, True),  # one single-step request ahead, running for 100 ms
        (timing(ahead=((9.99, 1_000),)), 500, False),  # sent 10 ms before: may still wait, and be admitted with it
        (timing(ahead=((9.9, 9_000),)), 500, False),  # a chunked prefill ahead: its last chunk shares a step
        (timing(ahead=((9.8, 100), (9.9, 100))), 500, False),  # two ahead: the second waits and joins
    ],
    ids=["alone", "overtaken-one-step", "overtaken-chunked", "one-running-ahead", "one-just-ahead",
         "chunked-ahead", "two-ahead"],
)
def test_prefilled_alone(t: DispatchTiming, new_tokens: int, alone: bool) -> None:
    assert QUEUE_SETTLE_S < 0.1
    assert t.prefilled_alone(new_tokens, 8_192) is alone


@pytest.mark.parametrize(("hardware", "tokens"), [("h100-sxm", 8_192), ("b200", 8_192), ("a100-80gb", 2_048),
                                                  ("l4", 2_048)])
def test_single_step_tokens_follow_vllms_defaults(hardware: str, tokens: int) -> None:
    spec = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw(hardware))
    assert single_step_tokens(spec) == tokens


def test_an_interval_counts_when_the_backends_count_grew_by_ours() -> None:
    feed = PrefillFeed()
    assert feed.scraped(10, 5.0) is None  # the first scrape only sets the baseline
    feed.completed_request(R)
    feed.completed_request(R)
    interval = feed.scraped(12, 5.5)
    assert interval is not None and interval.prefill_s == pytest.approx(0.5) and interval.requests == (R, R)
    assert feed.scraped(12, 5.5) is None  # nothing finished


@pytest.mark.parametrize("case", ["ended-otherwise", "unpredictable", "restart", "not-exported"])
def test_an_interval_is_dropped_when_it_cannot_be_attributed(case: str) -> None:
    feed = PrefillFeed()
    feed.scraped(10, 5.0)
    feed.completed_request(R)
    count, total = 11, 5.2
    if case == "ended-otherwise":
        feed.ended_otherwise()
    elif case == "unpredictable":
        feed.completed_request(None)
        count += 1
    elif case == "restart":
        count = 1
    assert feed.scraped(None if case == "not-exported" else count, total) is None


def test_a_late_end_merges_two_intervals_into_one() -> None:
    """A request whose end reached the gateway after the scrape that counted it: that interval
    stays open until the next scrape, where the counts agree again and both requests' prefills
    are one sample (before, both intervals were dropped)."""
    feed = PrefillFeed()
    feed.scraped(0, 0.0)
    feed.completed_request(R)
    assert feed.scraped(2, 0.7) is None  # the engine counted two; the gateway one so far
    feed.completed_request(R)
    interval = feed.scraped(2, 0.7)
    assert interval is not None and interval.prefill_s == pytest.approx(0.7) and interval.requests == (R, R)
    feed.completed_request(R)
    interval = feed.scraped(3, 1.0)  # and the count goes on from there
    assert interval is not None and interval.prefill_s == pytest.approx(0.3) and interval.requests == (R,)


def test_an_end_counted_at_the_gateway_first_merges_too() -> None:
    feed = PrefillFeed()
    feed.scraped(0, 0.0)
    feed.completed_request(R)
    assert feed.scraped(0, 0.0) is None  # ours ended before its engine's count moved
    interval = feed.scraped(1, 0.2)
    assert interval is not None and interval.prefill_s == pytest.approx(0.2) and interval.requests == (R,)


def test_a_merged_interval_with_an_unpredictable_request_is_dropped_whole() -> None:
    feed = PrefillFeed()
    feed.scraped(0, 0.0)
    feed.completed_request(None)
    assert feed.scraped(2, 0.9) is None
    feed.completed_request(R)
    assert feed.scraped(2, 0.9) is None  # the counts agree, but one of its two cannot be predicted
    feed.completed_request(R)
    interval = feed.scraped(3, 1.2)
    assert interval is not None and interval.prefill_s == pytest.approx(0.3)


def test_counts_that_stay_apart_drop_the_interval_and_start_afresh() -> None:
    """Another client's request there: the counts never agree again. After MAX_MERGED_SCRAPES
    open scrapes the interval is dropped, and the next one is counted from the new difference."""
    feed = PrefillFeed()
    feed.scraped(0, 0.0)
    count, total = 0, 0.0
    for _ in range(MAX_MERGED_SCRAPES + 1):
        feed.completed_request(R)
        count, total = count + 2, total + 0.5  # ours and a foreign one each time
        assert feed.scraped(count, total) is None
    feed.completed_request(R)
    interval = feed.scraped(count + 1, total + 0.2)
    assert interval is not None and interval.prefill_s == pytest.approx(0.2) and interval.requests == (R,)


def test_sequence_numbers_tell_overtaking() -> None:
    feed = PrefillFeed()
    first, ahead = feed.sent(1.0, 100)
    assert ahead == ()
    second, ahead = feed.sent(1.2, 200)
    assert ahead == ((1.0, 100),)
    assert feed.answered(first) is True  # the second was sent before the first's first byte
    assert feed.answered(second) is False
    third, ahead = feed.sent(1.5, 300)
    assert ahead == ()
    feed.failed(third)
    assert feed.pending == [None]  # the interval it ends in cannot be attributed


def test_a_request_that_ends_otherwise_spoils_only_its_own_interval() -> None:
    feed = PrefillFeed()
    feed.scraped(0, 0.0)
    feed.completed_request(R)
    feed.ended_otherwise()
    assert feed.scraped(1, 0.1) is None
    feed.completed_request(R)
    interval = feed.scraped(2, 0.2)
    assert interval is not None and interval.requests == (R,)
