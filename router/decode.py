"""The decode a request joins on a backend: its time per output token there, its E2E, and what it
costs everyone else on that backend.

`router.cost.predict` prices one request alone. A backend decodes a batch: vLLM's v1 scheduler
(``vllm/v1/core/sched/scheduler.py``) gives every running request its next token in one engine
step, and fills the rest of the step's token budget with chunks of waiting prefills (chunked
prefill). The step is the roofline the mock engine times its own steps with
(`router.cost.roofline`, `mock_vllm.engine`), over the n decoding sequences:

    flops     = n · F_lin + a · Σ ctx_i             (each token attends to its context)
    hbm bytes = weights_read(n) + B_kv · Σ ctx_i     (each sequence reads its own KV: a shared
                                                      prefix is read once per sequence)
    step      = max(flops / C_eff, hbm bytes / HBM bandwidth)

The batch a request would join on backend b is what is in flight there: the gateway's ledger
(`dispatch.Ledger`: requests, Σ ctx with ctx = prompt + max_tokens / 2, the average over a
decode, and Σ max_tokens), plus the requests the last scrape found beyond the ledger
(``BackendView.foreign_requests``: traffic the gateway does not see), each of those at the
ledger's mean context.
For this request (prompt P, max_tokens o, s sequences):

    itl_s           = step(batch + its s sequences at P + o/2)
    decode_s        = (o − 1) · itl_s
    e2e_s           = ttft_s + decode_s
    interference_s  = the seconds it adds to the others' E2E there:
        prefill stall   n_b · prefill_s: its prefill chunks share steps with their decodes,
                        and each of the n_b requests there waits for them (the ITL spike
                        P/D disaggregation exists to remove; DistServe, OSDI '24)
        slower steps    (itl_s − step(batch)) · min(n_b · o, Σ o_i / 2): each step of theirs
                        it shares reads its KV too, for as many of their tokens as overlap
                        its decode (each has, on average, half its output still to come)

The batch is taken as it stands for the whole decode (requests leave and arrive: the figure
is an estimate, like the queue wait).
"""

from __future__ import annotations

from typing import NamedTuple

from router import kappa
from router.cost import BackendSpec, CostEstimate
from router.types import BackendView, RequestFeatures


class DecodeEstimate(NamedTuple):
    """A request's decode on one backend, joined to the batch there (seconds).

    Attributes:
        itl_s: predicted time per output token (one engine step with it in the batch).
        decode_s: (max_tokens − 1) · itl_s.
        e2e_s: the estimate's TTFT + decode_s.
        interference_s: seconds it adds to the E2E of the requests already there (module docstring).
        batch_requests: the requests it joins (the ledger's and the scraped foreign ones).
    """

    itl_s: float
    decode_s: float
    e2e_s: float
    interference_s: float
    batch_requests: int


def decode_context_tokens(features: RequestFeatures) -> float:
    """The context a request's decode steps read, on average over its decode: sequences · (prompt +
    max_tokens / 2), tokens. The one definition: the ledger charges it (`dispatch.Dispatcher.charge`)
    and `estimate_decode` adds it to the batch."""
    return max(features.sequences, 1) * (max(features.prompt_tokens, 1) + max(features.max_tokens, 1) / 2.0)


def decode_step_s(spec: BackendSpec, sequences: float, context_tokens: float) -> float:
    """One decode step of ``sequences`` sequences holding ``context_tokens`` tokens of context in
    all, on ``spec``: the roofline of the module docstring, seconds (0 for an empty batch)."""
    return _step_s(kappa.model_constants(spec.model), spec, sequences, context_tokens)


def _step_s(c: kappa.ModelConstants, spec: BackendSpec, sequences: float, context_tokens: float) -> float:
    """`decode_step_s` with the model's constants ``c`` already looked up (once per candidate)."""
    if sequences <= 0:
        return 0.0
    flops = sequences * c.f_linear + c.a_full * context_tokens
    # Per sequence: sliding-window layers hold at most their window of each one's context.
    hbm = c.weights_read_bytes(sequences) + sequences * c.kv_bytes(context_tokens / sequences)
    # `router.cost.roofline` with nothing to load, inlined (it is priced for every candidate of
    # every request): max(compute, HBM); tests hold it to the mock engine's own step.
    return max(flops / spec.c_eff_flops_per_s, hbm / spec.hbm_bandwidth_bytes_per_s)


class DecodePricer:
    """One request's decode, priced on each candidate backend: the request's own figures (its
    output, sequences and context) are derived once, not once per candidate.

    `seconds` is the arithmetic of the module docstring, and the only copy of it: `estimate`
    (and `estimate_decode`) wraps its figures in a `DecodeEstimate`; a policy that only scores
    the candidates reads the bare figures, and allocates nothing per candidate (mypyc returns
    the tuple unboxed).
    """

    def __init__(self, features: RequestFeatures) -> None:
        self.output = max(features.max_tokens, 1)
        self.sequences = max(features.sequences, 1)
        self.own_context = decode_context_tokens(features)
        self._spec: BackendSpec | None = None  # the last candidate's spec (equal specs are one object)
        self._constants: kappa.ModelConstants | None = None  # and its model's constants

    def seconds(self, estimate: CostEstimate, view: BackendView) -> tuple[float, float, float, int]:
        """The request's decode on ``view``'s backend (priced alone there as ``estimate``):
        ``(itl_s, decode_s, interference_s, batch_requests)``, as in `DecodeEstimate`."""
        output, sequences, own_context = self.output, self.sequences, self.own_context
        batch = view.in_flight
        context = view.context_tokens
        if view.foreign_requests:  # requests the ledger does not see (another gateway, direct clients)
            mean = context / batch if batch else own_context / sequences
            context += view.foreign_requests * mean
            batch += view.foreign_requests
        spec = view.spec
        c = self._constants
        if spec is not self._spec or c is None:
            c = self._constants = kappa.model_constants(spec.model)
            self._spec = spec
        itl = _step_s(c, spec, batch + sequences, context + own_context)
        decode = (output - 1) * itl
        interference = 0.0
        if batch:
            overlap = min(batch * output, view.output_tokens / 2.0)
            interference = batch * estimate.prefill_s + (itl - _step_s(c, spec, batch, context)) * overlap
        return itl, decode, interference, batch

    def estimate(self, estimate: CostEstimate, view: BackendView) -> DecodeEstimate:
        """`seconds` as a `DecodeEstimate` (its E2E: ``estimate``'s TTFT + the decode)."""
        itl, decode, interference, batch = self.seconds(estimate, view)
        return DecodeEstimate(itl, decode, estimate.ttft_s + decode, interference, batch)


def estimate_decode(features: RequestFeatures, estimate: CostEstimate, view: BackendView) -> DecodeEstimate:
    """The decode of a request (``features``, priced alone on ``view``'s backend as ``estimate``)
    in the batch that backend holds (`BackendView` ledger and scraped figures).

    Returns: a `DecodeEstimate` (formulas in the module docstring; `DecodePricer` prices many
    backends for one request).
    """
    return DecodePricer(features).estimate(estimate, view)
