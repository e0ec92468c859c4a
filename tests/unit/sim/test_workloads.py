"""The Mooncake-like generator reproduces the trace's statistics (REFERENCE.md §1), deterministically."""

from __future__ import annotations

import pytest

from sim.traces import MOONCAKE_BLOCK_TOKENS
from sim.workloads import mooncake_like


def kappa_ratios(requests) -> list[float]:
    """κ_ratio with an infinite cache at 512-token blocks (hits capped at P − 1)."""
    seen: set[int] = set()
    out = []
    for r in requests:
        k = 0
        for block in r.hash_ids:
            if block not in seen:
                break
            k += 1
        cached = min(k * MOONCAKE_BLOCK_TOKENS, r.input_tokens - 1)
        out.append(cached / max(r.input_tokens - cached, 1))
        seen.update(r.hash_ids)
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


@pytest.fixture(scope="module")
def requests():
    return mooncake_like(12_000, rate_rps=3.4, seed=1)


def test_lengths_follow_the_trace(requests) -> None:
    inputs = [r.input_tokens for r in requests]
    assert quantile(inputs, 0.5) == pytest.approx(6_909, rel=0.15)
    assert quantile(inputs, 0.9) == pytest.approx(27_367, rel=0.15)
    assert quantile([r.output_tokens for r in requests], 0.5) == pytest.approx(350, rel=0.15)


def test_kappa_distribution_follows_the_trace(requests) -> None:
    kappas = kappa_ratios(requests)
    assert quantile(kappas, 0.5) == pytest.approx(0.57, rel=0.2)
    assert quantile(kappas, 0.9) == pytest.approx(18.3, rel=0.2)
    assert sum(k > 14.3 for k in kappas) / len(kappas) == pytest.approx(0.12, abs=0.02)


def test_structure_arrivals_and_determinism(requests) -> None:
    assert all(r.hash_ids[0] == 0 for r in requests)  # the shared system block
    assert all(len(r.hash_ids) == -(-r.input_tokens // MOONCAKE_BLOCK_TOKENS) for r in requests)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert len(requests) / arrivals[-1] == pytest.approx(3.4, rel=0.05)
    assert mooncake_like(50, rate_rps=1.0, seed=7) == mooncake_like(50, rate_rps=1.0, seed=7)
    assert mooncake_like(50, rate_rps=1.0, seed=7) != mooncake_like(50, rate_rps=1.0, seed=8)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rate_rps"):
        mooncake_like(10, rate_rps=0)
