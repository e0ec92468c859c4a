"""The chains of requests in flight, by backend: held in HBM there whatever the index says.

The index learns a chain when the backend's first token comes back (its prefill ran).
Until then a request that shares the prefix would see it nowhere, and at concurrency
every such request starts its own cold prefill of the same prefix elsewhere: with 60–90k
token documents and many questions per document, 13 of 25 cold prefills in a simulated
document-QA run repeated a document already being prefilled. The prefill in flight
computes those blocks into the chosen backend's HBM, vLLM caches each full block as its
chunk completes, and it does not evict the blocks of a running request; so a request
sent there shares them. This overlay, local to one gateway process, says so: a chain
counts as held in HBM on its backend from the routing decision until the request ends
(the index has it by then, if it ran). SGLang's cache-aware router and llm-d's
approximate prefix scorer likewise insert a prefix when they route it, not when it is
served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prefix_index.base import BlockMatch

__all__ = ["PendingChains"]


class PendingChains:
    """Per (model, backend), a multiset of the block hashes of the requests in flight there."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], dict[int, int]] = {}

    def add(self, model: str, backend_id: str, hashes: Sequence[int]) -> None:
        """A request carrying ``hashes`` was routed to ``backend_id``."""
        if not hashes:
            return
        held = self._held.setdefault((model, backend_id), {})
        for h in hashes:
            held[h] = held.get(h, 0) + 1

    def remove(self, model: str, backend_id: str, hashes: Sequence[int]) -> None:
        """That request ended (finished, failed or was refused): undo one ``add``."""
        held = self._held.get((model, backend_id))
        if held is None:
            return
        for h in hashes:
            n = held.get(h, 0)
            if n > 1:
                held[h] = n - 1
            elif n == 1:
                del held[h]
        if not held:
            del self._held[(model, backend_id)]

    def overlay(self, model: str, hashes: Sequence[int], matches: Mapping[str, BlockMatch],
                backend_ids: Iterable[str]) -> dict[str, BlockMatch]:
        """The index's matches with pending chains counted as held in HBM.

        A chain contains every block before each of its blocks (hashes are chained), so the
        pending blocks of a backend form a prefix-closed set and the longest pending prefix
        of ``hashes`` is found by binary search. Where it is longer than the index's match,
        the in-flight prefill will have brought that whole prefix into HBM.

        Returns:
            backend id -> ``BlockMatch`` for every id in ``backend_ids`` (the index's own
            match, or no match, where nothing longer is pending).
        """
        out: dict[str, BlockMatch] = {}
        for backend_id in backend_ids:
            match = matches.get(backend_id) or BlockMatch(0, 0, 0)
            held = self._held.get((model, backend_id))
            if held and hashes:
                pending = _longest_prefix(hashes, held)
                if pending > match.matched_blocks:
                    match = BlockMatch(pending, pending, 0)
                elif pending > match.hbm_blocks:
                    match = BlockMatch(match.matched_blocks, pending, match.matched_blocks - pending)
            out[backend_id] = match
        return out

    def __len__(self) -> int:
        """Distinct (model, backend, block) entries pending."""
        return sum(len(held) for held in self._held.values())


def _longest_prefix(hashes: Sequence[int], held: Mapping[int, int]) -> int:
    if hashes[-1] in held:
        return len(hashes)
    if hashes[0] not in held:
        return 0
    lo, hi = 1, len(hashes) - 1  # hashes[lo - 1] held, hashes[hi] not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo
