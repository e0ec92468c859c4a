"""A target's KV capacity: scraped when known, else the config's override, else vLLM's sizing rule."""

from __future__ import annotations

import pytest

from dispatch import BackendMetrics, Target
from fleet_config import default_catalog
from router.cost import BackendSpec

CATALOG = default_catalog()
H100_8B = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
BLOCK_BYTES_16 = 16 * 131_072  # one 16-token block of Llama-3.1-8B KV


@pytest.mark.parametrize(("override", "metrics", "expected"), [
    # Before the first scrape, the config's --num-gpu-blocks-override (16-token blocks) sets it.
    (400, BackendMetrics(), 400 * BLOCK_BYTES_16),
    # A scrape of vllm:cache_config_info wins over the override (block size included).
    (400, BackendMetrics(num_gpu_blocks=1_000, block_size_tokens=32), 1_000 * 32 * 131_072),
    # Neither: vLLM's rule, ⌊(80 GiB × 0.9 − 16.06 GB of weights) / block⌋ blocks.
    (None, BackendMetrics(), ((80 * 1024**3 * 0.9 - 8.03e9 * 2) // BLOCK_BYTES_16) * BLOCK_BYTES_16),
    # A scrape without the block size (an older server) is not enough on its own.
    (400, BackendMetrics(num_gpu_blocks=1_000), 400 * BLOCK_BYTES_16),
], ids=["override-before-the-first-scrape", "scraped-wins", "sizing-rule", "half-a-scrape"])
def test_kv_capacity(override: int | None, metrics: BackendMetrics, expected: float) -> None:
    target = Target("a", H100_8B, num_gpu_blocks_override=override, metrics=metrics)
    assert target.kv_capacity_bytes == pytest.approx(expected)


def test_kv_capacity_follows_each_new_scrape() -> None:
    target = Target("a", H100_8B, num_gpu_blocks_override=400)
    assert target.kv_capacity_bytes == 400 * BLOCK_BYTES_16
    target.metrics = BackendMetrics(num_gpu_blocks=500, block_size_tokens=16)
    assert target.kv_capacity_bytes == 500 * BLOCK_BYTES_16
