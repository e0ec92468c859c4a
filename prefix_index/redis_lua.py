"""The Lua script run server-side by ``redis_index.RedisPrefixIndex``.

One script, ``BATCH_LUA``, runs a batch of records and then a batch of matches, so that
every ``record`` and ``match`` issued in one event-loop turn for one model costs one
EVALSHA together (Redis docs, "Scripting with Lua"; Redis runs Lua 5.1, where numbers
are doubles, exact for the logical clock's integers up to 2**53). Hashes arrive as ARGV
strings of 8-byte big-endian words; block ``d`` (0-based) is
``string.sub(packed, 8*d + 1, 8*d + 8)``. The script touches only keys passed in KEYS,
all with the same model hash tag, so it runs unchanged on Redis Cluster.

Every key a record writes (the blocks key and the model's clock) gets ``EXPIRE ttl`` in
the same script, so the expiry is refreshed by every write and a retired backend's or
model's keys disappear ``ttl`` seconds after their last record (issue 16). The clock is
refreshed with every blocks key of its model, so it never expires before one of them
(a clock that restarted under live blocks would make new records look older than old ones).

What a call costs redis-server is what this script is shaped by (``bench/index_redis_cpu.py``,
BENCHMARKS.md "Redis CPU per request"): a ``redis.call`` with a few arguments is cheap; a
ZADD of a long chain costs most in the command itself and in building and handing over its
arguments from Lua (the ZADD alone, sent by a client, is the floor of a record that must
re-score its chain). Hence:

- **A chain already on top is not re-scored.** If the chain's last block has recency
  rank ``n - 1``, the chain holds ranks ``0 .. n-1`` in depth order: a held block's
  ancestors are all held and outrank it (``base`` module docstring), so the ``n - 1``
  blocks above it are exactly its ancestors, in order. Re-touching would give those
  blocks new scores in the same order, still above every other member, and every later
  record scores above both, so the order of the key's members — hence every rank, match,
  tier and trim — is the same now and after any later calls. The record still advances
  the clock, trims and refreshes the TTLs; only the chain's stored scores keep their
  older values. (This is the case of a chain recorded again on a backend before anything
  else was recorded there, or of a prefix of the last chain recorded there.)
- **Scores go to ZADD as strings** built from a decimal head and a last digit
  (``head .. DIGITS[unit + 1]``): Redis formats a Lua number argument with
  ``snprintf("%.17g")``, Lua's own ``string.format`` costs as much, a concatenation
  less. The scores are the same integers, parsed back exactly.
- **A match probes block 1 first, then the whole range, then bisects**, and skips the
  HBM search when the matched prefix's last block is already within HBM (always, for a
  backend without a host tier). ``base.match_chain`` probes the whole range first; both
  compute the largest ``m`` whose block ``m`` is held below the limit, which the order
  of the probes cannot change since "held below the limit" is monotone in depth. Most
  candidate backends do not hold a request's first block, and this order answers them in
  one probe. No EXISTS per backend: ZREVRANK on a missing key answers "not held" too.
- **A rider can share the call**: a lease-hash exchange (write this replica's hash and renew
  its lease, read the others'; `gateway.replicas.peer_load`) queued by `redis_batch.Coalescer.carry` goes
  at the end of a batch instead of as a command of its own. Its keys have their own hash tag,
  so only a single Redis (not a Cluster) carries one.
- **Match capacities travel packed** (``MATCH_SPEC_FORMAT``: key index, HBM and host
  capacity per backend, read with the ``struct`` library Redis ships), instead of three
  ARGV strings per backend each parsed with ``tonumber``.
"""

from __future__ import annotations

import struct
from functools import lru_cache

__all__ = ["BATCH_LUA", "LUA_UNPACK_CHUNK_VALUES", "MATCH_SPEC_FORMAT", "match_spec_struct"]

# Values one unpack() passes to a command in a script (a ZADD's score/member pairs, an HSET's
# field/value pairs), here and in the replicas' exchange (gateway.replicas.figures): Lua's C
# stack holds at most LUAI_MAXCSTACK = 8000 values (Lua 5.1, Redis's), so 2000 leaves room 4x
# over; even, so that no pair is split.
LUA_UNPACK_CHUNK_VALUES = 2000

# One backend of a match, as ``struct`` packs it on both sides: the blocks key's index in
# KEYS (uint32), then its HBM and host capacity in blocks as doubles (what tonumber() made
# of them before: exact for ints up to 2**53). Big-endian, no padding.
MATCH_SPEC_FORMAT = "Idd"


@lru_cache(maxsize=64)
def match_spec_struct(n_backends: int) -> struct.Struct:
    """The ``struct.Struct`` packing one match's ``n_backends`` (key index, HBM blocks,
    host blocks) triples, flat, for ``BATCH_LUA``: ``n_backends`` × 20 bytes.

    Its ``pack`` raises ``struct.error`` for a key index outside [0, 2**32) (a batch holds
    one blocks key per backend of one model) and ``OverflowError`` for a capacity past a
    double's range; capacities past 2**53 round as ``tonumber`` rounded them before.
    """
    return struct.Struct(">" + MATCH_SPEC_FORMAT * n_backends)


