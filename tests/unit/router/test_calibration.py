"""Bytes-per-token calibration from reported usage."""

from __future__ import annotations

import pytest

from router.calibration import BytesPerToken


def test_default_until_samples_then_converges() -> None:
    cal = BytesPerToken(default=4.0)
    assert cal.get("m") == 4.0
    for _ in range(400):
        cal.observe("m", 3_000, 1_000)
    assert cal.get("m") == pytest.approx(3.0, rel=1e-3)
    assert cal.get("other") == 4.0


def test_first_sample_replaces_default() -> None:
    cal = BytesPerToken(default=4.0)
    cal.observe("m", 5_000, 1_000)
    assert cal.get("m") == pytest.approx(5.0)


def test_short_requests_weigh_by_their_tokens_not_as_one_sample_each() -> None:
    """Found by a newcomer: a few "Hello"s (high bytes/token: chat template) dragged the estimate
    to ~5.1 and the next 17k-token prompt was priced at 11.4k tokens."""
    cal = BytesPerToken(default=4.0)
    cal.observe("m", 68_000, 17_000)  # 4.0 bytes/token
    for _ in range(5):
        cal.observe("m", 60, 6)  # 10 bytes/token, 6 tokens each
    # Token-weighted: (weights 1, 1/2 … then the EMA) still within 1% of 4.0.
    assert cal.get("m") == pytest.approx(4.0, rel=0.01)


@pytest.mark.parametrize(("nbytes", "tokens"), [(100, 0), (0, 10), (10_000, 10), (10, 1_000)],
                         ids=["no-tokens", "no-bytes", "too-many-bytes", "too-few-bytes"])
def test_implausible_samples_are_ignored(nbytes: int, tokens: int) -> None:
    cal = BytesPerToken(default=4.0)
    assert cal.observe("m", nbytes, tokens) is False
    assert cal.get("m") == 4.0
