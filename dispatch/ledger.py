"""The gateway's own account of what it sent where: one `Ledger` per backend, one `Ticket` per request.

Charged at decision time, not after (REFERENCE.md §6: least-loaded counts at decision
time): the request's in-flight count, the KV bytes it occupies ((K+T+n·max_tokens)·B_kv for n
output sequences, less a prefix other requests there already hold; `router.cost.kv_demand_bytes`) and its predicted
prefill seconds, and what its decode will weigh in the backend's batch: the context it holds while
decoding (prompt + half its output, per sequence) and its output tokens (`router.decode`). The
prefill is released at the first byte (the backend has done it), the rest when the request ends,
however it ends. The gateway runs tickets live; the simulator
runs the same tickets in virtual time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Ledger", "Ticket"]


@dataclass(eq=False, slots=True)
class Ledger:
    """One backend's charges. Changed only by tickets (and `recorded_blocks` by the dispatcher).

    Attributes:
        in_flight: requests sent there and not yet ended.
        awaiting_first_byte: those of them still before their first byte (queued or in prefill there).
        dispatched_total: requests ever charged here (a sequence number: a request whose first
            byte comes when it has grown by exactly one shared the backend with none sent after it).
        kv_demand_bytes: KV bytes charged to them, bytes.
        outstanding_prefill_s: predicted prefill seconds of those not yet past their first byte.
        context_tokens: Σ over them of sequences · (prompt + max_tokens / 2): the context a decode
            step attends to and reads the KV of, on average over their decodes (tokens; a prefix
            shared by several counts once per request, as each reads it).
        output_tokens: Σ over them of sequences · max_tokens (tokens).
        recorded_blocks: index blocks recorded for the backend since it was last forgotten (its
            "tree size", for prefix-affinity's smallest-cache rule); approximate.
        peer_in_flight, peer_kv_demand_bytes, peer_outstanding_prefill_s, peer_context_tokens,
            peer_output_tokens: the same charges of
            the other gateway replicas, as last synced (`gateway.replicas.peer_load`); 0 with one gateway.
            Routing sees own + peer (`total_*`); tickets change only the own figures.
        on_change: called after a ticket changed the own figures (the gateway publishes them
            to its peers, `gateway.replicas.peer_load`); None: nobody listens.
    """

    in_flight: int = 0
    awaiting_first_byte: int = 0
    dispatched_total: int = 0
    kv_demand_bytes: float = 0.0
    outstanding_prefill_s: float = 0.0
    context_tokens: float = 0.0
    output_tokens: float = 0.0
    recorded_blocks: int = 0
    peer_in_flight: int = 0
    peer_kv_demand_bytes: float = 0.0
    peer_outstanding_prefill_s: float = 0.0
    peer_context_tokens: float = 0.0
    peer_output_tokens: float = 0.0
    on_change: Callable[[], None] | None = None

    @property
    def total_in_flight(self) -> int:
        return self.in_flight + self.peer_in_flight

    @property
    def total_kv_demand_bytes(self) -> float:
        return self.kv_demand_bytes + self.peer_kv_demand_bytes

    @property
    def total_outstanding_prefill_s(self) -> float:
        return self.outstanding_prefill_s + self.peer_outstanding_prefill_s

    @property
    def total_context_tokens(self) -> float:
        return self.context_tokens + self.peer_context_tokens

    @property
    def total_output_tokens(self) -> float:
        return self.output_tokens + self.peer_output_tokens


class Ticket:
    """A request's charges on one ledger; `first_byte` and `finish` are idempotent.

    Args:
        ledger: the backend's ledger (charged at construction).
        kv_bytes: KV bytes the request occupies there, ≥ 0.
        prefill_s: its predicted prefill seconds, ≥ 0.
        on_finish: called once when the request ends (however it ends).
        context_tokens: its decode's context, sequences · (prompt + max_tokens / 2), tokens.
        output_tokens: sequences · max_tokens.
    """

    __slots__ = ("ledger", "kv_bytes", "prefill_s", "context_tokens", "output_tokens", "_on_finish", "_first",
                 "_done")

    def __init__(self, ledger: Ledger, kv_bytes: float, prefill_s: float,
                 on_finish: Callable[[], None] | None = None, *, context_tokens: float = 0.0,
                 output_tokens: float = 0.0) -> None:
        self.ledger, self.kv_bytes, self.prefill_s = ledger, kv_bytes, prefill_s
        self.context_tokens, self.output_tokens = context_tokens, output_tokens
        self._on_finish = on_finish
        self._first = self._done = False
        ledger.in_flight += 1
        ledger.awaiting_first_byte += 1
        ledger.dispatched_total += 1
        ledger.kv_demand_bytes += kv_bytes
        ledger.outstanding_prefill_s += prefill_s
        ledger.context_tokens += context_tokens
        ledger.output_tokens += output_tokens
        if ledger.on_change is not None:
            ledger.on_change()

    @property
    def finished(self) -> bool:
        return self._done

    def first_byte(self) -> None:
        """The backend answered: its prefill is done, release the predicted prefill seconds."""
        if not self._first:
            self._first = True
            self.ledger.awaiting_first_byte -= 1
            self.ledger.outstanding_prefill_s = max(self.ledger.outstanding_prefill_s - self.prefill_s, 0.0)
            if self.ledger.on_change is not None:
                self.ledger.on_change()

    def finish(self) -> None:
        """The request ended: release everything it holds."""
        if self._done:
            return
        self.first_byte()
        self._done = True
        self.ledger.in_flight -= 1
        self.ledger.kv_demand_bytes = max(self.ledger.kv_demand_bytes - self.kv_bytes, 0.0)
        self.ledger.context_tokens = max(self.ledger.context_tokens - self.context_tokens, 0.0)
        self.ledger.output_tokens = max(self.ledger.output_tokens - self.output_tokens, 0.0)
        if self.ledger.on_change is not None:
            self.ledger.on_change()
        if self._on_finish is not None:
            self._on_finish()
