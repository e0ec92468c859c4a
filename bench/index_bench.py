"""Benchmark the prefix index's request path: canonicalise+hash, match, record.

For chat prompts of 1k, 8k and 128k tokens (seeded random words, ~4 bytes/token) and 8
backends, each backend pre-populated with a different-length prefix of the prompt, this
measures per request, in microseconds (median and p99):

- canonicalise + hash: ``chat_canonical_bytes`` -> ``chain_seed`` -> ``block_hashes``;
- match: one ``index.match`` over all 8 backends;
- record: one ``index.record`` of the chain on one backend;

for ``MemoryPrefixIndex`` and ``RedisPrefixIndex``. Each request ends with a question
unique to its iteration, so it shares the long prefix but adds a block of its own.

Redis: ``--redis-url``, or a throw-away ``redis-server`` started here on a free loopback
port (``--save "" --appendonly no``), polled with PING and stopped by its pid at the end.

    python bench/index_bench.py [--redis-url redis://127.0.0.1:6379/0] [--json]

``--redis-url`` takes every form the gateway's ``index.redis_url`` does, a Redis Cluster's
``redis+cluster://host:port,...`` included (`prefix_index.redis_connect`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from gateway.commands.processes import free_port, stop_processes
from prefix_index import (
    BYTES_PER_TOKEN_ESTIMATE,
    DEFAULT_BLOCK_SIZE_TOKENS,
    MemoryPrefixIndex,
    PrefixIndex,
    TierCapacity,
    block_hashes,
    block_size_bytes,
    cache_salt,
    chain_seed,
    chat_canonical_bytes,
)
from prefix_index.redis_index import RedisPrefixIndex
from prefix_index.redis_connect import connect

MODEL = "llama-3.1-8b-instruct"
N_BACKENDS = 8
# 10,000 HBM blocks = 640k tokens at 64 tokens/block; host tier 4x that (CPU offload).
CAPACITY = TierCapacity(hbm_blocks=10_000, host_blocks=40_000)
SIZES_TOKENS = (1_024, 8_192, 131_072)
ITERATIONS = {1_024: 200, 8_192: 200, 131_072: 50}
WARMUP_ITERATIONS = 5
REDIS_TIMEOUT_S = 1.0  # generous: the bench measures latency, it does not test deadlines
REDIS_READY_TIMEOUT_S = 10.0
REDIS_POLL_INTERVAL_S = 0.01


def random_text(n_tokens: int, rnd: random.Random) -> str:
    """Lower-case words of 2-6 letters plus a space: ~5 bytes per word, ~4 bytes/token."""
    target = int(n_tokens * BYTES_PER_TOKEN_ESTIMATE)
    words: list[str] = []
    size = 0
    while size < target:
        word = "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 6)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def request(document: str, iteration: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": document + f"\n\nQuestion {iteration}: what is it about?"},
        ],
        "temperature": 0.0,
        "max_tokens": 64,
    }


def percentile(samples_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of nanosecond samples, in microseconds."""
    ordered = sorted(samples_ns)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1_000


