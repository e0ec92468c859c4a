"""Gateway replicas in the simulator: N routers in front of one fleet, as a load balancer spreads them.

A live deployment runs several gateway processes (``serve --workers``, Kubernetes replicas)
on one shared Redis index. What each replica then knows is the question (issue: scale-out):

- ``local`` state (today's gateway): each replica has its own `dispatch.Dispatcher` — its own
  in-flight chains (`prefix_index.PendingChains`), its own ledgers (in-flight count, KV demand,
  outstanding prefill seconds), bytes/token calibration and policy state (round-robin's turn)
  — so each sees only the 1/N of the fleet's load it routed itself;
- ``shared`` state: the replicas read one set of ledgers and one in-flight set, as if each
  decision read them from Redis at no delay: the ideal any sharing design approaches;
- ``synced`` state (the live gateway's design, `gateway.replicas.peer_load`): each replica keeps its own
  ledgers and adds the others' totals, read at each decision (in the index match's round
  trip; writes are modelled as instant) or, with ``sync_interval_s`` > 0, as last exchanged
  on that period; and each replica records a request's chain in the shared index at decision
  time (not at its first token), so the other replicas see prefills in flight through the
  index itself, ``index_lag_s`` later.

Calibration, policy state (round-robin's turn) and tie-breaks are per replica in every state.

In both, the prefix index is one store (Redis) that a record reaches ``index_lag_s`` after
the first token (the write's round trip and the gateway's asynchronous record), and every
replica scrapes the engines' metrics at the same scrape times. Requests are spread over
replicas round-robin or at random, as a Kubernetes Service or an L4 balancer does.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dispatch import Dispatcher, Target
from prefix_index import PrefixIndex
from router.calibration import BytesPerToken
from router.policies import Policy

ReplicaState = Literal["local", "shared", "synced"]
Balancer = Literal["round-robin", "random"]


@dataclass(frozen=True, slots=True)
class Topology:
    """How many gateway replicas route, what they share, how requests reach them.

    Attributes:
        replicas: gateway replicas (≥ 1).
        state: ``local`` (each replica's own ledgers and in-flight chains) or ``shared``.
        index_lag_s: seconds from a record (first token; decision when ``synced``) to its chain
            being visible in the index, ≥ 0.
        balancer: how requests are spread over replicas.
        sync_interval_s: ``synced`` state: seconds between two exchanges of ledger totals, ≥ 0
            (0: every decision reads the others' totals as they are, as a read in the decision's
            own Redis round trip would).
    """

    replicas: int = 1
    state: ReplicaState = "local"
    index_lag_s: float = 0.0
    balancer: Balancer = "round-robin"
    sync_interval_s: float = 0.0

    @property
    def record_at_decision(self) -> bool:
        return self.state == "synced"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.index_lag_s < 0:
            raise ValueError(f"index_lag_s must be >= 0, got {self.index_lag_s}")
        if self.sync_interval_s < 0:
            raise ValueError(f"sync_interval_s must be >= 0, got {self.sync_interval_s}")
        if self.state not in ("local", "shared", "synced") or self.balancer not in ("round-robin", "random"):
            raise ValueError(f"unknown state {self.state!r} or balancer {self.balancer!r}")


@dataclass(slots=True)
class Replica:
    """One gateway replica: its pipeline and its view of each backend (a `dispatch.Target`)."""

    dispatch: Dispatcher
    targets: list[Target]
    by_id: dict[str, Target]


def build_replicas(topology: Topology, index: PrefixIndex, policy: Policy, seed: int, *,
                   make_targets: Callable[[], list[Target]], bytes_per_token: float, block_size_bytes: int,
                   kv_pool_bytes: float | None) -> list[Replica]:
    """The replicas of a run, over one shared index.

    Replica 0 uses ``policy`` and ``random.Random(seed)``, exactly as a single gateway does;
    replica ``r`` a copy of the policy and ``random.Random(seed + r)``. ``make_targets`` builds
    one view of every backend (called once per replica with ``local`` state, once in all with
    ``shared``).
    """
    shared_targets = make_targets() if topology.state == "shared" else None
    replicas: list[Replica] = []
    for r in range(topology.replicas):
        targets = shared_targets if shared_targets is not None else make_targets()
        dispatcher = Dispatcher(index, policy if r == 0 else copy.deepcopy(policy), random.Random(seed + r),
                                BytesPerToken(bytes_per_token), block_size_bytes=block_size_bytes,
                                kv_pool_bytes=kv_pool_bytes)
        if shared_targets is not None and replicas:
            dispatcher.pending = replicas[0].dispatch.pending  # one in-flight set, as read from Redis
        replicas.append(Replica(dispatcher, targets, {t.id: t for t in targets}))
    return replicas


def sync_peers(replicas: list[Replica]) -> None:
    """Each replica's ledgers learn the other replicas' own charges (the ``synced`` exchange)."""
    for backend_id in replicas[0].by_id:
        ledgers = [r.by_id[backend_id].ledger for r in replicas]
        in_flight = sum(x.in_flight for x in ledgers)
        kv = sum(x.kv_demand_bytes for x in ledgers)
        prefill = sum(x.outstanding_prefill_s for x in ledgers)
        context = sum(x.context_tokens for x in ledgers)
        output = sum(x.output_tokens for x in ledgers)
        for x in ledgers:
            x.peer_in_flight = in_flight - x.in_flight
            x.peer_kv_demand_bytes = kv - x.kv_demand_bytes
            x.peer_outstanding_prefill_s = prefill - x.outstanding_prefill_s
            x.peer_context_tokens = context - x.context_tokens
            x.peer_output_tokens = output - x.output_tokens


class Spreader:
    """Picks the replica for each arrival (``topology.balancer``)."""

    __slots__ = ("_n", "_turn", "_rng", "_random")

    def __init__(self, topology: Topology, seed: int) -> None:
        self._n, self._turn = topology.replicas, 0
        self._random = topology.balancer == "random"
        self._rng = random.Random(seed ^ 0x5EED)

    def pick(self) -> int:
        if self._n == 1:
            return 0
        if self._random:
            return self._rng.randrange(self._n)
        turn, self._turn = self._turn, (self._turn + 1) % self._n
        return turn
