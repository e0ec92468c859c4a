"""One replica's view of the others: which figures it owes them, and theirs applied to its ledgers.

Each backend ledger (`dispatch.Ledger`) carries this replica's own figures and, in ``peer_*``,
the sums of the other replicas' (`figures.sum_figures`). `PeerView` tracks the ledgers that
changed since the last exchange began and what was last written, so an exchange writes only
the backends whose figures differ; and it knows the other members, as of the last read.
"""

from __future__ import annotations

from collections.abc import Sequence

from dispatch import Target
from gateway.replicas.figures import pack_figures, sum_figures


class PeerView:
    """The figures owed and the figures read, for this replica's ``targets``.

    Attributes:
        targets: this replica's backends (their ledgers are read and their ``peer_*`` set).
        others: the other members, as of the last read.
        dirty: indexes of the targets whose ledgers changed since the last exchange began.
        replicas_seen: 1 + the other members, as of the last read.
    """

    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = list(targets)
        self.others: list[str] = []
        self.dirty: set[int] = set()
        self.replicas_seen = 1
        self._sent: dict[str, str] = {}  # backend id -> figures last written (emptied when a write may have failed)

    def fields_due(self, *, sync: bool) -> dict[str, str]:
        """The figures to write: all of them (``sync``), else those of the changed targets that
        differ from the ones last written; the changes are taken, the result counts as written."""
        if sync:
            fields = {t.id: pack_figures(t) for t in self.targets}
        else:
            fields = {}
            for i in self.dirty:
                target = self.targets[i]
                packed = pack_figures(target)
                if self._sent.get(target.id) != packed:
                    fields[target.id] = packed
        self.dirty.clear()
        self._sent.update(fields)
        return fields

    def unsent(self) -> None:
        """A write failed, landed or not: no change is skipped as written (the periodic rewrites all)."""
        self._sent.clear()

    def apply(self, others: list[str], tables: list) -> list[str]:
        """Set ``peer_*`` to the sums of ``others``' figures (``tables``: their HGETALL replies, in
        order); return the members whose hash is gone (lease ran out), no longer read.

        Raises:
            ValueError: ``tables`` does not match ``others``, or a figure is not a number.
        """
        sums, gone = sum_figures([t.id for t in self.targets], others, tables)
        for t in self.targets:
            in_flight, kv, prefill, context, output = sums[t.id]
            t.ledger.peer_in_flight = int(in_flight)
            t.ledger.peer_kv_demand_bytes = kv
            t.ledger.peer_outstanding_prefill_s = prefill
            t.ledger.peer_context_tokens = context
            t.ledger.peer_output_tokens = output
        self.others = [m for m in others if m not in gone]
        self.replicas_seen = 1 + len(self.others)
        return gone

    def clear(self) -> None:
        """Zero ``peer_*``: the others' figures are older than their lease, each replica falls
        back to its own view."""
        for t in self.targets:
            t.ledger.peer_in_flight = 0
            t.ledger.peer_kv_demand_bytes = t.ledger.peer_outstanding_prefill_s = 0.0
            t.ledger.peer_context_tokens = t.ledger.peer_output_tokens = 0.0
        self.replicas_seen = 1