async def run_one(index: PrefixIndex, n_tokens: int, iterations: int) -> dict[str, Any]:
    size = block_size_bytes(DEFAULT_BLOCK_SIZE_TOKENS, BYTES_PER_TOKEN_ESTIMATE)
    document = random_text(n_tokens, random.Random(n_tokens))
    backends = [f"10.0.0.{i + 1}:8000" for i in range(N_BACKENDS)]
    capacities = dict.fromkeys(backends, CAPACITY)
    base = request(document, -1)
    chain = block_hashes(chat_canonical_bytes(base), block_size_bytes=size, seed=chain_seed(MODEL, None))
    for i, backend_id in enumerate(backends):  # backend i holds i/8 of the prompt
        if i:
            await index.record(MODEL, backend_id, chain[: len(chain) * i // N_BACKENDS], CAPACITY)
    populated = await index.match(MODEL, chain, capacities)
    assert [m.matched_blocks for m in populated.values()] == [
        len(chain) * i // N_BACKENDS for i in range(N_BACKENDS)
    ], populated
    samples: dict[str, list[int]] = {"hash": [], "match": [], "record": []}
    for it in range(-WARMUP_ITERATIONS, iterations):
        body = request(document, it)
        t0 = time.perf_counter_ns()
        hashes = block_hashes(
            chat_canonical_bytes(body), block_size_bytes=size, seed=chain_seed(MODEL, cache_salt(body))
        )
        t1 = time.perf_counter_ns()
        matches = await index.match(MODEL, hashes, capacities)
        t2 = time.perf_counter_ns()
        await index.record(MODEL, backends[it % N_BACKENDS], hashes, CAPACITY)
        t3 = time.perf_counter_ns()
        if it >= 0:
            samples["hash"].append(t1 - t0)
            samples["match"].append(t2 - t1)
            samples["record"].append(t3 - t2)
    assert len(matches) == N_BACKENDS
    result: dict[str, Any] = {"tokens": n_tokens, "blocks": len(hashes), "iterations": iterations}
    for stage, values in samples.items():
        result[f"{stage}_p50_us"] = statistics.median(values) / 1_000
        result[f"{stage}_p99_us"] = percentile(values, 0.99)
    return result


async def run_all(redis_url: str) -> list[dict[str, Any]]:
    results = []
    for name in ("memory", "redis"):
        for n_tokens in SIZES_TOKENS:
            prefix = f"kappa-bench-{n_tokens}-{time.time_ns()}"
            index: PrefixIndex
            if name == "memory":
                index = MemoryPrefixIndex()
            else:
                index = RedisPrefixIndex.from_url(redis_url, key_prefix=prefix, timeout_s=REDIS_TIMEOUT_S)
            try:
                result = await run_one(index, n_tokens, ITERATIONS[n_tokens])
            finally:
                await index.aclose()
                if name == "redis":
                    await delete_keys(redis_url, prefix)
            results.append({"index": name, **result})
    return results


async def delete_keys(redis_url: str, prefix: str) -> None:
    """Remove this run's keys (blocks, clocks, registry) from the Redis it used."""
    connection = connect(redis_url)  # any redis_url form: a cluster client scans every primary
    try:
        keys = [key async for key in connection.client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await connection.client.delete(*keys)
    finally:
        await connection.aclose()


@contextmanager
def local_redis() -> Iterator[str]:
    """Start ``redis-server`` on a free loopback port without persistence; yield its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it or pass --redis-url")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kappa-bench-redis-") as workdir:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.2)
            deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
            while True:
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"redis-server (pid {proc.pid}) did not answer PING") from None
                    time.sleep(REDIS_POLL_INTERVAL_S)  # poll interval, not a readiness guess
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop_processes([proc], timeout_s=5)


def print_table(results: list[dict[str, Any]], header: str) -> None:
    table = Table(title="prefix index, per request (µs)", caption=header)
    for column in ("tokens", "blocks", "index", "iters"):
        table.add_column(column, justify="right" if column != "index" else "left")
    for stage in ("canon+hash", "match (8 backends)", "record"):
        table.add_column(f"{stage}\np50", justify="right")
        table.add_column("p99", justify="right")
    for r in results:
        table.add_row(
            f"{r['tokens']:,}", f"{r['blocks']:,}", r["index"], str(r["iterations"]),
            *(f"{r[f'{s}_{q}_us']:,.1f}" for s in ("hash", "match", "record") for q in ("p50", "p99")),
        )
    Console(width=140).print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="use this Redis instead of starting a redis-server")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv])
    # With --json, stdout is only the JSON document (which repeats the command).
    print(f"$ {command}", file=sys.stderr if args.json else sys.stdout, flush=True)
    started = time.monotonic()
    if args.redis_url:
        results = asyncio.run(run_all(args.redis_url))
    else:
        with local_redis() as url:
            results = asyncio.run(run_all(url))
    if args.json:
        print(json.dumps({"command": command, "results": results}, indent=2))
    else:
        print_table(results, f"{len(results)} runs in {time.monotonic() - started:.1f} s; "
                    f"{N_BACKENDS} backends, capacity {CAPACITY.hbm_blocks:,}+{CAPACITY.host_blocks:,} blocks")


if __name__ == "__main__":
    main()
