"""What the anchors' P/D policies share: the prefill and decode pools, and a split made into a `Decision`.

The peers' P/D routers keep two worker lists, prefill and decode (SGLang's ``--prefill`` /
``--decode``, production-stack's ``prefill_model_labels`` / ``decode_model_labels``, llm-d's
``prefill-filter`` / ``decode-filter``, Dynamo's prefill and decode components). Here a backend's
``kv_role`` puts it in them: ``prefill`` backends prefill only, ``decode`` ones decode only, ``both``
ones are in both pools (llm-d's decode-filter keeps unlabelled and ``both`` pods). A split goes
over a link the gateway may use (`router.types.PdFleet.usable_link`); with none, the request is
served whole on the decode pick, as those routers' decode workers do when no prefill is attached.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from router import kappa
from router.links import Link
from router.pd import transfer_tokens
from router.types import BackendView, Candidate, Decision, PdFleet, PrefillLeg, RequestFeatures

Pool = tuple[list[Candidate], list[BackendView]]


def pools(candidates: Sequence[Candidate], views: Sequence[BackendView], pd: PdFleet) -> tuple[Pool, Pool]:
    """(prefill pool, decode pool): candidates and views whose role prefills (not ``decode``) and
    whose role decodes (not ``prefill``; every backend when none does), in the given order."""
    prefill: Pool = ([], [])
    decode: Pool = ([], [])
    for c, v in zip(candidates, views, strict=True):
        role = pd.role(c.backend_id)
        if role != "decode":
            prefill[0].append(c)
            prefill[1].append(v)
        if role != "prefill":
            decode[0].append(c)
            decode[1].append(v)
    if not decode[0]:
        decode = (list(candidates), list(views))
    return prefill, decode


def first_linked(prefill_ranked: Sequence[Candidate], decode_id: str, pd: PdFleet) -> tuple[Candidate, Link] | None:
    """The best-ranked prefill candidate with a usable link to ``decode_id`` (never itself), and that link."""
    for c in prefill_ranked:
        link = pd.usable_link(c.backend_id, decode_id)
        if link is not None:
            return c, link
    return None


def split_decision(policy: str, features: RequestFeatures, prefill: Candidate, link: Link,
                   decode_ranked: Sequence[Candidate], decode_view: BackendView, reason: str) -> Decision:
    """A split: prefill on ``prefill``, decode on ``decode_ranked[0]`` (the rest: aggregated fallbacks),
    with the transfer of (P − K_d) tokens over ``link`` priced as the router prices it (`router.pd`)."""
    decode = decode_ranked[0]
    tokens = transfer_tokens(features, decode)
    seconds = link.transfer_s(kappa.model_constants(decode_view.spec.model).kv_bytes(tokens) if tokens else 0.0)
    return Decision(policy, tuple(decode_ranked), reason, PrefillLeg(prefill, tokens, seconds, link))
