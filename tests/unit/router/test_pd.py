"""P/D disaggregation priced by the one cost model (`router.pd`, `KappaPolicy.decide_pd`) and the
config that describes a P/D fleet (`fleet_config.interconnect`): hand-computed transfers, the split
that pays and the one that does not, links that may not be used, and what every other policy does."""

from __future__ import annotations

import random

import pytest

from fleet_config import ConfigError, parse_settings
from fleet_config.catalog import default_catalog
from router import kappa
from router.candidates import build_candidates
from router.cost import BackendSpec
from router.decide import decide
from router.decode import estimate_decode
from router.links import Interconnect, Link, LinkKind
from router.pd import price_split, transfer_tokens
from router.policies import build_policy
from router.types import BackendView, PdFleet, RequestFeatures

CATALOG = default_catalog()
MODEL = CATALOG.model("llama-3.1-70b")
B200 = BackendSpec(model=MODEL, hardware=CATALOG.hw("b200"), tensor_parallel=2)
H100 = BackendSpec(model=MODEL, hardware=CATALOG.hw("h100-sxm"), tensor_parallel=4, power_cap_w=350)
BLOCK = 64.0
B_KV = 327_680  # Llama-3.1-70B, REFERENCE.md §1
RDMA = Link.of(50.0, 0.0005, "rdma")
LINKS = Interconnect(default=RDMA)
ROLES = {"p": "prefill", "d": "decode"}


