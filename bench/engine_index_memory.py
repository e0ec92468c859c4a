"""Bytes per indexed block of the exact, event-fed index (issue 30): memory (tracemalloc) and Redis (MEMORY USAGE).

Workload: one backend, ``--blocks`` engine blocks of 16 tokens stored by ``BlockStored`` events of
64 blocks each (1,024 tokens per request, each chain its own), all in HBM; then the same again with
every block also offloaded to the host tier (a second ``BlockStored`` with medium CPU). Engine hashes
are random 64-bit ints, as vLLM's int hashes are.

- memory: `MemoryEngineIndex` under tracemalloc; batches are built before tracing starts, so what is
  counted is what the index keeps (its dicts and the hash ints), plus what ``memory_bytes()`` claims.
- redis: `RedisEngineIndex` on a throw-away ``redis-server`` (loopback, no persistence; or ``--redis-url``),
  ``MEMORY USAGE`` of the backend's four keys after the same batches.

    python bench/engine_index_memory.py [--blocks 100000] [--redis-url URL] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hot_path  # noqa: E402

BLOCK_TOKENS = 16
BLOCKS_PER_EVENT = 64


def batches(n_blocks: int, offload: bool) -> list[Any]:
    from prefix_index.engine_events import BlockStored, EventBatch

    rng = random.Random(7)
    out = []
    for start in range(0, n_blocks, BLOCKS_PER_EVENT):
        n = min(BLOCKS_PER_EVENT, n_blocks - start)
        hashes = tuple(rng.getrandbits(64) for _ in range(n))
        tokens = tuple(rng.randrange(128_000) for _ in range(n * BLOCK_TOKENS))
        events = [BlockStored(hashes, None, tokens, BLOCK_TOKENS, "GPU")]
        if offload:
            events.append(BlockStored(hashes, None, tokens, BLOCK_TOKENS, "CPU"))
        out.append(EventBatch(float(len(out) + 1), tuple(events)))
    return out


async def memory(n_blocks: int, offload: bool) -> dict[str, float]:
    from prefix_index.engine_memory import MemoryEngineIndex

    work = batches(n_blocks, offload)
    index = MemoryEngineIndex()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for seq, batch in enumerate(work):
        await index.apply("m", "b", seq, batch)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    traced = sum(s.size_diff for s in after.compare_to(before, "filename"))
    return {"traced_bytes_per_block": traced / n_blocks, "claimed_bytes_per_block": index.memory_bytes() / n_blocks}


async def redis_usage(url: str, n_blocks: int, offload: bool) -> dict[str, float]:
    from prefix_index.engine_redis import RedisEngineIndex

    index = RedisEngineIndex.from_url(url, key_prefix="bench-engine", timeout_s=5.0, apply_timeout_s=30.0)
    try:
        await index.clear("m", "b")
        for seq, batch in enumerate(batches(n_blocks, offload)):
            await index.apply("m", "b", seq, batch)
        used = await index.memory_usage_bytes("m", "b")
        await index.clear("m", "b")
        return {"memory_usage_bytes_per_block": used / n_blocks}
    finally:
        await index.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    hot_path.select()
    results: dict[str, Any] = {"blocks": args.blocks}
    for name, offload in (("hbm", False), ("hbm+host", True)):
        results[f"memory {name}"] = asyncio.run(memory(args.blocks, offload))
    if args.redis_url:
        for name, offload in (("hbm", False), ("hbm+host", True)):
            results[f"redis {name}"] = asyncio.run(redis_usage(args.redis_url, args.blocks, offload))
    else:
        from tests.support.redis_server import redis_server

        with redis_server() as url:
            for name, offload in (("hbm", False), ("hbm+host", True)):
                results[f"redis {name}"] = asyncio.run(redis_usage(url, args.blocks, offload))
    print(json.dumps(results, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
