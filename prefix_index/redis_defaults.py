"""The Redis index's defaults, in a module that imports nothing (not redis).

`redis_index.RedisPrefixIndex` takes them as its keyword defaults and the fleet config
(`fleet_config.sections.IndexSection`) as its own, so a default means the same whoever builds
the index; the config, the simulator and the mock read them without loading the Redis client.
"""

from __future__ import annotations

__all__ = ["DEFAULT_ADMIN_TIMEOUT_S", "DEFAULT_KEY_PREFIX", "DEFAULT_KEY_TTL_S", "DEFAULT_TIMEOUT_S"]

# First segment of every index key (and of the replicas' load-exchange keys on the same Redis).
DEFAULT_KEY_PREFIX = "kappa"
# Request-path budget per call: a same-zone Redis answers a match for 8 backends in
# ~0.1-0.5 ms (bench/index_bench.py), so 50 ms is ~100x headroom yet small next to the
# hundreds of ms of a long prefill; past it the router proceeds without prefix hints.
DEFAULT_TIMEOUT_S = 0.05
# forget and stats run off the request path and may touch every key of a backend.
DEFAULT_ADMIN_TIMEOUT_S = 5.0
# Index keys expire this long after their last record: a day, so a retired backend's or
# model's entries go while a backend idle overnight (whose KV cache vLLM has long since
# reused) loses nothing it still holds.
DEFAULT_KEY_TTL_S = 24 * 3600
