"""The exact index's matches in the router's units (`dispatch.exact`): whatever the index's
tokens-per-block estimate, the router's ``int(blocks × block_size_tokens)`` gives back the exact tokens,
and an exact backend's in-flight and KV-pool credit is counted in engine blocks (`exact_credit`)."""

from __future__ import annotations

import random

import pytest

from dispatch.exact import exact_credit, with_exact
from prefix_index import BlockMatch, PendingChains
from prefix_index.engine_index import NO_EXACT_MATCH, ExactMatch


@pytest.mark.parametrize("hbm_blocks, host_blocks, engine_block", [(0, 0, 16), (3, 1, 16), (0, 5, 16), (1, 0, 64),
                                                                   (4000, 123, 16)])
def test_tokens_survive_the_routers_rounding(hbm_blocks: int, host_blocks: int, engine_block: int) -> None:
    rng = random.Random(hbm_blocks * 7 + host_blocks)
    exact = {"b": ExactMatch(hbm_blocks, host_blocks, engine_block)}
    for _ in range(2000):
        per_index_block = rng.uniform(1.0, 200.0)
        got = with_exact({}, exact, per_index_block)["b"]
        assert int(got.hbm_blocks * per_index_block) == hbm_blocks * engine_block
        assert int(got.host_blocks * per_index_block) == host_blocks * engine_block
        assert got.matched_blocks == got.hbm_blocks + got.host_blocks


def test_only_the_exact_backends_are_replaced() -> None:
    approximate = {"a": BlockMatch(5, 5, 0), "b": BlockMatch(9, 2, 7)}
    got = with_exact(approximate, {"b": ExactMatch(0, 0, 16)}, 64.0)
    assert got == {"a": BlockMatch(5, 5, 0), "b": BlockMatch(0, 0, 0)}
    assert approximate["b"] == BlockMatch(9, 2, 7)  # not mutated


TPB = 71.3  # a calibrated tokens-per-index-block far from the engine's 16


def _tokens(match: BlockMatch) -> tuple[int, int, int, int]:
    """(HBM, host, pool, in flight) tokens as the router reads them: int(blocks × tokens per block)."""
    return (int(match.hbm_blocks * TPB), int(match.host_blocks * TPB), int(match.kv_pool_blocks * TPB),
            int(match.in_flight_blocks * TPB))


def test_in_flight_credit_is_the_engine_blocks_a_running_request_shares() -> None:
    in_flight = PendingChains()
    in_flight.add("m", "b", [11, 12, 13, 14, 15])  # a request in flight on b: five engine blocks
    in_flight.add("m", "c", [99])  # another prefix on c
    exact = {"b": ExactMatch(1, 0, 16), "c": ExactMatch(2, 1, 16)}
    got = exact_credit(exact, model="m", engine_hashes=[11, 12, 13, 20], engine_block_tokens=16, in_flight=in_flight,
                       kv_pool=None, tokens_per_block=TPB)
    assert _tokens(got["b"]) == (48, 0, 0, 48)  # three shared blocks, being computed there: HBM
    assert _tokens(got["c"]) == (32, 16, 0, 0)  # its events alone


def test_pool_credit_is_counted_in_engine_blocks_past_the_backends_own() -> None:
    exact = {"b": ExactMatch(10, 2, 16), "c": NO_EXACT_MATCH, "d": ExactMatch(40, 0, 16)}
    got = exact_credit(exact, model="m", engine_hashes=list(range(50)), engine_block_tokens=16,
                       in_flight=PendingChains(), kv_pool=BlockMatch(30, 0, 0), tokens_per_block=TPB)
    assert _tokens(got["b"]) == (160, 32, 288, 0)  # 30 − 12 blocks from the pool
    assert _tokens(got["c"]) == (0, 0, 480, 0)  # an empty backend loads all 30
    assert _tokens(got["d"]) == (640, 0, 0, 0)  # holds more than the pool: nothing from it


def test_a_backend_with_other_engine_blocks_gets_its_events_alone() -> None:
    in_flight = PendingChains()
    in_flight.add("m", "b", [1, 2, 3])
    got = exact_credit({"b": ExactMatch(1, 0, 32)}, model="m", engine_hashes=[1, 2, 3], engine_block_tokens=16,
                       in_flight=in_flight, kv_pool=BlockMatch(3, 0, 0), tokens_per_block=TPB)
    assert _tokens(got["b"]) == (32, 0, 0, 0)
