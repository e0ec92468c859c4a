"""``kappa`` (default): least predicted E2E plus what the request costs the others, under
memory-aware admission, ties to lower energy.

Category: cost (affinity and distribution priced at once). For each candidate the cost model
prices this request on that backend: `router.cost.predict` its prefill (its cached prefix by
tier, its T, the backend's C_eff and its host and pool links, the prefill work the gateway
already queued there) and `router.decode.estimate_decode` its decode in the batch the backend
holds (the step time with it, and what it adds to everyone decoding there). A high-κ request
goes where loading its prefix is cheap (KV in HBM, or a fast link), a large-T prefill where
compute is dense, and a long answer where the decode batch leaves it bandwidth. The score is

    ttft_weight · predicted TTFT + decode_weight · predicted decode seconds
      + work_weight · predicted prefill seconds + interference_weight · interference seconds

- TTFT + decode is the request's own predicted E2E.
- The prefill term is what it costs the requests that queue behind it: its prefill holds that
  backend for prefill seconds, and each one queued behind waits as long. Greedy TTFT alone
  ignores it, and under load moves a conversation off the backend holding its prefix to a
  shorter queue where it recomputes the prefix, work that then delays everyone there.
- The interference term is what it costs the requests already decoding there: its prefill
  chunks stall their decode steps, and its KV makes each step they share slower
  (`router.decode`). Pricing the prefill alone piles requests on the compute-dense backends,
  whose decode batches then grow until the answers that finish last are theirs (issue 25).

``decode_weight`` 0 and ``interference_weight`` 0 give the TTFT objective (κ before issue 25).
With ``ttft_slo_s`` > 0, candidates predicted to meet that TTFT rank before those that would
not (TTFT first where the SLO is TTFT-bound), each group by its score. Backends where
(K + T + max_tokens)·B_kv does not fit the free KV memory rank after those where it does.
Among candidates whose score is within ``energy_tie_ratio`` of the best (default 0: exact ties),
the lower predicted energy wins (power-capped and transfer-bound placements are cheaper in joules). Measured in
BENCHMARKS.md (`bench/routing_quality.py`, `bench/routing_live.py`).

Parameters: `KappaParams`.

YAML::

    routing:
      policy: kappa
      params:
        energy_tie_ratio: 0.0
        work_weight: 1.0
        decode_weight: 1.0
        interference_weight: 1.0
        ttft_slo_s: 0.0
        split_overhead_s: 0.005
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.cost import CostEstimate
from router.decode import DecodeEstimate, DecodePricer, estimate_decode
from router.pd import SplitEstimate, price_split
from router.policies.base import PolicyConfigError, params_reduce, parse_params, require
from router.types import BackendView, Candidate, Decision, PdFleet, RequestFeatures

NAME = "kappa"

# Off by default since issue 25. The band was 5%, for the TTFT objective: a power cap moves a
# backend's predicted TTFT by a few percent (650 W leaves an H100 SXM (580/630)^(1/3) of its
# clocks at 93% of its power), and a 5% band let the cheaper joules win such near-ties. Under
# the E2E objective the band, a share of a score that counts the seconds a request adds to the
# others, kept handing near-ties to the power-capped backend, which then held half the demo's
# requests: TTFT p90 37 s against 24 s without it, E2E p90 46 s against 37 s (the demo fleet in
# the simulator, 400 Mooncake requests, 64 in flight, median of 6 seeds; BENCHMARKS.md). A band
# on the request's own cost alone did no better (34 s, 45 s). Energy-aware placement is issue 31's.
DEFAULT_ENERGY_TIE_RATIO = 0.0
# Each second this request's prefill holds a backend is a second every request queued behind
# it waits: weight 1 charges it once, as one more waiting request would feel it.
DEFAULT_WORK_WEIGHT = 1.0
# The request's own E2E counts TTFT and decode alike: a user streaming an answer waits for both.
DEFAULT_TTFT_WEIGHT = 1.0
DEFAULT_DECODE_WEIGHT = 1.0
# Each second it adds to another request's E2E counts as a second of its own.
DEFAULT_INTERFERENCE_WEIGHT = 1.0
# What a split costs that the cost model does not price: a second request through the gateway (its
# prefill phase's answer is read whole before the decode phase is sent: a loopback round trip is
# ~1 ms, a cross-node one more) and the decode engine's scheduling of it (vLLM admits a request whose
# KV has arrived at its next step: half a decode step on average, ~5 ms on a busy 70B decoder). It
# keeps tiny prompts whole: their prefill is a weights read, a few ms faster on a B200 than on an
# H100, not worth a second engine.
DEFAULT_SPLIT_OVERHEAD_S = 0.005


@dataclass(frozen=True, slots=True)
class KappaParams:
    """The ``kappa`` policy's parameters (``routing.params``).

    Attributes:
        energy_tie_ratio: relative score band, in [0, 1), within which candidates count as
            tied and the lower predicted energy wins (0.05: a score ≤ 1.05 × the best; default 0:
            exact ties only).
        work_weight: weight (seconds per second, ≥ 0) of the request's own predicted prefill
            seconds (what it costs the requests queued behind it).
        ttft_weight: weight (≥ 0) of its predicted TTFT.
        decode_weight: weight (≥ 0) of its predicted decode seconds (E2E − TTFT); 0, with
            ``interference_weight`` 0, ranks by TTFT and prefill work alone.
        interference_weight: weight (≥ 0) of the seconds it adds to the E2E of the requests
            already on the backend (`router.decode`).
        ttft_slo_s: a TTFT SLO, s (≥ 0; 0: none): candidates predicted within it rank first.
        split_overhead_s: P/D: seconds a split adds beyond what `router.pd` prices (≥ 0): the
            prefill phase's own round trip through the gateway, and the decode request's admission
            at the decode engine's next step boundary once its KV has arrived.

    Raises:
        PolicyConfigError: a value out of range (the message names the parameter).
    """

    energy_tie_ratio: float = DEFAULT_ENERGY_TIE_RATIO
    work_weight: float = DEFAULT_WORK_WEIGHT
    ttft_weight: float = DEFAULT_TTFT_WEIGHT
    decode_weight: float = DEFAULT_DECODE_WEIGHT
    interference_weight: float = DEFAULT_INTERFERENCE_WEIGHT
    ttft_slo_s: float = 0.0
    split_overhead_s: float = DEFAULT_SPLIT_OVERHEAD_S

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)

    def __post_init__(self) -> None:
        ratio, weight = self.energy_tie_ratio, self.work_weight
        require(NAME, "energy_tie_ratio", ratio, 0 <= ratio < 1, "in [0, 1)")
        require(NAME, "work_weight", weight, weight >= 0, ">= 0")
        for name in ("ttft_weight", "decode_weight", "interference_weight", "ttft_slo_s", "split_overhead_s"):
            value = getattr(self, name)
            require(NAME, name, value, value >= 0, ">= 0")
        if self.ttft_weight + self.decode_weight + self.work_weight + self.interference_weight == 0:
            require(NAME, "ttft_weight", self.ttft_weight, False, "> 0 when every other weight is 0")

    @property
    def prices_decode(self) -> bool:
        """Whether the score needs the decode estimate (`router.decode`)."""
        return self.decode_weight > 0 or self.interference_weight > 0


class KappaPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "cost"
    disaggregates: ClassVar[bool] = True  # on a P/D fleet `router.decide` asks `decide_pd`

    def __init__(self, params: KappaParams = KappaParams()) -> None:
        self.params = params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming a bad or unknown key."""
        try:
            return cls(parse_params(cls.name, KappaParams, params))
        except PolicyConfigError as exc:  # KappaParams' range checks name ``kappa``; this policy may be another
            raise PolicyConfigError(str(exc).replace(f"policy {NAME!r}", f"policy {cls.name!r}", 1)) from None

    def score(self, candidate: Candidate, decode: DecodeEstimate | None = None) -> float:
        """The policy's score of a candidate, seconds (lower is better; formula in the module
        docstring). ``decode`` is required when `KappaParams.prices_decode`."""
        score = self._prefill_score(candidate.estimate)
        if decode is not None:
            score += self._decode_score(decode.decode_s, decode.interference_s)
        return score

    def _prefill_score(self, est: CostEstimate) -> float:
        """The score's TTFT and prefill-work terms."""
        return self.params.ttft_weight * est.ttft_s + self.params.work_weight * est.prefill_s

    def _decode_score(self, decode_s: float, interference_s: float) -> float:
        """The score's decode and interference terms (added to `_prefill_score` as one sum)."""
        return self.params.decode_weight * decode_s + self.params.interference_weight * interference_s

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        p = self.params
        # `score` for every candidate, without a `DecodeEstimate` per candidate: the chosen one's
        # is re-priced for the reason below (the same arithmetic on the same figures, bit for bit).
        scores: dict[str, float] = {}
        pricer = DecodePricer(features) if p.prices_decode else None
        for c, v in zip(candidates, views):
            score = self._prefill_score(c.estimate)
            if pricer is not None:
                _, decode_s, interference_s, _ = pricer.seconds(c.estimate, v)
                score += self._decode_score(decode_s, interference_s)
            scores[c.backend_id] = score
        slo = p.ttft_slo_s
        if slo <= 0:
            admitted = [c for c in candidates if c.admitted]
            rest = [c for c in candidates if not c.admitted]
            ranked = self._rank(admitted, scores, rng) + self._rank(rest, scores, rng)
        else:
            groups: tuple[list[Candidate], ...] = ([], [], [], [])  # admitted in SLO, admitted, in SLO, rest
            for c in candidates:
                groups[(0 if c.admitted else 2) + (0 if c.estimate.ttft_s <= slo else 1)].append(c)
            ranked = tuple(c for group in groups for c in self._rank(group, scores, rng))
        decode = None
        if pricer is not None:  # the chosen one's decode, for the reason
            decode = pricer.estimate(ranked[0].estimate, next(v for c, v in zip(candidates, views) if c is ranked[0]))
        return self._decision(ranked, decode)

    def _decision(self, ranked: tuple[Candidate, ...], decode: DecodeEstimate | None) -> Decision:
        """The decision for an aggregated ranking, with its reason (``decode``: the chosen one's, when priced)."""
        p = self.params
        slo = p.ttft_slo_s
        best = ranked[0]
        est = best.estimate
        reason = f"least predicted TTFT {est.ttft_s:.4f}s"
        if decode is not None:
            reason = (f"least predicted E2E {decode.e2e_s:.4f}s (TTFT {est.ttft_s:.4f}s + decode at "
                      f"{decode.itl_s * 1000:.2f} ms/token in a batch of {decode.batch_requests}) + "
                      f"{p.interference_weight:g} × {decode.interference_s:.4f}s added to the others")
        reason += (f" + {p.work_weight:g} × prefill {est.prefill_s:.4f}s ({est.regime.value}-bound)"
                   + ("" if best.admitted else "; no backend had free KV memory for it")
                   + ("" if slo <= 0 or est.ttft_s <= slo else f"; none was predicted within the {slo:g}s TTFT SLO"))
        return Decision(self.name, ranked, reason)

    def _rank(self, cands: list[Candidate], scores: dict[str, float], rng: random.Random) -> tuple[Candidate, ...]:
        """``cands`` best first: by score, equal scores in random order (one draw per candidate, in
        the order given), then those within ``energy_tie_ratio`` of the best by predicted energy."""
        if not cands:
            return ()
        # (score, draw, position): a sort of plain tuples, no key function called per candidate;
        # the position only breaks a tie of both, as a stable sort would.
        keyed = [(scores[c.backend_id], rng.random(), i) for i, c in enumerate(cands)]
        keyed.sort()
        band = keyed[0][0] * (1 + self.params.energy_tie_ratio)
        by_score = [cands[i] for _, _, i in keyed]
        tied = [cands[i] for score, _, i in keyed if score <= band]
        if len(tied) > 1:
            tied.sort(key=lambda c: (c.estimate.energy_j, scores[c.backend_id]))
        return tuple(tied) + tuple(by_score[len(tied):])

    def decide_pd(self, features: RequestFeatures, candidates: Sequence[Candidate], views: Sequence[BackendView],
                  pd: PdFleet, rng: random.Random) -> Decision:
        """On a P/D fleet: the best of every aggregated placement (on a backend that decodes) and
        every split (prefill on p, decode on d, over a usable link), each priced by `router.pd` with
        this policy's weights; admitted placements first (KV fits on d, and on p for a split).

        Returns: a `Decision` whose ``prefill`` is set when the split wins; ``ranked`` orders the
        aggregated placements (the split's d first), the fallbacks of a failed attempt.
        """
        p = self.params
        decoders = [(c, v) for c, v in zip(candidates, views) if pd.role(c.backend_id) != "prefill"]
        if not decoders:
            decoders = list(zip(candidates, views))
        decodes = {c.backend_id: estimate_decode(features, c.estimate, v) for c, v in decoders}
        agg = {c.backend_id: self.score(c, decodes[c.backend_id]) for c, _ in decoders}
        best_split: SplitEstimate | None = None
        best_split_score = 0.0
        for pc, pv in zip(candidates, views):
            role = pd.role(pc.backend_id)
            if role == "decode" or not pc.admitted:
                continue
            # Requests decoding on p, which its prefill stalls: none on a prefill-only backend.
            stalled = 0 if role == "prefill" else pv.in_flight + pv.foreign_requests
            for dc, dv in decoders:
                link = pd.usable_link(pc.backend_id, dc.backend_id)
                if link is None or not dc.admitted:
                    continue
                split = price_split(features, pc, stalled, dc, dv.spec, decodes[dc.backend_id], link)
                score = (p.ttft_weight * (split.ttft_s + p.split_overhead_s) + p.decode_weight * split.decode_s
                         + p.work_weight * split.work_s + p.interference_weight * split.interference_s)
                if best_split is None or score < best_split_score:
                    best_split, best_split_score = split, score
        ranked_agg = (self._rank([c for c, _ in decoders if c.admitted], agg, rng)
                      + self._rank([c for c, _ in decoders if not c.admitted], agg, rng))
        best = ranked_agg[0]
        if best_split is not None and (best_split_score < agg[best.backend_id] or not best.admitted):
            leg = best_split.leg
            chosen = next(c for c in ranked_agg if c.backend_id == best_split.decode_id)
            p_est = leg.candidate.estimate
            reason = (f"split: prefill on {leg.candidate.backend_id} (TTFT {p_est.ttft_s:.4f}s, prefill "
                      f"{p_est.prefill_s:.4f}s {p_est.regime.value}-bound), {leg.transfer_tokens} tokens of KV to "
                      f"{chosen.backend_id} over {leg.link.kind.value} in {leg.transfer_s:.4f}s: predicted TTFT "
                      f"{best_split.ttft_s:.4f}s, E2E {best_split.e2e_s:.4f}s; score {best_split_score:.4f} against "
                      f"{agg[best.backend_id]:.4f} aggregated on {best.backend_id}")
            return Decision(self.name, (chosen,) + tuple(c for c in ranked_agg if c is not chosen), reason, leg)
        decision = self._decision(ranked_agg, decodes.get(ranked_agg[0].backend_id))
        if best_split is None:
            return decision
        return Decision(self.name, decision.ranked, decision.reason + f"; aggregated: the best split scored "
                        f"{best_split_score:.4f} against {agg[best.backend_id]:.4f}")


class KappaAggregatedPolicy(KappaPolicy):
    """``kappa-aggregated``: the ``kappa`` policy that never splits a request. On a P/D fleet it
    places each request whole on a backend that decodes (the baseline `kappa`'s splits must beat);
    elsewhere it is ``kappa``. Parameters: `KappaParams`."""

    name: ClassVar[str] = "kappa-aggregated"
    disaggregates: ClassVar[bool] = False
