"""vLLM's chunked-prefill schedule replayed on the gateway's requests (`dispatch.prefill_schedule`): which
steps each request's prefill time holds, by value (Llama-3.1-8B on one H100, 8,192 tokens a step)."""

from __future__ import annotations

import pytest

from dispatch.prefill_feed import tiers
from dispatch.prefill_schedule import PrefillSchedule
from tests.unit.dispatch.feed_support import SPEC, candidate, seconds, step, usage

PROFILE = (1.0, 1.0, 1.0, 1.0)


def request(schedule: PrefillSchedule, sequence: int, sent_s: float, first_token_s: float | None, prompt: int,
            *, host: int = 0, reported_cached: int | None = None, done_s: float = 100.0) -> None:
    """One request: sent, its first token (None: not streamed), completed with usage at ``done_s``."""
    schedule.sent(sequence, sent_s)
    if first_token_s is not None:
        schedule.first_token(sequence, first_token_s)
    cached = host if reported_cached is None else reported_cached
    tokens, by_tier = tiers(candidate(prompt, host=host), usage(prompt, cached))
    schedule.completed(sequence, tokens, by_tier, done_s)


def test_a_waiting_request_shares_the_last_step_of_a_chunked_one() -> None:
    """10,000 new tokens (8,192 + 1,808) and 3,000 sent with it: the second is admitted with the 6,384
    tokens of budget the first's last chunk leaves, so both prompts end in that step. The first's prefill
    holds both steps, the second's the shared one."""
    s = PrefillSchedule(SPEC, 8_192)
    first_s = seconds(step([(8_192, 0)]))
    shared = step([(1_808, 8_192), (3_000, 0)])
    end_s = 1.0 + first_s + seconds(shared)
    request(s, 1, 1.0, end_s, 10_000)
    request(s, 2, 1.0, end_s, 3_000)
    s.interval(2 * end_s, (1, 2), 200.0)
    [interval] = s.ready(PROFILE, 200.0)
    assert interval.requests == (step([(8_192, 0)]), shared, shared)


@pytest.mark.parametrize(
    ("second_sent_s", "second_first_token_after_s", "joined"),
    [
        (1.0, 0.0, True),  # waiting when the step began: its first token comes with the other's
        (1.0, 0.5, False),  # would fit, but came later: it waited for KV, not budget, and ran on its own
        (5.0, 0.2, False),  # sent after the other's first token: the engine was free of prefills
    ],
    ids=["joined", "waited-for-kv", "sent-after"],
)
def test_who_joins_a_step(second_sent_s: float, second_first_token_after_s: float, joined: bool) -> None:
    s = PrefillSchedule(SPEC, 8_192)
    alone = step([(2_000, 0)])
    first_end_s = 1.0 + seconds(alone)
    second_first_s = max(first_end_s, second_sent_s) + second_first_token_after_s
    request(s, 1, 1.0, first_end_s, 2_000)
    request(s, 2, second_sent_s, second_first_s, 1_000)
    s.interval(1.0, (2,), 200.0)
    [interval] = s.ready(PROFILE, 200.0)
    # not joined: it ran on its own, beside the first's decode
    assert interval.requests == ((step([(2_000, 0), (1_000, 0)]),) if joined else (step([(1_000, 0)], decodes=(2_000,)),))


def test_decodes_running_there_are_in_the_step() -> None:
    """A request decoding (first token before, not finished) reads its KV in every step."""
    s = PrefillSchedule(SPEC, 8_192)
    request(s, 1, 0.0, 0.1, 4_000, done_s=50.0)
    request(s, 2, 10.0, 10.2, 1_000, done_s=11.0)
    s.interval(1.0, (2,), 200.0)
    [interval] = s.ready(PROFILE, 200.0)
    assert interval.requests == (step([(1_000, 0)], decodes=(4_000,)),)


def test_a_host_tier_load_is_priced_in_the_step_that_admits_it() -> None:
    s = PrefillSchedule(SPEC, 8_192)
    request(s, 1, 0.0, 0.2, 30_000, host=29_952)
    s.interval(1.0, (1,), 200.0)
    [interval] = s.ready(PROFILE, 200.0)
    assert interval.requests == (step([(48, 29_952)], host_tokens=29_952),)


@pytest.mark.parametrize("spoiler", ["tiers-unknown", "no-first-token", "no-usage"])
def test_what_spoils_a_layout_spoils_its_intervals_until_the_engine_is_free(spoiler: str) -> None:
    """A request whose cached tokens the index did not foresee (its loads are unknown), one without a
    first-token time (where its step ended is unknown), one without usage (its tokens are unknown):
    the intervals of the requests that ran with it (its first token with the first's) are dropped; a
    request sent after it finished counts."""
    s = PrefillSchedule(SPEC, 8_192)
    if spoiler == "no-usage":
        s.sent(1, 1.0)
        s.completed(1, None, None, 3.0)
    else:
        request(s, 1, 1.0, None if spoiler == "no-first-token" else 1.5, 2_000, host=1_024,
                reported_cached=0 if spoiler == "tiers-unknown" else None, done_s=3.0)
    request(s, 2, 1.0, 1.5, 1_000, done_s=3.0)  # with it
    request(s, 3, 10.0, 10.2, 1_000)  # long after
    s.interval(1.0, (2,), 20.0)
    s.interval(0.2, (3,), 20.0)
    [interval] = s.ready(PROFILE, 20.0)
    assert interval.prefill_s == 0.2 and interval.requests == (step([(1_000, 0)]),)


def test_an_interval_waits_for_the_requests_its_steps_share() -> None:
    """The first's last step may still take the second's first chunk: nothing is attributed until the
    second completed and was laid out."""
    s = PrefillSchedule(SPEC, 8_192)
    request(s, 1, 1.0, 1.5, 2_000)
    s.sent(2, 1.0)
    s.first_token(2, 1.5)
    s.interval(1.0, (1,), 2.0)
    assert s.ready(PROFILE, 2.0) == []
    tokens, by_tier = tiers(candidate(1_000), usage(1_000))
    s.completed(2, tokens, by_tier, 3.0)
    [interval] = s.ready(PROFILE, 3.0)
    assert interval.requests == (step([(2_000, 0), (1_000, 0)]),)


@pytest.mark.parametrize(("counted", "kept"), [(29_952, True), (29_952 - 5_000, False)],
                         ids=["as-the-index-said", "fewer-loaded"])
def test_the_engines_loaded_token_count_checks_the_tiers(counted: int, kept: bool) -> None:
    """vLLM counted ``counted`` tokens loaded between the scrapes around the request's admission: the
    index's 29,952 host-tier tokens are trusted only when they agree."""
    s = PrefillSchedule(SPEC, 8_192)
    s.loaded(0.0, 0.0)
    request(s, 1, 1.0, 1.2, 30_000, host=29_952)
    s.loaded(2.0, float(counted))
    s.interval(1.0, (1,), 2.0)
    assert [len(iv.requests) for iv in s.ready(PROFILE, 2.0)] == ([1] if kept else [])
