"""Lua scripts run server-side by ``redis_index.RedisPrefixIndex``.

This module owns the two scripts that make ``match`` and ``record`` one round trip each
(Redis docs, "Scripting with Lua"; Redis runs Lua 5.1, where numbers are doubles, exact
for the logical clock's integers up to 2**53). Hashes arrive as one ARGV string of 8-byte
big-endian words; block ``d`` (0-based) is ``string.sub(packed, 8*d + 1, 8*d + 8)``.
Both scripts touch only keys passed in KEYS, all with the same model hash tag, so they
run unchanged on Redis Cluster.
"""

from __future__ import annotations

__all__ = ["MATCH_LUA", "RECORD_LUA"]

# KEYS: one blocks key per backend. ARGV: hbm_1, host_1, ..., hbm_B, host_B, packed hashes.
# Returns matched, hbm, host per backend. Port of base.match_chain.
MATCH_LUA = """
local nb = #KEYS
local packed = ARGV[2 * nb + 1]
local n = #packed / 8
local key
local function search(hi, limit)
  local lo = 0
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local rank = redis.call('ZREVRANK', key, string.sub(packed, 8 * mid - 7, 8 * mid))
    if rank and rank < limit then lo = mid else hi = mid - 1 end
  end
  return lo
end
local out = {}
for b = 1, nb do
  key = KEYS[b]
  local hbm = tonumber(ARGV[2 * b - 1])
  local total = hbm + tonumber(ARGV[2 * b])
  local matched, in_hbm = 0, 0
  if redis.call('EXISTS', key) == 1 then
    matched = search(math.min(n, total), total)
    in_hbm = search(math.min(matched, hbm), hbm)
  end
  out[3 * b - 2] = matched
  out[3 * b - 1] = in_hbm
  out[3 * b] = matched - in_hbm
end
return out
"""

# KEYS: blocks key, clock key. ARGV: total capacity, packed hashes (at most total).
# Depth d gets score top - d, i.e. base + (n - 1 - d) with base = top - n + 1. ZADD goes in
# batches of 1000 pairs to stay under Lua's unpack() stack limit (LUAI_MAXCSTACK = 8000).
# Returns {n, existed}: existed = 0 when this call created the blocks key (the caller then
# adds the model to the backend's registry set, which lives in another Cluster slot).
RECORD_LUA = """
local existed = redis.call('EXISTS', KEYS[1])
local packed = ARGV[2]
local n = #packed / 8
if n > 0 then
  local top = redis.call('INCRBY', KEYS[2], n)
  local args = {}
  for d = 0, n - 1 do
    args[#args + 1] = top - d
    args[#args + 1] = string.sub(packed, 8 * d + 1, 8 * d + 8)
    if #args >= 2000 then
      redis.call('ZADD', KEYS[1], unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', KEYS[1], unpack(args)) end
end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[1]) + 1))
return {n, existed}
"""
