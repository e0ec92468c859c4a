"""The measured κ_crit: the gateway fits it from real streamed TTFTs of a real mock backend."""

from __future__ import annotations

import random
import string

import pytest

from fleet_config.catalog import default_catalog
from router.cost import BackendSpec
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, run_gateway, run_mocks

pytestmark = pytest.mark.integration


def words(tag: str, n: int) -> str:
    """``n`` three-letter words (one mock token each), fixed by ``tag``."""
    rng = random.Random(tag)
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3)) for _ in range(n))


def stream(gw, prompt: str) -> None:
    with gw.http.stream("POST", "/v1/completions", json={"model": MOCK_MODEL, "prompt": prompt, "max_tokens": 1,
                                                          "stream": True}) as resp:
        assert resp.status_code == 200
        resp.read()


def test_measured_kappa_crit_matches_the_backends_physics() -> None:
    # 400 blocks × 16 = 6,400 tokens of HBM KV, so a 5,000-token prefix is pushed wholly to the
    # host tier by two other prompts; time scale 1 so that gateway overhead (~2 ms) is small
    # against the prefill (~180 ms) and the load (~44 ms).
    with run_mocks(1, time_scale=1.0, num_gpu_blocks_override=400) as urls, \
            run_gateway([backend_doc("a", urls[0], host_tier_gb=16)]) as gw:
        for i in range(6):
            stream(gw, words(f"cold{i}x", 5_000))  # compute-bound samples, nothing cached
        for i in range(6):
            prefix = words(f"doc{i}y", 5_000)
            stream(gw, prefix)
            stream(gw, words(f"evict{i}a", 5_000))
            stream(gw, words(f"evict{i}b", 5_000))
            stream(gw, prefix + " " + words("q", 40))  # prefix now in the host tier: transfer-bound
        backend = gw.http.get("/v1/kappa/backends").json()["backends"][0]
    catalog = default_catalog()
    predicted = BackendSpec(model=catalog.model(MOCK_MODEL), hardware=catalog.hw("h100-sxm")).kappa_crit_linear
    assert backend["kappa_fit_samples"]["compute"] >= 5 and backend["kappa_fit_samples"]["transfer"] >= 5
    assert backend["kappa_crit_measured"] == pytest.approx(predicted, rel=0.2)
