"""The Lua scripts of the Redis exact index (`engine_redis`), and the packing of their arguments.

Every script takes the four keys of one (model, backend), all under the model's hash tag, so it
runs on one Redis Cluster slot, atomically (Redis docs, "Scripting with Lua")::

    KEYS[1] meta  HASH  last_seq, last_ts, origin_ts, clean (0|1), block_size, epoch
    KEYS[2] map   HASH  engine hash (8 bytes BE) -> own hash (8 bytes BE)
    KEYS[3] hbm   HASH  own hash -> copies held in HBM (vLLM medium GPU)
    KEYS[4] host  HASH  own hash -> copies held in the host tier (medium CPU)

Sequence numbers and timestamps travel as the strings Python wrote, and `APPLY_LUA` compares
them as strings only (Lua 5.1 numbers are doubles: no precision is lost). `READ_LUA` returns the
position and the parents' own hashes for Python to decide and plan (`engine_index.decide`,
`plan_ops`); `APPLY_LUA` applies the planned operations only if ``epoch`` and ``last_seq`` are
still what was read — otherwise another replica moved first and the caller reads again.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from prefix_index.engine_events import Tier
from prefix_index.engine_index import Clear, Op, Remove, Store

__all__ = ["APPLY_LUA", "CLEAR_LUA", "MATCH_LUA", "OP_BYTES", "READ_LUA", "pack_ops"]

OP_BYTES = 18  # kind (S|R|C), tier (h|c), engine hash, own hash (8 bytes BE each; zeros where unused)
_TIER_CODE = {Tier.HBM: b"h", Tier.HOST: b"c"}

# ARGV: engine hashes (8 bytes BE) whose own hash is wanted.
# -> {last_seq|false, last_ts, origin_ts, clean, block_size, epoch, HLEN map, HLEN hbm, HLEN host, own...}
READ_LUA = """
local m = redis.call('HMGET', KEYS[1], 'last_seq', 'last_ts', 'origin_ts', 'clean', 'block_size', 'epoch')
local out = {m[1], m[2], m[3], m[4], m[5], m[6] or '0',
             redis.call('HLEN', KEYS[2]), redis.call('HLEN', KEYS[3]), redis.call('HLEN', KEYS[4])}
if #ARGV > 0 then
  local owns = redis.call('HMGET', KEYS[2], unpack(ARGV))
  for i = 1, #ARGV do out[9 + i] = owns[i] end
end
return out
"""

# ARGV: epoch read, last_seq read ('' = empty), restart (0|1), seq, ts, lost (0|1), block_size ('' = none),
#       cap, ttl_s, ops (OP_BYTES each).
# -> {'retry'} or {'ok', stored, removed, over_cap, unknown_removed, HLEN map, HLEN hbm, HLEN host, clean,
#     origin_ts, cleared (0|1)}
APPLY_LUA = """
local meta, map = KEYS[1], KEYS[2]
local tiers = {h = KEYS[3], c = KEYS[4]}
local epoch = redis.call('HGET', meta, 'epoch') or '0'
local last = redis.call('HGET', meta, 'last_seq') or ''
if epoch ~= ARGV[1] or last ~= ARGV[2] then return {'retry'} end
if ARGV[3] == '1' then
  redis.call('DEL', map, KEYS[3], KEYS[4])
  redis.call('HDEL', meta, 'last_seq', 'last_ts', 'origin_ts', 'clean', 'block_size')
  redis.call('HSET', meta, 'epoch', tonumber(epoch) + 1)
  last = ''
end
if last == '' then
  redis.call('HSET', meta, 'origin_ts', ARGV[5], 'clean', ARGV[4] == '0' and '1' or '0')
