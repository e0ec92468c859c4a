"""A split (P/D) decision's bookkeeping: a ticket on each of its two backends.

Shared by the gateway (live) and the simulator (virtual time), as `dispatch.pipeline` is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dispatch.ledger import Ticket
from dispatch.target import Target
from prefix_index import PendingChains
from router import kappa
from router.decode import decode_context_tokens
from router.types import Decision, RequestFeatures


def charge_split(pending: PendingChains, model: str, hashes: Sequence[int], features: RequestFeatures,
                 decision: Decision, targets: Mapping[str, Target]) -> tuple[Ticket, Ticket]:
    """Charge a split decision (``decision.prefill`` set) of a request (``model``, its chain
    ``hashes``, its ``features``) to both its backends (of ``targets``), now.

    Returns:
        (the prefill ticket, the decode ticket). The prefill backend holds the prompt's KV,
        kv_bytes(P), and its predicted prefill seconds until the decode backend has pulled the KV
        (finish the ticket then: vLLM's NixlConnector frees a prefill's blocks once they are read);
        it decodes nothing. The decode backend holds the request's whole KV demand and its decode
        context, with no prefill seconds (it samples once the KV has arrived). Both mark the chain
        in flight (``pending``): both end up holding the prompt's blocks.

    Raises:
        ValueError: the plan is not split.
    """
    leg = decision.prefill
    if leg is None:
        raise ValueError("charge_split needs a split decision (Decision.prefill)")
    prefill_target = targets[leg.candidate.backend_id]
    pending.add(model, prefill_target.id, hashes)
    prompt_kv = kappa.model_constants(prefill_target.spec.model).kv_bytes(max(features.prompt_tokens, 1))
    prefill = Ticket(prefill_target.ledger, prompt_kv, leg.candidate.estimate.prefill_s,
                     on_finish=lambda: pending.remove(model, prefill_target.id, hashes))
    chosen = decision.chosen
    decode_target = targets[chosen.backend_id]
    pending.add(model, decode_target.id, hashes)
    decode = Ticket(decode_target.ledger, chosen.estimate.kv_demand_bytes, 0.0,
                    on_finish=lambda: pending.remove(model, decode_target.id, hashes),
                    context_tokens=decode_context_tokens(features),
                    output_tokens=float(features.sequences * max(features.max_tokens, 1)))
    return prefill, decode
