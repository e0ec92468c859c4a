"""Requests for the feed and schedule tests: a Llama-3.1-8B H100 backend, candidates and usage by value."""

from __future__ import annotations

from fleet_config import default_catalog
from router import kappa
from router.cost import BackendSpec, RequestShape, predict
from router.kappa_fit import PrefillPrediction
from router.types import Candidate

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))


def candidate(prompt: int, *, hbm: int = 0, host: int = 0, spec: BackendSpec = SPEC) -> Candidate:
    """The router's figures for a prompt with ``hbm`` and ``host`` tokens cached (index estimates)."""
    estimate = predict(RequestShape(hbm, host, prompt - hbm - host), spec)
    return Candidate("h100", hbm, host, prompt - hbm - host, estimate, True)


def usage(prompt: int, cached: int = 0) -> dict[str, object]:
    return {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}


def step(chunks: list[tuple[int, int]], *, host_tokens: int = 0, decodes: tuple[int, ...] = (),
         spec: BackendSpec = SPEC) -> PrefillPrediction:
    """One engine step's seconds by resource on ``spec``, by hand: ``chunks`` of (tokens, context) each,
    ``host_tokens`` loaded from the host tier, ``decodes`` the prompt lengths of requests decoding."""
    c = kappa.model_constants(spec.model)
    flops = sum(c.prefill_flops(context, tokens) for tokens, context in chunks)
    flops += sum(c.prefill_flops(context, 1) for context in decodes)
    hbm = c.weights_read_bytes(sum(t for t, _ in chunks) + len(decodes))
    hbm += sum(c.kv_bytes(context) for _, context in chunks) + sum(c.kv_bytes(d) for d in decodes)
    load = c.kv_bytes(host_tokens) / spec.link_bytes_per_s if host_tokens else 0.0
    return PrefillPrediction(flops / spec.c_eff_flops_per_s, load, hbm / spec.hbm_bandwidth_bytes_per_s, 0.0)


def seconds(term: PrefillPrediction) -> float:
    """The term's seconds at the profile (overlapped loads)."""
    return max(term.t_compute_s, term.t_load_s, term.t_hbm_s)
