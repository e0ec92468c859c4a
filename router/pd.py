"""Prefill/decode disaggregation priced by the one cost model: aggregated on d, or prefill on p and
decode on d, whichever costs less.

The paper's point (Meng, Lee & Wang, arXiv 2601.19910): P/D disaggregation assumes prefill is
compute-bound; with prefix caching a request with K ≫ T is bound by loading KV, so shipping it to
a compute-dense prefill node buys little and adds a KV transfer. The peers split by fixed rules
(llm-d's prompt and uncached-token thresholds, Dynamo's T < 2048 and T/(K+T) < 0.7, or always:
vLLM production-stack, SGLang); none prices the transfer by the link it crosses. Here a split
(p, d) of a request with prompt P is priced with the same terms as an aggregated placement
(`router.policies.kappa`'s score):

    ttft_s          = max(TTFT on p (its queue, its prefill with p's cache: `router.cost.predict`)
                          + max(transfer, d's own host/pool load),   KV d lacks crosses link(p, d):
                                 transfer = latency + (P − K_d) · B_kv / bandwidth; what d holds in
                                 its host tier or the pool is loaded at the same time over d's links
                          d's queue)       the prefills queued on d take its step budget first
                      + one decode step on d (the first token is sampled on d)
    decode_s        = (max_tokens − 1) · ITL on d, in d's batch (`router.decode.estimate_decode`)
    work_s          = prefill seconds on p (what the requests queued behind it there wait)
    interference_s  = on p: its decoders stalled by the prefill (p's decoding requests × prefill;
                      none on a ``prefill``-role backend, which decodes nothing)
                      + on d: its KV read at each step its decoders share (no prefill stall on
                      d: the prefill happened elsewhere; that stall is what P/D removes,
                      DistServe, OSDI '24)

An aggregated placement on d prices its prefill on d (d's cache) and the stall it inflicts on
d's decoders. So a request whose prefix d already holds (high κ there) stays: its T on d is small
and its transfer would be P − K_d ≈ T anyway; a long uncached prompt over a fast link goes to the
compute-dense prefill node when the decoders it would stall outweigh the transfer.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import NamedTuple

from router import kappa
from router.cost import BackendSpec
from router.decode import DecodeEstimate
from router.links import Link
from router.types import Candidate, PrefillLeg, RequestFeatures


class SplitEstimate(NamedTuple):
    """One split (prefill on p, decode on d) priced (seconds; module docstring).

    Attributes:
        decode_id: the decode backend.
        leg: the prefill half (p's candidate, the tokens and seconds of the transfer, the link).
        ttft_s: predicted TTFT of the split request.
        decode_s: predicted decode seconds on d.
        work_s: prefill seconds it holds p for.
        interference_s: seconds it adds to the requests already on p and on d.
    """

    decode_id: str
    leg: PrefillLeg
    ttft_s: float
    decode_s: float
    work_s: float
    interference_s: float

    @property
    def e2e_s(self) -> float:
        return self.ttft_s + self.decode_s


def transfer_tokens(features: RequestFeatures, decode: Candidate) -> int:
    """Prompt tokens whose KV must cross to the decode backend: P − K_d (what d lacks), ≥ 0.

    vLLM's NixlConnector pulls only the remote blocks past the decode instance's own prefix hit
    (``get_num_new_matched_tokens`` counts the local hit first); K_d counts every tier of d.
    """
    return max(max(features.prompt_tokens, 1) - decode.cached_tokens, 0)


def price_split(features: RequestFeatures, prefill: Candidate, prefill_decoders: int, decode: Candidate,
                decode_spec: BackendSpec, decode_estimate: DecodeEstimate, link: Link) -> SplitEstimate:
    """Price prefill on ``prefill``'s backend and decode on ``decode``'s (module docstring).

    Args:
        features: the request.
        prefill: its candidate on the prefill backend (cache, queue, prefill seconds there).
        prefill_decoders: requests decoding on the prefill backend, which its prefill would stall
            (0 for a ``prefill``-role backend).
        decode: its candidate on the decode backend.
        decode_spec: the decode backend's figures (the model's B_kv: `router.kappa.ModelConstants.kv_bytes`).
        decode_estimate: `router.decode.estimate_decode` of the request on the decode backend,
            aggregated (its interference there includes the prefill stall, taken out here).
        link: link(prefill, decode).
    """
    tokens = transfer_tokens(features, decode)
    transfer_s = link.transfer_s(kappa.model_constants(decode_spec.model).kv_bytes(tokens) if tokens else 0.0)
    d_est = decode.estimate
    # The pulled request joins d's waiting queue: the prefills already queued there (its ledger's
    # outstanding prefill seconds, the aggregated TTFT less its own prefill) take d's token budget
    # first (chunked prefill), so it starts no earlier than they end.
    d_queue_s = d_est.ttft_s - d_est.prefill_s
    ttft = max(prefill.estimate.ttft_s + max(transfer_s, d_est.t_load_s), d_queue_s) + decode_estimate.itl_s
    # d's interference when aggregated = batch · its prefill there + the slower steps; split, the
    # prefill runs on p and only the slower steps stay.
    slower_steps = max(decode_estimate.interference_s - decode_estimate.batch_requests * d_est.prefill_s, 0.0)
    interference = prefill_decoders * prefill.estimate.prefill_s + slower_steps
    leg = PrefillLeg(prefill, tokens, transfer_s, link)
    return SplitEstimate(decode.backend_id, leg, ttft, decode_estimate.decode_s, prefill.estimate.prefill_s, interference)

