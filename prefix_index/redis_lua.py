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
"""

from __future__ import annotations

__all__ = ["BATCH_LUA"]

# KEYS[1]: the model's clock key; KEYS[2..]: blocks keys (one per backend in the batch).
# ARGV: n_records, n_matches, ttl (seconds, for EXPIRE), then per record: key index, total
# capacity, packed hashes (at most total); then per match: nb, nb x (key index, hbm, host),
# packed hashes.
# Returns, flat: per record `existed` (0 when this record created the blocks key, so the
# caller adds the model to the backend's registry set, which lives in another Cluster
# slot); then per match and per backend: matched, hbm, host.
#
# Record: depth d gets score top - d, i.e. base + (n - 1 - d) with base = top - n + 1;
# ZADD goes in batches of 1000 pairs to stay under Lua's unpack() stack limit
# (LUAI_MAXCSTACK = 8000); then trim to the total capacity by rank; then EXPIRE the key
# (a no-op if the trim emptied it) and, once per batch, the clock.
# Match: a line-by-line port of base.match_chain (two searches, each probing the whole
# range, then block 0, then bisecting), with ZREVRANK.
BATCH_LUA = """
local clock = KEYS[1]
local n_records = tonumber(ARGV[1])
local n_matches = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local a = 4
local out = {}
for r = 1, n_records do
  local key = KEYS[tonumber(ARGV[a])]
  local total = tonumber(ARGV[a + 1])
  local packed = ARGV[a + 2]
  a = a + 3
  out[#out + 1] = redis.call('EXISTS', key)
  local n = #packed / 8
  if n > 0 then
    local top = redis.call('INCRBY', clock, n)
    local args = {}
    for d = 0, n - 1 do
      args[#args + 1] = top - d
      args[#args + 1] = string.sub(packed, 8 * d + 1, 8 * d + 8)
      if #args >= 2000 then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
    if #args > 0 then redis.call('ZADD', key, unpack(args)) end
  end
  redis.call('ZREMRANGEBYRANK', key, 0, -(total + 1))
  redis.call('EXPIRE', key, ttl)
end
if n_records > 0 then redis.call('EXPIRE', clock, ttl) end
local key, packed
local function held(m, limit)
  local rank = redis.call('ZREVRANK', key, string.sub(packed, 8 * m - 7, 8 * m))
  return rank and rank < limit
end
local function search(hi, limit)
  if hi == 0 or held(hi, limit) then return hi end
  if not held(1, limit) then return 0 end
  local lo = 1
  hi = hi - 1
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if held(mid, limit) then lo = mid else hi = mid - 1 end
  end
  return lo
end
for m = 1, n_matches do
  local nb = tonumber(ARGV[a])
  packed = ARGV[a + 1 + 3 * nb]
  local n = #packed / 8
  for b = 0, nb - 1 do
    key = KEYS[tonumber(ARGV[a + 1 + 3 * b])]
    local hbm = tonumber(ARGV[a + 2 + 3 * b])
    local total = hbm + tonumber(ARGV[a + 3 + 3 * b])
    local matched, in_hbm = 0, 0
    if redis.call('EXISTS', key) == 1 then
      matched = search(math.min(n, total), total)
      in_hbm = search(math.min(matched, hbm), hbm)
    end
    out[#out + 1] = matched
    out[#out + 1] = in_hbm
    out[#out + 1] = matched - in_hbm
  end
  a = a + 2 + 3 * nb
end
return out
"""
