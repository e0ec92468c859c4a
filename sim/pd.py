"""Split requests (P/D) in the simulator: prefill on one engine, the KV pull over a link, decode on another.

The flow is vLLM's disaggregated one through its NixlConnector (``kv_transfer_params``), which the
gateway relays (issue 26):

1. the prefill engine runs the prompt with ``max_tokens`` 1 and ``hold_kv`` (vLLM's ``do_remote_decode``)
   (`mock_vllm.engine`): it keeps the prompt's blocks when done;
2. when that token comes back, the decode engine pulls the KV it lacks — (P − K_d) tokens, K_d its
   own prefix hit in any tier at that moment — over link(p, d): latency + bytes / bandwidth of the
   link the pull really crosses (`sim.fleet.Fleet.delivered_link`: the configured one, or an
   override for a link that delivers less than it claims). The prefill engine frees its blocks
   once the pull is done (vLLM frees them when the decode side has read them);
3. the decode engine gets the request with ``remote_from_block`` (vLLM's ``do_remote_prefill``): its prompt's KV present, it
   computes the last token only and decodes ``max_tokens``, batched with what runs there.

TTFT is the decode engine's first token, E2E its last. The decode side's blocks are allocated when
the pull ends, not when it starts (vLLM allocates them first, then pulls): during the transfer the
decode engine's KV usage reads low by that request. Bookkeeping is the gateway's
(`dispatch.Dispatcher.charge_split`): the prefill ticket ends when the pull does, the decode ticket
at the decode's first token and finish, as any; the index records the prefill backend when its
token comes back and the decode backend at its first token, as the gateway will.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from dispatch import Ticket
from mock_vllm.engine import MockEngine, PromptTooLong
from mock_vllm.kv_cache import prompt_block_hashes
from mock_vllm.types import RequestOutput
from router import kappa
from router.types import PrefillLeg
from sim.fleet import Fleet
from sim.records import RequestRecord

PREFILL_SUFFIX = "/prefill"
"""Appended to a request's id for its prefill half (vLLM's proxies tag the two halves alike)."""


class _Split:
    __slots__ = ("record", "ticket", "replica", "request", "tokens", "max_tokens", "prefill_id", "decode_id")

    def __init__(self, record: RequestRecord, ticket: Ticket, replica: Any, request: Any, tokens: Sequence[int],
                 max_tokens: int, prefill_id: str, decode_id: str) -> None:
        self.record, self.ticket, self.replica, self.request = record, ticket, replica, request
        self.tokens, self.max_tokens, self.prefill_id, self.decode_id = tokens, max_tokens, prefill_id, decode_id


class SplitRunner:
    """The split requests of one run between their prefill's decision and their decode's admission.

    Args:
        fleet: the fleet (its delivered links).
        engine: backend id → its engine.
        record_index: called as ``record_index(replica, backend id, request, now)`` when a backend
            has computed a request's prompt (the simulator's index write, with its lag).
    """

    def __init__(self, fleet: Fleet, engine: Callable[[str], MockEngine],
                 record_index: Callable[[Any, str, Any, float], None]) -> None:
        self.fleet, self._engine, self._record_index = fleet, engine, record_index
        self._splits: dict[str, _Split] = {}  # by the prefill half's request id
        self._pulls: list[tuple[float, int, str]] = []  # (done at, seq, prefill half's id)
        self._seq = itertools.count()

    @property
    def next_pull_s(self) -> float | None:
        """When the next pull completes (virtual s), or None."""
        return self._pulls[0][0] if self._pulls else None

    @property
    def busy(self) -> bool:
        return bool(self._splits)

    def start(self, rid: str, leg: PrefillLeg, decode_id: str, record: RequestRecord, prefill_ticket: Ticket,
              replica: Any, request: Any, tokens: Sequence[int], max_tokens: int, now: float) -> None:
        """Send the prefill half (``max_tokens`` 1, blocks kept) to the prefill engine.

        Raises:
            PromptTooLong: either engine would refuse it (prompt + max_tokens over its context).
        """
        decode = self._engine(decode_id)
        if len(tokens) + max_tokens > decode.max_model_len_tokens:
            raise PromptTooLong(f"{len(tokens) + max_tokens} tokens exceed {decode_id}'s context")
        prefill_id = leg.candidate.backend_id
        self._engine(prefill_id).add_request(rid + PREFILL_SUFFIX, tokens, max_tokens=1, arrival_s=now,
                                             hold_kv=True)
        record.prefill_backend_id = prefill_id
        self._splits[rid + PREFILL_SUFFIX] = _Split(record, prefill_ticket, replica, request, tokens, max_tokens,
                                                    prefill_id, decode_id)

    def prefill_done(self, out: RequestOutput, now: float) -> None:
        """The prefill half's token came back: record the prefill backend's cache and start the pull."""
        split = self._splits[out.request_id]
        record = split.record
        record.prefill_done_s = now
        record.prompt_tokens, record.cached_tokens = out.prompt_tokens, out.cached_tokens
        record.cached_host_tokens, record.cached_kv_pool_tokens = out.cached_host_tokens, out.cached_kv_pool_tokens
        self._record_index(split.replica, split.prefill_id, split.request, now)
        decode = self._engine(split.decode_id)
        p = len(split.tokens)
        bs = decode.block_size
        hit = sum(decode.cache.match(prompt_block_hashes(split.tokens, bs, None), (p - 1) // bs)) * bs
        link = self.fleet.delivered_link(split.prefill_id, split.decode_id)
        if link is None:
            raise RuntimeError(f"split over {split.prefill_id} → {split.decode_id}, which no link joins")
        record.transfer_tokens = max(p - hit, 0)
        record.transfer_s = link.transfer_s(kappa.model_constants(decode.backend.model).kv_bytes(record.transfer_tokens)
                                            if record.transfer_tokens else 0.0)
        heapq.heappush(self._pulls, (now + record.transfer_s, next(self._seq), out.request_id))

    def pulls_due(self, now: float) -> list[str]:
        """Complete the pulls done by ``now``: the prefill engines free the blocks and the prefill
        tickets end; the decode engines get their requests. Returns the backend ids to kick."""
        kick: list[str] = []
        while self._pulls and self._pulls[0][0] <= now:
            _, _, prefill_rid = heapq.heappop(self._pulls)
            split = self._splits.pop(prefill_rid)
            self._engine(split.prefill_id).release_held(prefill_rid)
            split.ticket.finish()
            decode = self._engine(split.decode_id)
            decode.add_request(prefill_rid[: -len(PREFILL_SUFFIX)], split.tokens, max_tokens=split.max_tokens,
                               arrival_s=now, remote_from_block=decode.local_prefix_blocks(split.tokens, None))
            kick += [split.prefill_id, split.decode_id]
        return kick
