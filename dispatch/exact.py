"""The exact index's matches in the router's units (issue 30): what `Dispatcher.plan` puts in place of
the approximate index's match for a backend whose KV events are in sync.

The gateway looks the request's token ids up in the event-fed index (`prefix_index.engine_index`;
the lookup is I/O, so it happens before dispatch) and hands the answers in as engine blocks. The
router prices K per tier as ``int(blocks × block_size_tokens)`` in *index* blocks
(`router.candidates.build_candidates`), so an exact count of ``x`` tokens becomes
``(x + ½) / block_size_tokens`` index blocks: the half token makes ``int()`` land on ``x`` whatever
the floating-point rounding of the division and product.
"""

from __future__ import annotations

from collections.abc import Mapping

from prefix_index import BlockMatch
from prefix_index.engine_index import ExactMatch

__all__ = ["with_exact"]


def with_exact(matches: Mapping[str, BlockMatch], exact: Mapping[str, ExactMatch],
               block_size_tokens: float) -> dict[str, BlockMatch]:
    """``matches`` with every backend in ``exact`` replaced by its exact match, in index blocks.

    Args:
        matches: the approximate index's matches by backend id.
        exact: the exact index's matches by backend id (engine blocks and their size).
        block_size_tokens: tokens per index block for the request's model, > 0.

    Returns:
        A new dict: ``exact``'s backends as ``BlockMatch(hbm + host, hbm, host)`` with fractional
        block counts (tokens as above), the others as they were.
    """
    out = dict(matches)
    for backend_id, match in exact.items():
        hbm = (match.hbm_tokens + 0.5) / block_size_tokens if match.hbm_tokens else 0
        host = (match.host_tokens + 0.5) / block_size_tokens if match.host_tokens else 0
        out[backend_id] = BlockMatch(hbm + host, hbm, host)
    return out
