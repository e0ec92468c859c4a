"""The exact index's matches in the router's units (`dispatch.exact.with_exact`): whatever the index's
tokens-per-block estimate, the router's ``int(blocks × block_size_tokens)`` gives back the exact tokens."""

from __future__ import annotations

import random

import pytest

from dispatch.exact import with_exact
from prefix_index import BlockMatch
from prefix_index.engine_index import ExactMatch


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
