"""What replicas exchange through Redis (`gateway.replicas.peer_load`): the script, the figures' format, their sums.

Each replica keeps, per backend of its config, five figures in its hash
``<key_prefix>:{peers}:r:<replica id>`` (field: backend id): in-flight requests, KV demand bytes,
outstanding prefill seconds, decode context tokens and output tokens (`dispatch.Ledger`), written as
one space-separated string (`pack_figures`); a reader takes a replica of an older version's three
figures with the last two at 0. A reader sums
the others' figures per backend (`sum_figures`); a member whose hash is gone (its lease ran out)
is reported so that the reader drops it.

An exchange is one Redis command whatever it carries (``EXCHANGE_LUA``, by EVALSHA: HSET of
the changed fields + PEXPIRE, then HGETALL of each other member; the periodic one adds SADD +
SMEMBERS), because the client's CPU per command, not Redis's, is what the exchange costs
(``bench/overhead.py``'s ``redis-w2``, BENCHMARKS.md). The lease needs the PEXPIRE with
every write: a bare HSET on an expired hash would leave a key without TTL that outlives its
replica. A write of a few fields on a hash that expired while its replica lived (no write
for a whole lease) holds only those fields until the next periodic write (≤ ``sync_interval_s``).
"""

from __future__ import annotations

import os
import secrets
import socket

from dispatch import Target
from prefix_index.redis_lua import LUA_UNPACK_CHUNK_VALUES

HSET_CHUNK_FIELDS = LUA_UNPACK_CHUNK_VALUES // 2  # fields per HSET in the script (a field and its value each)

# KEYS[1]: this replica's hash; KEYS[2]: the members set; KEYS[3..]: the other members' hashes.
# ARGV[1]: the lease, ms; ARGV[2]: this replica's id to renew its membership and return the member
# list, or ''; ARGV[3..]: backend id, packed figures, ... (the fields to write; none for a read).
# Returns {{HGETALL of KEYS[3], HGETALL of KEYS[4], ...}, SMEMBERS of KEYS[2] or {}}.
EXCHANGE_LUA = f"""
if #ARGV > 2 then
  for i = 3, #ARGV, {2 * HSET_CHUNK_FIELDS} do
    redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + {2 * HSET_CHUNK_FIELDS - 1}, #ARGV)))
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
local members = {{}}
if ARGV[2] ~= '' then
  redis.call('SADD', KEYS[2], ARGV[2])
  members = redis.call('SMEMBERS', KEYS[2])
end
local tables = {{}}
for i = 3, #KEYS do tables[i - 2] = redis.call('HGETALL', KEYS[i]) end
return {{tables, members}}
"""


def replica_id() -> str:
    """This process's id among the replicas: host, pid and a random suffix (a restarted pid differs)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


FIGURES = 5  # in flight, KV demand bytes, outstanding prefill s, context tokens, output tokens


def pack_figures(target: Target) -> str:
    """A backend's figures as this replica writes them: in-flight requests, KV demand bytes,
    outstanding prefill seconds, decode context tokens and output tokens, space-separated."""
    ledger = target.ledger
    return (f"{ledger.in_flight} {ledger.kv_demand_bytes:.0f} {ledger.outstanding_prefill_s:.6f} "
            f"{ledger.context_tokens:.0f} {ledger.output_tokens:.0f}")


def text(value: bytes | str) -> str:
    """A Redis reply element as text, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value


def sum_figures(backend_ids: list[str], others: list[str],
                tables: list) -> tuple[dict[str, list[float]], list[str]]:
    """Sum the ``others``' figures per backend.

    Args:
        backend_ids: this replica's backends (figures for any other backend id are ignored).
        others: the members read, in order.
        tables: their HGETALL replies, flat field, value lists, in ``others``' order; empty for
            a member whose hash is gone.

    Returns:
        backend id -> [in-flight requests, KV demand bytes, outstanding prefill seconds, context
        tokens, output tokens] (zeros where no other replica has any; the last two 0 from a
        replica that writes three), and the members whose hash is gone.

    Raises:
        ValueError: ``tables`` does not match ``others``, or a figure is not a number.
    """
    sums: dict[str, list[float]] = {b: [0, 0.0, 0.0, 0.0, 0.0] for b in backend_ids}
    gone = []
    for member, table in zip(others, tables, strict=True):
        if not table:
            gone.append(member)
            continue
        for j in range(0, len(table), 2):  # HGETALL's flat reply: field, value, field, value, ...
            row = sums.get(text(table[j]))
            if row is None:
                continue  # a backend this replica's config does not have
            figures = text(table[j + 1]).split()
            if len(figures) < 3:
                raise ValueError(f"expected at least 3 figures, got {len(figures)}")
            for k in range(min(len(figures), FIGURES)):
                row[k] += float(figures[k])
    return sums, gone