end
if ARGV[6] == '1' then redis.call('HSET', meta, 'clean', '0') end
local cap = tonumber(ARGV[8])
local ops = ARGV[10]
local stored, removed, over, unknown, cleared = 0, 0, 0, 0, 0
for at = 1, #ops, 18 do
  local kind = string.sub(ops, at, at)
  local tier = tiers[string.sub(ops, at + 1, at + 1)]
  local engine = string.sub(ops, at + 2, at + 9)
  if kind == 'S' then
    local own = redis.call('HGET', map, engine)
    if not own then
      if redis.call('HLEN', map) >= cap then
        over = over + 1
        redis.call('HSET', meta, 'clean', '0')
      else
        own = string.sub(ops, at + 10, at + 17)
        redis.call('HSET', map, engine, own)
      end
    end
    if own then
      redis.call('HINCRBY', tier, own, 1)
      stored = stored + 1
    end
  elseif kind == 'R' then
    local own = redis.call('HGET', map, engine)
    local copies = own and tonumber(redis.call('HGET', tier, own) or '0') or 0
    if copies <= 0 then
      unknown = unknown + 1
    else
      if copies > 1 then
        redis.call('HINCRBY', tier, own, -1)
      else
        redis.call('HDEL', tier, own)
        if redis.call('HEXISTS', KEYS[3], own) == 0 and redis.call('HEXISTS', KEYS[4], own) == 0 then
          redis.call('HDEL', map, engine)
        end
      end
      removed = removed + 1
    end
  else
    redis.call('DEL', map, KEYS[3], KEYS[4])
    redis.call('HSET', meta, 'clean', '1')
    cleared = 1
  end
end
redis.call('HSET', meta, 'last_seq', ARGV[4], 'last_ts', ARGV[5])
if ARGV[7] ~= '' then redis.call('HSET', meta, 'block_size', ARGV[7]) end
local ttl = tonumber(ARGV[9])
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ttl) end
return {'ok', stored, removed, over, unknown, redis.call('HLEN', map), redis.call('HLEN', KEYS[3]),
        redis.call('HLEN', KEYS[4]), redis.call('HGET', meta, 'clean'), redis.call('HGET', meta, 'origin_ts'),
        cleared}
"""

# ARGV: origin_before_ts ('' = unconditional). -> 1 if the state was dropped, else 0.
CLEAR_LUA = """
local origin = redis.call('HGET', KEYS[1], 'origin_ts')
if not origin then return 0 end
if ARGV[1] ~= '' and tonumber(origin) >= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HDEL', KEYS[1], 'last_seq', 'last_ts', 'origin_ts', 'clean', 'block_size')
redis.call('HINCRBY', KEYS[1], 'epoch', 1)
return 1
"""

# KEYS: hbm, host of each candidate in turn. ARGV[1]: the chains (packed 8-byte own hashes) joined;
# ARGV[2]: per candidate, its chain's byte offset and length as two u32 BE.
# -> {hbm_blocks, host_blocks} per candidate (engine_index.walk_chain's rule).
MATCH_LUA = """
local chains, spec = ARGV[1], ARGV[2]
local out = {}
for b = 1, #KEYS / 2 do
  local at = (b - 1) * 8 + 1
  local offset = ((string.byte(spec, at) * 256 + string.byte(spec, at + 1)) * 256 + string.byte(spec, at + 2)) * 256
                 + string.byte(spec, at + 3)
  local length = ((string.byte(spec, at + 4) * 256 + string.byte(spec, at + 5)) * 256 + string.byte(spec, at + 6))
                 * 256 + string.byte(spec, at + 7)
  local hk, ck = KEYS[2 * b - 1], KEYS[2 * b]
  local hbm, host, tier = 0, 0, hk
  local i = offset + 1
  while i <= offset + length do
    local own = string.sub(chains, i, i + 7)
    if redis.call('HEXISTS', tier, own) == 1 then
      if tier == hk then hbm = hbm + 1 else host = host + 1 end
      i = i + 8
    elseif tier == hk then
      tier = ck
    else
      break
    end
  end
  out[2 * b - 1] = hbm
  out[2 * b] = host
end
return out
"""


def pack_ops(ops: Sequence[Op]) -> bytes:
    """Operations as `APPLY_LUA` reads them, `OP_BYTES` each."""
    out = bytearray()
    for op in ops:
        if isinstance(op, Store):
            out += b"S" + _TIER_CODE[op.tier] + struct.pack(">QQ", op.engine, op.own)
        elif isinstance(op, Remove):
            out += b"R" + _TIER_CODE[op.tier] + struct.pack(">QQ", op.engine, 0)
        elif isinstance(op, Clear):
            out += b"Ch" + bytes(16)
    return bytes(out)
