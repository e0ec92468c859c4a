"""redis-server's CPU per record and per match of the Redis prefix index (``redis_lua.BATCH_LUA``).

The workload is `bench/overhead.py`'s at 8k tokens: 16 chat prompts of ~8k tokens (127
blocks) in 4 groups sharing a system prompt of half the length, 8 backends, each with the
capacity the overhead bench's gateway gives its h100-sxm backends for llama-3.1-8b
(7,281 HBM blocks, no host tier). Calls go through ``RedisPrefixIndex`` in groups of
``GROUP`` issued together, so they are coalesced into one EVALSHA as the gateway's are at
concurrency 32. Phases, each measured from redis-server's ``INFO commandstats`` (EVALSHA usec
per call, i.e. the script's time) and from its /proc CPU (everything, protocol parsing and
socket I/O included):

- ``record, moved``: records of a chain that is held but not on top of its backend (the
  prompts of one group recorded in turn on one backend): ZADD moves all 127 blocks;
- ``record, on top``: the same chain recorded twice in a row on one backend;
- ``match``: each prompt matched over the 8 backends, every backend holding one or two
  prompts of each group (full, half and no matches);
- ``zadd floor``: a plain ZADD of 127 held members with new, higher scores from a client,
  the part of a moved record that no script change removes (and ``in place``: the chain
  already on top, where the skip list keeps every node where it is).

Per call figures are per record or per match: the batch's EVALSHA time over the calls it
carried. Run it from another source tree to compare (``PYTHONPATH=DIR``: the tree's
``prefix_index`` is imported; the report names the file).

    python bench/index_redis_cpu.py [--redis-url redis://127.0.0.1:6379/0] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import redis

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

import prefix_index
from index_bench import local_redis
from prefix_index import (
    BYTES_PER_TOKEN_ESTIMATE,
    DEFAULT_BLOCK_SIZE_TOKENS,
    TierCapacity,
    block_hashes,
    block_size_bytes,
    chain_seed,
    chat_canonical_bytes,
)
from prefix_index.redis_index import RedisPrefixIndex

MODEL = "llama-3.1-8b"
N_BACKENDS = 8
PROMPTS, GROUPS, SHARED_PREFIX_RATIO, PROMPT_TOKENS = 16, 4, 0.5, 8_192
# What the overhead bench's gateway passes for each h100-sxm backend serving llama-3.1-8b.
CAPACITY = TierCapacity(hbm_blocks=7_281, host_blocks=0)
GROUP = 4  # calls issued together, coalesced into one EVALSHA (the overhead bench: ~4.5 at c=32)
CALLS_PER_ROUND = 1000
TIMEOUT_S = 2.0  # generous: the bench measures Redis's CPU, not deadlines


def chains() -> list[list[int]]:
    """The 16 prompts' block hashes: prompt i is in group i % 4 and shares its system prompt."""
    rnd = random.Random("index-redis-cpu")
    vocab = ["".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 7))) for _ in range(4096)]

    def text(n_bytes: int) -> str:
        return " ".join(rnd.choices(vocab, k=max(n_bytes * 2 // 11, 1)))

    n_bytes = int(PROMPT_TOKENS * BYTES_PER_TOKEN_ESTIMATE)
    shared = [text(int(n_bytes * SHARED_PREFIX_RATIO)) for _ in range(GROUPS)]
    size = block_size_bytes(DEFAULT_BLOCK_SIZE_TOKENS, BYTES_PER_TOKEN_ESTIMATE)
    out = []
    for i in range(PROMPTS):
        body = {"model": MODEL, "messages": [{"role": "system", "content": shared[i % GROUPS]},
                                             {"role": "user", "content": text(int(n_bytes * (1 - SHARED_PREFIX_RATIO)))}]}
        out.append(block_hashes(chat_canonical_bytes(body), block_size_bytes=size, seed=chain_seed(MODEL, None)))
    return out


class Server:
    """redis-server's counters: EVALSHA (or another command's) usec and calls, and its CPU."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pid = int(self.client.info("server")["process_id"])

    def sample(self, command: str = "evalsha") -> tuple[int, int, float]:
        stat = self.client.info("commandstats").get(f"cmdstat_{command}", {"usec": 0, "calls": 0})
        return stat["usec"], stat["calls"], self.cpu_s()

    def cpu_s(self) -> float:
        """CPU seconds redis-server's threads have run (/proc/<pid>/task/*/schedstat, in ns: finer
        than /proc/<pid>/stat's 10 ms ticks; the server must be on this machine)."""
        total_ns = 0
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                total_ns += int((task / "schedstat").read_text().split()[0])
            except OSError:  # a thread that ended meanwhile
                pass
        return total_ns / 1e9


async def measure(server: Server, calls: list[Any], per_call: int, command: str = "evalsha") -> dict[str, float]:
    """Run ``calls`` (coroutine factories) in groups of GROUP; µs per call of the script and of the process."""
    usec0, n0, cpu0 = server.sample(command)
    for start in range(0, len(calls), GROUP):
        await asyncio.gather(*(call() for call in calls[start:start + GROUP]))
    usec1, n1, cpu1 = server.sample(command)
    n = len(calls) * per_call
    return {"script_us": (usec1 - usec0) / n, "process_us": (cpu1 - cpu0) * 1e6 / n, "evalsha_calls": n1 - n0}


async def run(url: str, rounds: int) -> dict[str, Any]:
    server = Server(url)
    prefix = f"kappa-cpu-{time.time_ns()}"
    index = RedisPrefixIndex.from_url(url, key_prefix=prefix, timeout_s=TIMEOUT_S)
    hashes = chains()
    backends = [f"b{i}" for i in range(N_BACKENDS)]
    capacities = dict.fromkeys(backends, CAPACITY)
    results: dict[str, list[dict[str, float]]] = {"record, moved": [], "record, on top": [], "match": []}
    try:
        # Backend b holds prompts b + 8 and b (on top): each prompt whole on one backend, and each
        # group's shared half on two.
        for i in [*range(N_BACKENDS, PROMPTS), *range(N_BACKENDS)]:
            await index.record(MODEL, backends[i % N_BACKENDS], hashes[i], CAPACITY)
        for _ in range(rounds):
            # Backend b records prompts b + 8 and b in turn (one group: each chain's own half lies
            # below the other's), so that every call moves its chain.
            moved = [lambda i=i: index.record(MODEL, backends[(i // 2) % N_BACKENDS],
                                              hashes[(1 - i % 2) * N_BACKENDS + (i // 2) % N_BACKENDS], CAPACITY)
                     for i in range(CALLS_PER_ROUND)]
            # GROUP records of one backend's last chain in a row, then the next backend's: all on top.
            on_top = [lambda i=i: index.record(MODEL, backends[(i // GROUP) % N_BACKENDS],
                                               hashes[(i // GROUP) % N_BACKENDS], CAPACITY)
                      for i in range(CALLS_PER_ROUND)]
            matches = [lambda i=i: index.match(MODEL, hashes[i % PROMPTS], capacities) for i in range(CALLS_PER_ROUND)]
            for name, calls in (("record, moved", moved), ("match", matches)):
                results[name].append(await measure(server, calls, 1))
            results["record, on top"].append(await measure(server, on_top, 1))
        floor = zadd_floor(server, f"{prefix}:floor", hashes, rounds)
    finally:
        await index.aclose()
        keys = list(server.client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            server.client.delete(*keys)
    out: dict[str, Any] = {"prefix_index": str(Path(prefix_index.__file__).resolve().parent), "group": GROUP,
                           "rounds": rounds, "calls_per_round": CALLS_PER_ROUND, "blocks": len(hashes[0])}
    for name, runs in results.items():
        out[name] = {key: statistics.median(r[key] for r in runs) for key in ("script_us", "process_us")}
        out[name]["calls_per_evalsha"] = CALLS_PER_ROUND / statistics.median(r["evalsha_calls"] for r in runs)
    out.update(floor)
    return out


def zadd_floor(server: Server, key: str, hashes: list[list[int]], rounds: int) -> dict[str, Any]:
    """A plain ZADD (redis-py, one command) of a chain's members with new higher scores, on a
    sorted set holding all 16 chains: ``moved`` alternates two chains of one group, ``in place``
    repeats one."""
    client, top = server.client, 0
    members = [[struct.pack(">Q", h) for h in chain] for chain in hashes]

    def zadd(chain: list[bytes]) -> None:
        nonlocal top
        top += len(chain)
        client.zadd(key, {m: top - d for d, m in enumerate(chain)})

    for chain in members:
        zadd(chain)
    out = {}
    for name, pick in (("zadd floor, moved", lambda i: members[(i % 2) * 8]), ("zadd floor, in place", lambda i: members[0])):
        runs = []
        for _ in range(rounds):
            usec0, n0, _ = server.sample("zadd")
            for i in range(CALLS_PER_ROUND):
                zadd(pick(i))
            usec1, n1, _ = server.sample("zadd")
            runs.append((usec1 - usec0) / (n1 - n0))
        out[name] = {"command_us": statistics.median(runs)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="use this Redis (on this machine: its CPU is read from /proc)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each phase; medians are reported")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.redis_url:
        result = asyncio.run(run(args.redis_url, args.rounds))
    else:
        with local_redis() as url:
            result = asyncio.run(run(url, args.rounds))
    result["command"] = " ".join([sys.executable, *sys.argv])
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"prefix_index from {result['prefix_index']}; {result['blocks']} blocks a chain, {N_BACKENDS} backends, "
          f"calls issued {GROUP} at a time, {args.rounds} rounds of {CALLS_PER_ROUND}; medians")
    print(f"{'':20} {'script µs/call':>14} {'redis CPU µs/call':>18} {'calls/EVALSHA':>14}")
    for name in ("record, moved", "record, on top", "match"):
        r = result[name]
        print(f"{name:20} {r['script_us']:14.1f} {r['process_us']:18.1f} {r['calls_per_evalsha']:14.1f}")
    for name in ("zadd floor, moved", "zadd floor, in place"):
        print(f"{name:20} {result[name]['command_us']:14.1f}   (the ZADD command alone, from a client)")


if __name__ == "__main__":
    main()
