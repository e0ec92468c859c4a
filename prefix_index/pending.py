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
    """Per (model, backend), the chains of the requests in flight there."""

    def __init__(self) -> None:
        self._chains: dict[tuple[str, str], list[Sequence[int]]] = {}

    def add(self, model: str, backend_id: str, hashes: Sequence[int]) -> None:
        """A request carrying ``hashes`` was routed to ``backend_id`` (keep the same object
        for `remove`)."""
        if len(hashes):
            self._chains.setdefault((model, backend_id), []).append(hashes)

    def remove(self, model: str, backend_id: str, hashes: Sequence[int]) -> None:
        """That request ended (finished, failed or was refused): undo its ``add``."""
        chains = self._chains.get((model, backend_id))
        if not chains:
            return
        for i, chain in enumerate(chains):
            if chain is hashes:
                del chains[i]
                break
        else:
            for i, chain in enumerate(chains):
                if chain == hashes:
                    del chains[i]
                    break
        if not chains:
            del self._chains[(model, backend_id)]

    def overlay(self, model: str, hashes: Sequence[int], matches: Mapping[str, BlockMatch],
                backend_ids: Iterable[str]) -> dict[str, BlockMatch]:
        """The index's matches with pending chains counted as held in HBM.

        Two chains share block i only if they share every block before it (hashes are
        chained), so the prefix a pending chain holds of ``hashes`` is found by binary
        search on equal positions; most pending chains differ at block 0. Where the longest
        such prefix is longer than the index's match, the in-flight prefill will have
        brought it into HBM.

        Returns:
            backend id -> ``BlockMatch`` for every id in ``backend_ids`` (the index's own
            match, or no match, where nothing longer is pending).
        """
        out: dict[str, BlockMatch] = {}
        for backend_id in backend_ids:
            match = matches.get(backend_id) or _NO_MATCH
            chains = self._chains.get((model, backend_id))
            if chains and len(hashes):
                pending = max(_common_prefix(hashes, chain) for chain in chains)
                if pending > match.matched_blocks:
                    match = BlockMatch(pending, pending, 0, 0, pending)
                elif pending > match.hbm_blocks:
                    match = BlockMatch(match.matched_blocks, pending, match.matched_blocks - pending, 0, pending)
                elif pending:
                    match = BlockMatch(match.matched_blocks, match.hbm_blocks, match.host_blocks, 0, pending)
            out[backend_id] = match
        return out

    def __len__(self) -> int:
        """Chains in flight, over all models and backends."""
        return sum(len(chains) for chains in self._chains.values())


_NO_MATCH = BlockMatch(0, 0, 0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Blocks two chains share (equal hashes at the same depths, a prefix of both)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    lo, hi = 1, n - 1  # a[lo - 1] == b[lo - 1]; a[hi] != b[hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
