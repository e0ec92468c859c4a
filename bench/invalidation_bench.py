"""Micro-benchmark: what prefix invalidation adds to a chat request's parse and routing (issue 27, item 7).

For chat bodies of a system prompt and N (user, answer) pairs plus a question (words of ~4 bytes, as in
the chat workload), this times per request, in microseconds (median of repeated runs):

- ``fingerprint``: `prefix_index.message_fingerprint` on the canonical bytes (what `gateway.routing`
  adds to parsing a chat body);
- ``observe``: `prefix_index.InvalidationDetector.observe` of the next turn of a conversation it
  holds, among 8,192 (what the handler adds once the request is routed): append-only, and a sliding
  window that has just dropped a pair;
- for scale, ``canonical + hash``: `chat_canonical_bytes` and `block_hashes`, which every chat body
  already costs.

    python bench/invalidation_bench.py [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import timeit

import hot_path

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from prefix_index import (  # noqa: E402
    BYTES_PER_TOKEN_ESTIMATE,
    DEFAULT_BLOCK_SIZE_TOKENS,
    InvalidationDetector,
    block_hashes,
    block_size_bytes,
    chain_seed,
    chat_canonical_bytes,
    message_fingerprint,
)

PAIRS = (2, 10, 30)
"""Finished (user, answer) pairs per body: a short chat, a typical one (~12 KB), a long one (~35 KB)."""
REPEATS, NUMBER = 7, 2_000
CONVERSATIONS = 8_192


def words(rng: random.Random, n: int) -> str:
    return "".join(" " + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=3)) for _ in range(n))


def chat(rng: random.Random, pairs: int) -> list[dict]:
    out = [{"role": "system", "content": words(rng, 250)}]
    for _ in range(pairs):
        out += [{"role": "user", "content": words(rng, 60)}, {"role": "assistant", "content": words(rng, 180)}]
    return out + [{"role": "user", "content": words(rng, 60)}]


def micros(stmt: object) -> float:
    return statistics.median(timeit.repeat(stmt, repeat=REPEATS, number=NUMBER)) / NUMBER * 1e6


def measure(pairs: int) -> dict[str, float]:
    rng = random.Random(pairs)
    seed = chain_seed("llama-3.1-70b", None)
    block = block_size_bytes(DEFAULT_BLOCK_SIZE_TOKENS, BYTES_PER_TOKEN_ESTIMATE)
    earlier = chat(rng, pairs)
    nxt = earlier + [{"role": "assistant", "content": words(rng, 180)}, {"role": "user", "content": words(rng, 60)}]
    window = [nxt[0], *nxt[3:]]  # the oldest pair dropped
    data = chat_canonical_bytes({"messages": nxt})
    detector = InvalidationDetector()
    for c in range(CONVERSATIONS - 1):
        detector.observe(message_fingerprint(chat_canonical_bytes({"messages": [{"role": "user", "content": f"c{c}"}]}),
                                             seed), bytes_per_token=4.0)
    f_earlier = message_fingerprint(chat_canonical_bytes({"messages": earlier}), seed)
    f_next, f_window = message_fingerprint(data, seed), message_fingerprint(chat_canonical_bytes({"messages": window}), seed)

    def observe(fp: object) -> None:
        detector.observe(f_earlier, bytes_per_token=4.0)  # put the earlier turn back, then time the next one
        detector.observe(fp, bytes_per_token=4.0)

    reset = micros(lambda: detector.observe(f_earlier, bytes_per_token=4.0))
    return {"pairs": pairs, "messages": len(nxt), "body_bytes": len(data),
            "canonical_hash_us": micros(lambda: block_hashes(chat_canonical_bytes({"messages": nxt}),
                                                             block_size_bytes=block, seed=seed)),
            "fingerprint_us": micros(lambda: message_fingerprint(data, seed)),
            "observe_append_us": micros(lambda: observe(f_next)) - reset,
            "observe_window_us": micros(lambda: observe(f_window)) - reset}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    rows = [measure(p) for p in PAIRS]
    if parser.parse_args().json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'messages':>8} {'bytes':>7} {'canonical+hash':>15} {'fingerprint':>12} {'observe append':>15} "
          f"{'observe window':>15}   (µs per request)")
    for r in rows:
        print(f"{r['messages']:>8} {r['body_bytes']:>7} {r['canonical_hash_us']:>15.1f} {r['fingerprint_us']:>12.1f} "
              f"{r['observe_append_us']:>15.1f} {r['observe_window_us']:>15.1f}")


if __name__ == "__main__":
    main()
