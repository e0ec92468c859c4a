"""What a trace allows and what its contexts cost: the figures ``kappa-gateway analyze`` reports.

Each request becomes a `PromptView`: its prompt and output tokens and its prompt's blocks,
leading first — for a record with chat messages the gateway's own index blocks (the chained
xxh3 hashes of its canonical bytes, `prefix_index.block_hashes`, at ``block_size_tokens`` ×
`prefix_index.BYTES_PER_TOKEN_ESTIMATE` bytes), for a record of hash ids the trace's own
512-token blocks (`sim.traces`), for a record of lengths only (Azure) none. A block's tokens are
its share of the record's ``input_tokens`` (bytes × input_tokens / canonical bytes), so every
figure is in the trace's own tokens.

- `shareable_tokens`: the hit an infinite prefix cache shared by the whole fleet allows — the
  longest leading run of blocks some earlier request held (`sim.workloads.shareable_prefix_tokens`,
  generalised), capped at P − 1 as vLLM caps a hit (REFERENCE.md §3);
- `host_tier_tokens`: the same hit from a host tier of finite capacity, least recently used
  blocks evicted (every request touching its whole prompt, as vLLM's prefix cache does);
- `regime_figures`: each request priced by `router.cost.predict` with that K in the host tier
  (loaded over the host link) and T = P − K new tokens: the share that is transfer-bound, and the
  κ_ratio and κ_crit distributions (names: `router.kappa`);
- `PromptView.finding`: the request's prefix-invalidation finding (`prefix_index.invalidation`),
  from its messages, by the detector the gateway runs (its limits too); None for a record without
  them (a trace of hash ids cannot show what a client rewrote: a sliding window starts new blocks
  there, indistinguishable from a new chat).

Pure: no I/O, no clock; requests are taken in arrival order (trace order on ties).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from prefix_index import (
    BYTES_PER_TOKEN_ESTIMATE,
    Finding,
    InvalidationDetector,
    block_hashes,
    block_size_bytes,
    chain_seed,
    chat_canonical_bytes,
    message_fingerprint,
)
from router.cost import BackendSpec, RequestShape, predict
from router.kappa import Regime
from sim.report import percentile
from sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class PromptView:
    """One request as the analysis sees it (module docstring).

    Attributes:
        prompt_tokens: P, the record's input tokens, ≥ 0.
        output_tokens: the tokens it generates, ≥ 1.
        blocks: its prompt's block keys, leading first (chained hashes or trace hash ids).
        block_tokens: tokens of each full block, > 0.
        index_blocks: the blocks are the gateway's index blocks, every one full (it hashes no partial
            block); else a trace's, whose last may hold fewer tokens.
        finding: its prefix-invalidation finding, None without chat messages.
        session_id: its conversation, when the trace says.
    """

    prompt_tokens: int
    output_tokens: int
    blocks: tuple[Hashable, ...]
    block_tokens: float
    index_blocks: bool
    finding: Finding | None
    session_id: str | None

    def block_fills(self) -> list[float]:
        """How full each block is, in (0, 1]: a trace's last block cut to the prompt's tokens."""
        if self.index_blocks:
            return [1.0] * len(self.blocks)
        fills, remaining = [], self.prompt_tokens / self.block_tokens
        for _ in self.blocks:
            if remaining <= 0:
                break
            fills.append(min(1.0, remaining))
            remaining -= 1.0
        return fills


def prompt_views(requests: Sequence[TraceRequest], *, model: str,
                 block_size_tokens: int = 64) -> list[PromptView]:
    """One `PromptView` per request, in arrival order (ties: trace order).

    Args:
        requests: the trace; records with ``messages`` are canonicalised as the gateway does.
        model: the model name (seeds the hash chain and the message hashes, as the gateway does).
        block_size_tokens: the index block of message records, tokens (> 0).

    Raises:
        prefix_index.CanonicalizationError: a record's messages are not a valid chat.
    """
    seed = chain_seed(model, None)
    block_bytes = block_size_bytes(block_size_tokens, BYTES_PER_TOKEN_ESTIMATE)
    detector = InvalidationDetector()
    out = []
    for req in sorted(requests, key=lambda r: r.arrival_s):  # stable: trace order on ties
        output = max(req.output_tokens, 1)
        if req.messages is None:
            out.append(PromptView(req.input_tokens, output, req.hash_ids, MOONCAKE_BLOCK_TOKENS, False, None,
                                  req.session_id))
            continue
        data = chat_canonical_bytes({"messages": list(req.messages)})
        bytes_per_token = len(data) / max(req.input_tokens, 1)
        finding = detector.observe(message_fingerprint(data, seed), bytes_per_token=bytes_per_token)
        blocks = tuple(block_hashes(data, block_size_bytes=block_bytes, seed=seed))
        out.append(PromptView(req.input_tokens, output, blocks, block_bytes / bytes_per_token, True, finding,
                              req.session_id))
    return out


def shareable_tokens(views: Sequence[PromptView]) -> list[int]:
    """Per view, the tokens an infinite prefix cache shared by every request would have held
    (module docstring), ≤ max(P − 1, 0)."""
    held: dict[Hashable, float] = {}  # block -> the fullest any request held it
    out = []
    for view in views:
        fills = view.block_fills()
        out.append(_leading_hit(view, fills, held))
        for key, fill in zip(view.blocks, fills):
            if held.get(key, 0.0) < fill:
                held[key] = fill
    return out


def host_tier_tokens(views: Sequence[PromptView], capacity_tokens: float) -> list[int]:
    """Per view, its hit in a host tier holding ``capacity_tokens`` tokens (≥ 0; ``inf``: the
    infinite cache), least recently used blocks evicted first, ≤ max(P − 1, 0)."""
    if capacity_tokens == float("inf"):
        return shareable_tokens(views)
    fills_held: dict[Hashable, float] = {}  # block -> the fullest a request left it
    lru: OrderedDict[Hashable, float] = OrderedDict()  # block -> tokens it holds, least recently used first
    total = 0.0
    out = []
    for view in views:
        fills = view.block_fills()
        out.append(_leading_hit(view, fills, fills_held))
        for key, fill in zip(view.blocks, fills):
            tokens = lru.pop(key, 0.0)
            if fill > fills_held.get(key, 0.0):
                fills_held[key] = fill
                total += fill * view.block_tokens - tokens
                tokens = fill * view.block_tokens
            lru[key] = tokens
        while total > capacity_tokens and lru:
            key, tokens = lru.popitem(last=False)
            total -= tokens
            del fills_held[key]
    return out


def _leading_hit(view: PromptView, fills: list[float], held: dict[Hashable, float]) -> int:
    hit = 0.0
    for key, fill in zip(view.blocks, fills):
        earlier = held.get(key, 0.0)
        hit += min(earlier, fill)
        if earlier < fill:
            break
    return int(min(hit * view.block_tokens, max(view.prompt_tokens - 1, 0)))


@dataclass(frozen=True, slots=True)
class RegimeFigures:
    """Requests priced on one backend with their K loaded from the host tier.

    Attributes:
        requests: how many were priced.
        hit_ratio: ΣK / ΣP over them, in [0, 1].
        transfer_bound_share: the share whose ``kappa_ratio_loaded`` exceeds their ``kappa_crit``
            (`router.cost.predict`'s regime), in [0, 1].
        kappa_ratio: K/T at p50, p90, p99 (keys "p50", "p90", "p99"; None without requests).
        kappa_crit_p50: the (lower) median of the requests' own κ_crit there (``inf``: no K makes the
            median request transfer-bound; JSON null); None without requests.
    """

    requests: int
    hit_ratio: float
    transfer_bound_share: float
    kappa_ratio: dict[str, float | None]
    kappa_crit_p50: float | None

    def as_dict(self) -> dict[str, object]:
        crit = self.kappa_crit_p50
        return {"requests": self.requests, "hit_ratio": self.hit_ratio, "transfer_bound_share": self.transfer_bound_share,
                "kappa_ratio": self.kappa_ratio, "kappa_crit_p50": None if crit == float("inf") else crit}


def kappa_ratio_percentiles(cached: Sequence[float], prompts: Sequence[float]) -> dict[str, float | None]:
    """K/T (T = P − K, at least 1) at `PERCENTILES`, keyed "p50", "p90", "p99"."""
    ratios = [k / max(p - k, 1.0) for k, p in zip(cached, prompts, strict=True)]
    return {f"p{q}": percentile(ratios, q) for q in PERCENTILES}


def regime_figures(cached: Sequence[float], prompts: Sequence[float], outputs: Sequence[float],
                   spec: BackendSpec) -> RegimeFigures:
    """Price each request on ``spec`` with K = ``cached[i]`` in the host tier and T = P − K.

    Args:
        cached, prompts, outputs: per request K, P and output tokens (equal lengths; K ≤ P).
        spec: the backend's figures (`router.cost.BackendSpec`).
    """
    transfer, crits = 0, []
    for k, p, o in zip(cached, prompts, outputs, strict=True):
        est = predict(RequestShape(0, k, max(p - k, 0), o), spec)
        transfer += est.regime is Regime.TRANSFER
        crits.append(est.kappa_crit)
    n, total = len(prompts), sum(prompts)
    median = sorted(crits)[(n - 1) // 2] if n else None  # nearest rank: κ_crit may be inf, interpolation not
    return RegimeFigures(n, sum(cached) / total if total else 0.0, transfer / n if n else 0.0,
                         kappa_ratio_percentiles(cached, prompts), median)
