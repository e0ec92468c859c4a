"""Memory of the in-memory prefix index: bytes per live block, and the gateway's RSS under a shared prompt.

Two measurements (issue 13, item 8: memory must scale with live blocks, not recorded chains):

- ``index``: `MemoryPrefixIndex` in this process under tracemalloc. Each request is a chain
  of a shared prefix plus unique blocks, recorded on one backend and on the shared KV pool
  (``KV_POOL_ID``), as the gateway records a pool fleet's requests; hashes are fresh int
  objects per request, as `prefix_index.block_hashes` returns them. Reported: traced bytes
  per live block (all of them, and the growth between the first and the last tenth of the
  run, i.e. per block added), and what ``stats().memory_bytes`` claims per block.
- ``rss``: ``kappa-gateway serve`` (memory index, a 1 TB KV pool) in front of
  `bench/upstream_stub.py`, 3,000 chat requests that share a 64 KB system prompt (each with
  its own ~1 KB question), sent 8 at a time; the gateway's resident set size (VmRSS, /proc)
  after a 300-request warm-up and at the end, as KB per request. ``--compare NAME=DIR`` runs
  the same against another source tree (e.g. an export of another commit) side by side.

    python bench/index_memory.py [--part index|rss|both] [--compare old=/tmp/old-tree] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from fleet_config.catalog import default_catalog  # noqa: E402
from fleet_config.settings import parse_settings  # noqa: E402
from gateway.commands.processes import free_port  # noqa: E402
from overhead_servers import Processes, json_line, wait_ready  # noqa: E402
from prefix_index import KV_POOL_ID, MemoryPrefixIndex, TierCapacity  # noqa: E402

MODEL = "llama-3.1-8b"
HARDWARE = "h100-sxm"
BLOCK_BYTES = 256  # the default index block: 64 tokens × 4 bytes/token
ROOMY = TierCapacity(hbm_blocks=1_000_000, host_blocks=0)  # nothing trimmed: every recorded block stays live
# (shared prefix KB, unique blocks per request, requests): the 256 KB prefix with one
# block of its own per request, and a 64 KB system prompt with a ~1 KB question (4 blocks).
INDEX_CASES = ((256, 1, 600), (64, 4, 3000))
RSS_REQUESTS, RSS_WARMUP, RSS_CONCURRENCY = 3000, 300, 8
SYSTEM_PROMPT_BYTES, QUESTION_BYTES = 64 * 1024, 1024


async def index_case(prefix_kb: int, unique_blocks: int, requests: int, seed: int = 0) -> dict[str, Any]:
    rnd = random.Random(seed)
    prefix = [rnd.getrandbits(64) for _ in range(prefix_kb * 1024 // BLOCK_BYTES)]
    index = MemoryPrefixIndex()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    marks: list[tuple[int, int]] = []  # (traced bytes, live blocks) after the first and last tenth
    for i in range(requests):
        chain = [int.from_bytes(h.to_bytes(8, "little"), "little") for h in prefix]  # fresh ints per request
        chain += [rnd.getrandbits(64) for _ in range(unique_blocks)]
        await index.record(MODEL, "b0", chain, ROOMY)
        await index.record(MODEL, KV_POOL_ID, chain, ROOMY)
        del chain
        if i + 1 in (requests // 10, requests):
            stats = await index.stats()
            marks.append((tracemalloc.get_traced_memory()[0] - base, sum(stats.blocks_by_backend.values())))
    stats = await index.stats()
    tracemalloc.stop()
    (first_bytes, first_blocks), (last_bytes, last_blocks) = marks
    return {"shared_prefix_kb": prefix_kb, "unique_blocks_per_request": unique_blocks, "requests": requests,
            "live_blocks": last_blocks, "traced_bytes": last_bytes,
            "traced_bytes_per_live_block": round(last_bytes / last_blocks, 1),
            "growth_bytes_per_added_block": round((last_bytes - first_bytes) / (last_blocks - first_blocks), 1),
            "stats_bytes_per_live_block": round(stats.memory_bytes / last_blocks, 1)}


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gateway_config(stub_port: int, port: int) -> dict[str, Any]:
    doc = {"gateway": {"host": "127.0.0.1", "port": port, "shutdown_drain_delay_s": 0.0},
           "index": {"backend": "memory"}, "routing": {"policy": "kappa", "seed": 0},
           "kv_pool": {"capacity_gb": 1000},
           "backends": [{"id": "b0", "url": f"http://127.0.0.1:{stub_port}", "model": MODEL, "hardware": HARDWARE}]}
    parse_settings(doc, default_catalog(), env={})  # fail here, with the path, on a bad config
    return doc


async def send_requests(port: int, first: int, count: int, system_prompt: str, rnd: random.Random) -> None:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    queue = list(range(first, first + count))
    async with aiohttp.ClientSession() as session:
        async def worker() -> None:
            while queue:
                i = queue.pop()
                question = f"question {i}: " + "".join(rnd.choices("abcdefghij ", k=QUESTION_BYTES))
                body = {"model": MODEL, "max_tokens": 1, "messages": [
                    {"role": "system", "content": system_prompt}, {"role": "user", "content": question}]}
                async with session.post(url, json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"request {i}: HTTP {resp.status}")
        await asyncio.gather(*(worker() for _ in range(RSS_CONCURRENCY)))


def rss_run(trees: dict[str, str | None]) -> list[dict[str, Any]]:
    rnd = random.Random(1)
    system_prompt = "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz ", k=SYSTEM_PROMPT_BYTES))
    out = []
    with tempfile.TemporaryDirectory(prefix="index-memory-") as tmp:
        workdir = Path(tmp)
        for name, tree in trees.items():
            procs = Processes(workdir)
            try:
                stub = procs.start("stub", [sys.executable, str(BENCH_DIR / "upstream_stub.py"), "--listeners", "1"],
                                   stdout_pipe=True)
                stub_port = json_line(stub)["ports"][0]
                port = free_port()
                config = workdir / f"{name}.yaml"
                config.write_text(json.dumps(gateway_config(stub_port, port)))
                env = {"PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
                gateway = procs.start(name, [sys.executable, "-m", "gateway", "serve", "--config", str(config),
                                             "--log-level", "warning"], env, cwd=Path(tree) if tree else BENCH_DIR.parent)
                wait_ready(port, "/health", procs, name)
                started = time.monotonic()
                asyncio.run(send_requests(port, 0, RSS_WARMUP, system_prompt, rnd))
                warm_kb = rss_kb(gateway.pid)
                asyncio.run(send_requests(port, RSS_WARMUP, RSS_REQUESTS - RSS_WARMUP, system_prompt, rnd))
                end_kb = rss_kb(gateway.pid)
                out.append({"tree": name, "requests": RSS_REQUESTS, "rss_after_warmup_kb": warm_kb,
                            "rss_end_kb": end_kb,
                            "rss_growth_kb_per_request": round((end_kb - warm_kb) / (RSS_REQUESTS - RSS_WARMUP), 2),
                            "wall_s": round(time.monotonic() - started, 1)})
            finally:
                procs.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("index", "rss", "both"), default="both")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=DIR",
                        help="also measure RSS with the gateway of another source tree")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    if args.part in ("index", "both"):
        result["index"] = [asyncio.run(index_case(*case)) for case in INDEX_CASES]
    if args.part in ("rss", "both"):
        trees: dict[str, str | None] = {"this": None}
        trees.update(dict(spec.split("=", 1) for spec in args.compare))
        result["rss"] = rss_run(trees)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for row in result.get("index", []):
        print(f"index: {row['shared_prefix_kb']} KB shared prefix + {row['unique_blocks_per_request']} own block(s) "
              f"x {row['requests']} requests (backend + pool): {row['live_blocks']:,} live blocks, "
              f"{row['traced_bytes_per_live_block']:,.0f} B/live block traced "
              f"({row['growth_bytes_per_added_block']:,.0f} B per added block), "
              f"stats() says {row['stats_bytes_per_live_block']:,.0f}")
    for row in result.get("rss", []):
        print(f"rss [{row['tree']}]: {row['requests']} requests sharing a 64 KB system prompt: "
              f"{row['rss_after_warmup_kb'] / 1024:,.1f} MB after {RSS_WARMUP}, {row['rss_end_kb'] / 1024:,.1f} MB at "
              f"the end: {row['rss_growth_kb_per_request']:.2f} KB per request ({row['wall_s']} s)")


if __name__ == "__main__":
    main()
