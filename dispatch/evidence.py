"""What responses say about the index: does a backend's reported ``cached_tokens`` bear out its credit?

Every answer with usage carries ``usage.prompt_tokens_details.cached_tokens``: the prompt
tokens the backend found cached, in HBM or loaded from an offload tier or a KV pool (vLLM's
``num_cached_tokens``, set at the request's first scheduling). The index credited the chosen
backend K = its own prefix (HBM + host tier) + what only the shared KV pool holds. Two uses:

* **Accuracy.** Each answer is ``within_one_block`` when |K − reported| ≤ one index block,
  else ``over`` (the index credited more) or ``under``. The block is the allowed slack:
  the index counts whole blocks of an estimated token size, the backend whole blocks of its
  own (16 tokens in vLLM) and never the prompt's last token.
* **Self-correction.** A backend restarted faster than the health interval, or emptied by
  ``POST /reset_prefix_cache`` (vLLM leaves its Prometheus counters alone then, so a scrape
  cannot see it), or a KV pool that lost its contents, keeps its credit in the index. Their
  answers show it: the backend reports far less than it was credited, again and again. A
  response *misses* when the index's own credit for a holder is at least `MIN_CREDIT_BLOCKS`
  blocks and the backend delivered less than half of it (and over a block less):

  - the backend's own prefix, ``local`` = HBM + host tokens, missed when
    reported < local / 2. Credit that only the in-flight overlay gave
    (``in_flight_blocks`` == the whole local prefix: a prefill still running, whose blocks
    vLLM caches only as its chunks complete) is no evidence either way;
  - the pool's part, ``pool`` tokens past the backend's own, missed when
    reported − local < pool / 2: a backend that lacks a prefix loads it from the pool if the
    pool has it, so a short answer there means the pool did not.

  `MISS_STREAK` misses in a row for a holder (any answer where its credit was borne out
  resets the count; the pool's count runs over all backends) make it *stale*: the caller
  forgets its entries. Normal eviction noise — the index's LRU drifting from the backend's,
  a block or two of rounding — short-changes some answers, rarely by half, and is broken up
  by the answers that were right (measured on the demo: README "Accounting truth"). Answers
  to requests routed before a holder's last forget are ignored for it (they were priced on
  the entries just dropped).

Pure: no I/O, no clock. The dispatcher owns one and calls it from `Dispatcher.observe_cached_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from prefix_index import KV_POOL_ID

__all__ = ["MIN_CREDIT_BLOCKS", "MISS_STREAK", "CachedTokensCheck", "CachedTokensEvidence", "Outcome"]

# Credit below 4 index blocks (256 tokens at the default block) is too small to be evidence:
# block rounding and the uncounted last token are a block's worth of noise on their own.
MIN_CREDIT_BLOCKS = 4
# Three short answers in a row: a reset backend fails every credited answer, so it is caught
# within three requests that hit its entries; eviction noise rarely fails three in a row.
MISS_STREAK = 3


class Outcome:
    """How K compared with the reported cached tokens (values of ``outcome`` labels)."""

    WITHIN_ONE_BLOCK: Final = "within_one_block"
    OVER: Final = "over"
    UNDER: Final = "under"


@dataclass(frozen=True, slots=True)
class CachedTokensCheck:
    """The verdict on one answer.

    Attributes:
        outcome: an `Outcome` value.
        stale: index ids (the backend's, `KV_POOL_ID`) whose entries the answers have now
            contradicted `MISS_STREAK` times in a row: forget them. Usually empty.
    """

    outcome: str
    stale: tuple[str, ...] = ()


@dataclass
class CachedTokensEvidence:
    """Per holder (backend id or `KV_POOL_ID`), the current run of missed credit.

    Args:
        miss_streak: misses in a row that make a holder stale, ≥ 1.
        min_credit_blocks: the least credit, in index blocks, that counts as evidence, ≥ 1.
    """

    miss_streak: int = MISS_STREAK
    min_credit_blocks: int = MIN_CREDIT_BLOCKS
    _misses: dict[str, int] = field(default_factory=dict)
    _forgotten_at: dict[str, int] = field(default_factory=dict)  # holder -> index epoch of its last forget

    def observe(self, backend_id: str, *, local_tokens: int, in_flight_tokens: int, kv_pool_tokens: int,
                reported_tokens: int, block_tokens: float, epoch: int) -> CachedTokensCheck:
        """Judge one answer.

        Args:
            backend_id: the backend that answered.
            local_tokens: K credited in its own tiers (HBM + host), tokens.
            in_flight_tokens: how many of those the in-flight overlay credited, tokens.
            kv_pool_tokens: K credited past them in the shared KV pool, tokens.
            reported_tokens: its ``usage.prompt_tokens_details.cached_tokens``.
            block_tokens: tokens per index block at routing time, > 0.
            epoch: the dispatcher's forget epoch when the request was routed.

        Returns:
            The outcome and the holders that are now stale (their counts restart at 0).
        """
        predicted = local_tokens + kv_pool_tokens
        if abs(predicted - reported_tokens) <= block_tokens:
            outcome = Outcome.WITHIN_ONE_BLOCK
        else:
            outcome = Outcome.OVER if predicted > reported_tokens else Outcome.UNDER
        min_credit = self.min_credit_blocks * block_tokens
        stale: list[str] = []
        if local_tokens >= min_credit and in_flight_tokens < local_tokens:
            missed = reported_tokens < local_tokens / 2 and reported_tokens + block_tokens < local_tokens
            stale += self._count(backend_id, missed, epoch)
        if kv_pool_tokens >= min_credit:
            delivered = reported_tokens - local_tokens
            missed = delivered < kv_pool_tokens / 2 and delivered + block_tokens < kv_pool_tokens
            stale += self._count(KV_POOL_ID, missed, epoch)
        return CachedTokensCheck(outcome, tuple(stale))

    def forgotten(self, holder: str, epoch: int) -> None:
        """``holder``'s entries were dropped at ``epoch`` (whatever the reason): start afresh."""
        self._misses.pop(holder, None)
        self._forgotten_at[holder] = epoch

    def _count(self, holder: str, missed: bool, epoch: int) -> list[str]:
        if epoch < self._forgotten_at.get(holder, 0):
            return []  # routed on entries dropped since
        if not missed:
            self._misses.pop(holder, None)
            return []
        n = self._misses.get(holder, 0) + 1
        if n < self.miss_streak:
            self._misses[holder] = n
            return []
        self._misses.pop(holder, None)
        return [holder]