def features(prompt: int, max_tokens: int = 200) -> RequestFeatures:
    return RequestFeatures("llama-3.1-70b", prompt, max_tokens, int(prompt // BLOCK), BLOCK)


def view(bid: str, spec: BackendSpec, **kw: object) -> BackendView:
    kw.setdefault("kv_capacity_bytes", 400e9)
    return BackendView(bid, spec, **kw)


def busy_decoder(**kw: object) -> BackendView:
    """A decode backend with 40 requests decoding (ctx 3k tokens each)."""
    return view("d", H100, in_flight=40, context_tokens=40 * 3000.0, output_tokens=40 * 200.0, **kw)


def test_a_link_moves_kv_in_latency_plus_bytes_over_bandwidth() -> None:
    assert RDMA.transfer_s(50e9) == pytest.approx(0.0005 + 1.0)
    assert RDMA.transfer_s(0) == 0.0
    assert Link.of(1.0, 0.0, LinkKind.TCP).bandwidth_bytes_per_s == 1e9


def test_the_split_is_priced_term_by_term() -> None:
    """P = 8,192, d holds 2,048 (32 blocks): 6,144 tokens cross at 50 GB/s (+ 0.5 ms)."""
    f = features(8192)
    p_view, d_view = view("p", B200), busy_decoder(hbm_blocks=32)
    p, d = build_candidates(f, [p_view, d_view])
    decode = estimate_decode(f, d.estimate, d_view)
    split = price_split(f, p, 0, d, H100, decode, RDMA)
    assert transfer_tokens(f, d) == 8192 - 2048 == split.leg.transfer_tokens
    assert split.leg.transfer_s == pytest.approx(0.0005 + 6144 * B_KV / 50e9)
    assert split.ttft_s == pytest.approx(p.estimate.ttft_s + split.leg.transfer_s + decode.itl_s)
    assert split.decode_s == decode.decode_s
    assert split.work_s == p.estimate.prefill_s
    # On d only its KV slows the decoders' steps: the prefill stall (40 × d's prefill) is gone.
    assert split.interference_s == pytest.approx(decode.interference_s - 40 * d.estimate.prefill_s)
    assert split.e2e_s == pytest.approx(split.ttft_s + split.decode_s)


def test_a_prefill_on_a_backend_that_also_decodes_stalls_its_decoders() -> None:
    f = features(8192)
    p_view, d_view = view("p", B200), busy_decoder()
    p, d = build_candidates(f, [p_view, d_view])
    decode = estimate_decode(f, d.estimate, d_view)
    alone = price_split(f, p, 0, d, H100, decode, RDMA)
    shared = price_split(f, p, 10, d, H100, decode, RDMA)
    assert shared.interference_s - alone.interference_s == pytest.approx(10 * p.estimate.prefill_s)


def test_a_long_uncached_prompt_splits_off_a_busy_decoder() -> None:
    """8k new tokens on a decoder with 40 requests running would stall all 40 for its prefill:
    κ sends the prefill to the compute-dense node and ships the KV."""
    pd = PdFleet(ROLES, LINKS)
    d = decide(build_policy("kappa"), features(8192), [view("p", B200), busy_decoder()], random.Random(0), pd)
    assert d.prefill is not None and d.prefill.candidate.backend_id == "p"
    assert d.chosen.backend_id == "d" and d.reason.startswith("split: prefill on p")


def test_a_prompt_the_decoder_holds_stays_there() -> None:
    """All but the last block is in d's HBM (κ high there): its prefill on d is tiny, a split would
    ship the same few tokens after prefilling 8k on p."""
    pd = PdFleet(ROLES, LINKS)
    d = decide(build_policy("kappa"), features(8192), [view("p", B200), busy_decoder(hbm_blocks=127, matched_blocks=127)],
               random.Random(0), pd)
    assert d.prefill is None and d.chosen.backend_id == "d"
    assert "aggregated: the best split scored" in d.reason


def test_a_slow_link_is_not_worth_crossing() -> None:
    slow = PdFleet(ROLES, Interconnect(default=Link.of(0.05, 0.0, "tcp")))  # 50 MB/s: 8k tokens take ~54 s
    d = decide(build_policy("kappa"), features(8192), [view("p", B200), busy_decoder()], random.Random(0), slow)
    assert d.prefill is None


def test_an_unusable_or_missing_link_is_never_split_over() -> None:
    views = [view("p", B200), busy_decoder()]
    for pd in (PdFleet(ROLES, LINKS, frozenset({("p", "d")})), PdFleet(ROLES, Interconnect()), PdFleet(ROLES, LINKS).unsplit()):
        d = decide(build_policy("kappa"), features(8192), views, random.Random(0), pd)
        assert d.prefill is None and d.chosen.backend_id == "d"  # whole, on the backend that decodes


@pytest.mark.parametrize("policy", ["kappa-aggregated", "round-robin", "least-loaded", "prefix-affinity", "weighted"])
def test_a_policy_that_does_not_split_never_sends_a_request_to_a_prefill_only_backend(policy: str) -> None:
    pd = PdFleet(ROLES, LINKS)
    rng = random.Random(0)
    for _ in range(8):
        d = decide(build_policy(policy), features(8192), [view("p", B200), busy_decoder()], rng, pd)
        assert d.prefill is None and [c.backend_id for c in d.ranked] == ["d"]


def test_without_a_pd_fleet_decisions_are_as_before() -> None:
    views = [view("a", B200), busy_decoder()]
    with_none = decide(build_policy("kappa"), features(8192), views, random.Random(3))
    assert with_none.prefill is None and with_none.policy == "kappa"


# -- the config ---------------------------------------------------------------------------------

def backend(bid: str, port: int, role: str = "both", **kw: object) -> dict[str, object]:
    return {"id": bid, "url": f"http://127.0.0.1:{port}", "model": "llama-3.1-70b", "hardware": "b200",
            "kv_role": role, **kw}


def test_a_pd_fleet_reads_its_roles_nodes_and_links() -> None:
    s = parse_settings({"interconnect": {"default": {"bandwidth_gb_s": 25, "latency_s": 0.001},
                                         "intra_node": {"bandwidth_gb_s": 400, "kind": "nvlink"},
                                         "links": [{"between": ["p", "d2"], "bandwidth_gb_s": 1, "kind": "tcp"}]},
                        "backends": [backend("p", 8001, "prefill", node="n1"), backend("d1", 8002, "decode", node="n1"),
                                     backend("d2", 8003, "decode")]}, CATALOG, env={})
    table = s.interconnect_table()
    assert s.disaggregated
    assert table.link("p", "d1") == Link(400e9, 0.0, LinkKind.NVLINK)  # one node
    assert table.link("p", "d2") == table.link("d2", "p") == Link(1e9, 0.0, LinkKind.TCP)  # the pair's own
    assert table.link("d1", "d2") == Link(25e9, 0.001, LinkKind.RDMA)  # the default
    assert table.link("p", "p") is None


def test_an_aggregated_fleet_is_not_disaggregated() -> None:
    s = parse_settings({"backends": [backend("a", 8001)]}, CATALOG, env={})
    assert not s.disaggregated and s.interconnect_table().empty


@pytest.mark.parametrize(("doc", "message"), [
    ({"backends": [backend("p", 8001, "prefill"), backend("d", 8002, "decode")]},
     "backends[0].kv_role: 'p' prefills, but no backend that decodes"),
    ({"interconnect": {"links": [{"between": ["p", "x"], "bandwidth_gb_s": 5}]},
      "backends": [backend("p", 8001, "prefill"), backend("x", 8002, "prefill"), backend("d", 8003, "decode")]},
     "backends[0].kv_role: 'p' prefills, but no backend that decodes"),
    ({"interconnect": {"links": [{"between": ["p", "nope"], "bandwidth_gb_s": 5}]},
      "backends": [backend("p", 8001, "prefill"), backend("d", 8002, "decode")]},
     "interconnect.links[0].between: unknown backend id 'nope'"),
    ({"interconnect": {"links": [{"between": ["p", "p"], "bandwidth_gb_s": 5}]}, "backends": [backend("p", 8001)]},
     "a link joins two different backends"),
    ({"interconnect": {"default": {"bandwidth_gb_s": 0}}, "backends": [backend("p", 8001)]},
     "interconnect.default.bandwidth_gb_s"),
    ({"interconnect": {"default": {"bandwidth_gb_s": 5, "kind": "carrier-pigeon"}}, "backends": [backend("p", 8001)]},
     "interconnect.default.kind"),
    ({"backends": [backend("p", 8001, "producer")]}, "backends[0].kv_role"),
])
def test_a_bad_pd_config_names_the_key(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_settings(doc, CATALOG, env={})


def test_the_shipped_pd_fleet_is_valid() -> None:
    from pathlib import Path

    from fleet_config import load_settings
    s = load_settings(Path(__file__).parents[3] / "config" / "fleets" / "disaggregated.yaml", CATALOG, env={})
    assert s.disaggregated
    assert {b.kv_role for b in s.backends} == {"prefill", "decode", "both"}
    assert kappa.b_kv_bytes(s.model_profile(CATALOG, "llama-3.1-70b")) == B_KV
