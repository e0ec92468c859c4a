"""The exact index's matches in the router's units (issue 30): what `Dispatcher.plan` puts in place of
the approximate index's match for a backend whose KV events are in sync.

The gateway looks the request's token ids up in the event-fed index (`prefix_index.engine_index`;
the lookup is I/O, so it happens before dispatch) and hands the answers in as engine blocks. The
router prices K per tier as ``int(blocks × block_size_tokens)`` in *index* blocks
(`router.candidates.build_candidates`), so an exact count of ``x`` tokens becomes
``(x + ½) / block_size_tokens`` index blocks: the half token makes ``int()`` land on ``x`` whatever
the floating-point rounding of the division and product.

What the engines' events cannot say, an exact backend is still credited with, in the same engine
blocks (`exact_credit`), never in the approximate index's byte blocks: a byte block stands for the
model's *average* tokens per block (`Dispatcher.tokens_per_block`), which is off by several percent
for any one text (English prose at 3.4–4.4 bytes per token against a calibrated mean), so a credit
topped up in byte blocks missed the engine's ``cached_tokens`` by hundreds of tokens on a
few-thousand-token system prompt (``bench/index_accuracy.py``: 57% of requests within one engine
block, 91% without a KV pool). Both are chains of the request's engine blocks (`engine_chain.own_chain`
at the backend's block size):

- requests in flight on the backend (`prefix_index.PendingChains` of engine chains: the prefix a
  running prefill is computing there, which its events announce only chunk by chunk);
- the fleet-shared KV pool, which publishes no events (vLLM's LMCache and Mooncake connectors emit
  none): the gateway records each served request's engine chain under the pool as it records its
  byte chain, in the approximate index under the model key `engine_pool_model`, least recently
  used blocks going first at the pool's capacity in engine blocks. Its evictions are modelled,
  as the approximate index models every tier's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefix_index import KV_POOL_ID, BlockMatch, PendingChains, with_kv_pool
from prefix_index.engine_index import ExactMatch

__all__ = ["engine_pool_model", "exact_credit", "to_index_blocks", "with_exact"]

# Appended to a served model's name for the approximate index's key of the pool's engine chains: a NUL
# cannot occur in a configured model name, so no model's own key can collide with it.
_ENGINE_POOL_SUFFIX = "\x00engine-blocks"


def engine_pool_model(model: str) -> str:
    """The approximate index's model key under which the KV pool's chains of ``model`` are kept in
    engine blocks (`exact_credit`)."""
    return model + _ENGINE_POOL_SUFFIX


def _index_blocks(blocks: float, engine_block_tokens: int, tokens_per_block: float) -> float:
    return (blocks * engine_block_tokens + 0.5) / tokens_per_block if blocks else 0


def to_index_blocks(match: BlockMatch, engine_block_tokens: int, tokens_per_block: float) -> BlockMatch:
    """A match counted in engine blocks of ``engine_block_tokens`` as fractional index blocks of
    ``tokens_per_block`` tokens (each tier with the half token of the module docstring);
    ``matched_blocks`` is the sum of the three tiers."""
    hbm, host, pool = (_index_blocks(b, engine_block_tokens, tokens_per_block)
                       for b in (match.hbm_blocks, match.host_blocks, match.kv_pool_blocks))
    return BlockMatch(hbm + host + pool, hbm, host, pool,  # type: ignore[arg-type]  # fractional on purpose
                      _index_blocks(match.in_flight_blocks, engine_block_tokens, tokens_per_block))  # type: ignore[arg-type]


def with_exact(matches: Mapping[str, BlockMatch], exact: Mapping[str, ExactMatch],
               block_size_tokens: float) -> dict[str, BlockMatch]:
    """``matches`` with every backend in ``exact`` replaced by its exact match alone, in index blocks.

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
        out[backend_id] = BlockMatch(hbm + host, hbm, host)  # type: ignore[arg-type]  # fractional on purpose
    return out


def exact_credit(exact: Mapping[str, ExactMatch], *, model: str, engine_hashes: Sequence[int],
                 engine_block_tokens: int, in_flight: PendingChains, kv_pool: BlockMatch | None,
                 tokens_per_block: float) -> dict[str, BlockMatch]:
    """Each exact backend's whole credit, in index blocks: its HBM and host tier from its events, then
    the prefix requests in flight there hold, then the pool's (module docstring), all in engine blocks.

    Args:
        exact: the exact index's matches by backend id.
        model: the served model (``in_flight`` is keyed by it).
        engine_hashes: the request's engine chain at ``engine_block_tokens`` (empty: none computed).
        in_flight: engine chains of the requests in flight, by (model, backend).
        kv_pool: the pool's match of ``engine_hashes`` in engine blocks (its ``matched_blocks``), or
            None (no pool, or its lookup failed: no pool credit).
        tokens_per_block: tokens per index block for the model, > 0.

    Returns:
        Backend id -> ``BlockMatch`` in fractional index blocks, for every backend in ``exact``. A
        backend whose engine blocks are not ``engine_block_tokens`` long (or with no chain given)
        gets its events' HBM and host tier alone (`with_exact`).
    """
    units: dict[str, BlockMatch] = {}
    plain: dict[str, ExactMatch] = {}
    for backend_id, match in exact.items():
        if engine_hashes and match.block_size_tokens in (0, engine_block_tokens):  # 0: nothing stored there yet
            units[backend_id] = BlockMatch(match.matched_blocks, match.hbm_blocks, match.host_blocks)
        else:
            plain[backend_id] = match
    if units:
        units = in_flight.overlay(model, engine_hashes, units, list(units))
        if kv_pool is not None:
            units = with_kv_pool({**units, KV_POOL_ID: kv_pool}, list(units))
    out = {b: to_index_blocks(m, engine_block_tokens, tokens_per_block) for b, m in units.items()}
    return out | with_exact({}, plain, tokens_per_block)