# KEYS[1]: the model's clock key; KEYS[2..]: blocks keys (one per backend in the batch); then,
# with a rider, its own hash and the hashes it reads.
# ARGV: n_records, n_matches, ttl (seconds, for EXPIRE), the rider's own hash's index in KEYS
# (0: no rider), the rider's lease (ms, for PEXPIRE), then per record: key index, total
# capacity, packed hashes (at most total); then per match: its spec (match_spec_struct:
# key index, hbm, host per backend), packed hashes; then the rider's field, value pairs.
# Returns, flat: per record `existed` (0 when this record created the blocks key, so the
# caller adds the model to the backend's registry set, which lives in another Cluster
# slot); then per match and per backend: matched, hbm (host = matched - hbm); then, with a
# rider, one element: the list of the read hashes' HGETALL replies.
#
# Record: depth d gets score top - d, i.e. base + (n - 1 - d) with base = top - n + 1,
# unless the chain already holds ranks 0..n-1 (see the module docstring); ZADD goes in
# batches of LUA_UNPACK_CHUNK_VALUES values (score, member pairs), under unpack()'s stack limit;
# then trim to the total capacity by rank; then EXPIRE the key (a no-op if the trim
# emptied it) and, once per batch, the clock.
# Match: base.match_chain's two searches with ZREVRANK, probing block 1 first (see above).
_SOURCE = """
local clock = KEYS[1]
local n_records = tonumber(ARGV[1])
local n_matches = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local rider = tonumber(ARGV[4])
local DIGITS = {'0', '1', '2', '3', '4', '5', '6', '7', '8', '9'}
local a = 6
local out, o = {}, 0

-- ZADD key top 'block 0' top-1 'block 1' ... with the scores as decimal strings
-- (exact: the clock stays below 2**53, where floor(top / 10) and top % 10 are exact).
local function touch(key, packed, n, top)
  local tens, unit = math.floor(top / 10), top % 10
  local head = tens > 0 and string.format('%d', tens) or ''
  local args, i = {}, 0
  for d = 0, n - 1 do
    args[i + 1] = head .. DIGITS[unit + 1]
    args[i + 2] = string.sub(packed, 8 * d + 1, 8 * d + 8)
    i = i + 2
    if unit == 0 then
      tens, unit = tens - 1, 9
      head = tens > 0 and string.format('%d', tens) or ''
    else
      unit = unit - 1
    end
    if i == UNPACK_CHUNK then
      redis.call('ZADD', key, unpack(args, 1, i))
      i = 0
    end
  end
  if i > 0 then redis.call('ZADD', key, unpack(args, 1, i)) end
end

for r = 1, n_records do
  local key = KEYS[tonumber(ARGV[a])]
  local total = tonumber(ARGV[a + 1])
  local packed = ARGV[a + 2]
  a = a + 3
  local n = #packed / 8
  local existed = 1
  if n > 0 then
    local top = redis.call('INCRBY', clock, n)
    local last = redis.call('ZREVRANK', key, string.sub(packed, -8))
    if last ~= n - 1 then
      if not last then existed = redis.call('EXISTS', key) end
      touch(key, packed, n, top)
    end
  else
    existed = redis.call('EXISTS', key)
  end
  o = o + 1
  out[o] = existed
  redis.call('ZREMRANGEBYRANK', key, 0, -(total + 1))
  redis.call('EXPIRE', key, ttl)
end
if n_records > 0 then redis.call('EXPIRE', clock, ttl) end

local key, packed
local function rank_at(m)
  return redis.call('ZREVRANK', key, string.sub(packed, 8 * m - 7, 8 * m))
end
-- Largest m in [0, hi] whose block m (1-based) is held with rank < limit, and that rank.
local function search(hi, limit)
  if hi == 0 then return 0, false end
  local lo, lo_rank = 1, rank_at(1)
  if not (lo_rank and lo_rank < limit) then return 0, false end
  if hi == 1 then return 1, lo_rank end
  local r = rank_at(hi)
  if r and r < limit then return hi, r end
  hi = hi - 1
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    r = rank_at(mid)
    if r and r < limit then lo, lo_rank = mid, r else hi = mid - 1 end
  end
  return lo, lo_rank
end
for m = 1, n_matches do
  local spec = ARGV[a]
  packed = ARGV[a + 1]
  a = a + 2
  local n = #packed / 8
  local pos, key_id, hbm, host = 1
  for b = 1, #spec / SPEC_BYTES do
    key_id, hbm, host, pos = struct.unpack(SPEC_FORMAT, spec, pos)
    key = KEYS[key_id]
    local total = hbm + host
    local matched, rank = search(math.min(n, total), total)
    local in_hbm = matched
    if matched > 0 and rank >= hbm then
      in_hbm = search(math.min(matched, hbm), hbm)
    end
    out[o + 1] = matched
    out[o + 2] = in_hbm
    o = o + 2
  end
end

-- The rider (a lease-hash exchange): HSET its own hash with the remaining ARGV pairs and renew
-- its lease, then HGETALL each hash after it in KEYS.
if rider > 0 then
  if a <= #ARGV then
    for i = a, #ARGV, UNPACK_CHUNK do
      redis.call('HSET', KEYS[rider], unpack(ARGV, i, math.min(i + UNPACK_CHUNK - 1, #ARGV)))
    end
    redis.call('PEXPIRE', KEYS[rider], ARGV[5])
  end
  local tables = {}
  for k = rider + 1, #KEYS do tables[k - rider] = redis.call('HGETALL', KEYS[k]) end
  out[o + 1] = tables
end
return out
"""
_SPEC_ONE = struct.Struct(">" + MATCH_SPEC_FORMAT)
BATCH_LUA = (_SOURCE.replace("SPEC_FORMAT", repr(_SPEC_ONE.format)).replace("SPEC_BYTES", str(_SPEC_ONE.size))
             .replace("UNPACK_CHUNK", str(LUA_UNPACK_CHUNK_VALUES)))
