"""The Lua scripts RedisStore runs (adapters/redis_store.py has the keys they touch): each one reads
and writes its keys atomically, so concurrent requests in any number of processes see one order.
Limits of -1 are none."""

# Sums live reservations (dropping expired ones) and checks every window; KEYS: held zset,
# day hash, month hash. ARGV: now, expiry, member, tokens, cost, then (token, cost) limits of
# day and month, -1 for none, then a flag: 1 to reserve, 0 only to report the headroom.
HEADROOM_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held_tok, held_cost = 0, 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local _, t, c = string.match(m, '^([^|]*)|([^|]*)|([^|]*)$')
  held_tok = held_tok + tonumber(t)
  held_cost = held_cost + tonumber(c)
end
local room_tok, room_cost = nil, nil
for i = 2, 3 do
  local used = redis.call('HMGET', KEYS[i], 'prompt_tokens', 'completion_tokens', 'cost_micro')
  local tok_lim, cost_lim = tonumber(ARGV[4 + 2 * i - 2]), tonumber(ARGV[5 + 2 * i - 2])
  if tok_lim >= 0 then
    local r = tok_lim - (tonumber(used[1] or 0) + tonumber(used[2] or 0)) - held_tok
    if room_tok == nil or r < room_tok then room_tok = r end
  end
  if cost_lim >= 0 then
    local r = cost_lim - tonumber(used[3] or 0) - held_cost
    if room_cost == nil or r < room_cost then room_cost = r end
  end
end
if ARGV[10] == '1' then
  local tok, cost = tonumber(ARGV[4]), tonumber(ARGV[5])
  if (room_tok ~= nil and tok > room_tok) or (room_cost ~= nil and cost > room_cost) then
    return {0, room_tok or 0, room_cost or 0}
  end
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[1], math.floor((tonumber(ARGV[2]) - tonumber(ARGV[1])) * 1000) + 1000)
end
return {1, room_tok or 0, room_cost or 0}
"""

# Rate limits in one step. KEYS: this minute's hash (requests, tokens), in-flight zset. ARGV: now,
# slot expiry, request id, requests/min, tokens/min, max parallel (-1: none), tokens asked.
# Returns 1 (admitted), 0 (a per-minute limit) or -1 (no parallel slot); refusals count nothing.
ADMIT_LUA = """
local used = redis.call('HMGET', KEYS[1], 'requests', 'tokens')
local requests, tokens = tonumber(used[1] or 0), tonumber(used[2] or 0)
local rpm, tpm, parallel, asked = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if (rpm >= 0 and requests + 1 > rpm) or (tpm >= 0 and tokens + asked > tpm) then return 0 end
if parallel >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
  if redis.call('ZCARD', KEYS[2]) >= parallel then return -1 end
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], math.floor((tonumber(ARGV[2]) - tonumber(ARGV[1])) * 1000))
end
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', asked)
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""

# Tokens per minute, once a request's prompt is tokenized. KEYS: this minute's hash. ARGV: tokens,
# limit. Returns 1 (counted) or 0 (refused, nothing counted).
ADMIT_TOKENS_LUA = """
local used = tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0)
if used + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[1])
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""

# Exactly-once settlement. KEYS: settled marker, held zset, day hash, month hash. ARGV: member,
# prompt tokens, completion tokens, cost, day ttl, month ttl, marker ttl, cached tokens, compute ms.
# Returns 1 if it billed.
SETTLE_LUA = """
redis.call('ZREM', KEYS[2], ARGV[1])
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[7]) then return 0 end
for i = 3, 4 do
  redis.call('HINCRBY', KEYS[i], 'prompt_tokens', ARGV[2])
  redis.call('HINCRBY', KEYS[i], 'completion_tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[i], 'cost_micro', ARGV[4])
  redis.call('HINCRBY', KEYS[i], 'cached_tokens', ARGV[8])
  redis.call('HINCRBY', KEYS[i], 'compute_ms', ARGV[9])
  redis.call('EXPIRE', KEYS[i], ARGV[i + 2])
end
return 1
"""

# Bounded cache write. KEYS: entry, index zset. ARGV: value, ttl s, now, max entries.
CACHE_PUT_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[3]) - tonumber(ARGV[2]))
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if extra > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[2], extra)
  for i = 1, #popped, 2 do redis.call('DEL', popped[i]) end
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""

# A stored response, within the tenant's quota. KEYS: response, ids zset, sizes hash. ARGV: id,
# value, ttl s, now, most responses, most bytes. Returns 1 if written, 0 if it would pass the quota.
RESPONSE_PUT_LUA = """
local now, ttl, size = tonumber(ARGV[4]), tonumber(ARGV[3]), string.len(ARGV[2])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HINCRBY', KEYS[3], '', -tonumber(redis.call('HGET', KEYS[3], id) or 0))
  redis.call('HDEL', KEYS[3], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = tonumber(redis.call('HGET', KEYS[3], '') or 0)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) or held + size > tonumber(ARGV[6]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], size)
redis.call('HINCRBY', KEYS[3], '', size)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return 1
"""

# Forget a stored response and its share of the quota. KEYS: as RESPONSE_PUT_LUA. ARGV: id.
RESPONSE_DELETE_LUA = """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], '', -tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or 0))
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# Lease the best free slot of one server (store.slot_rank, the same order). KEYS: the server's
# slots hash (field: slot number, value: JSON state). ARGV: count, scope, key, now, ttl s, lease id.
# ARGV[7..9]: long (1/0), slots a long lease leaves free, long leases a scope may hold
# (store.long_lease_limits). Returns {slot, previous scope} or nil when no slot may be had.
SLOT_LEASE_LUA = """
local best, best_rank, best_used, before = -1, -1, 0, ''
local now, free, held_long = tonumber(ARGV[4]), 0, 0
for i = 0, tonumber(ARGV[1]) - 1 do
  local raw = redis.call('HGET', KEYS[1], i)
  local state = raw and cjson.decode(raw) or {}
  if (state.b or 0) > now and state.t == 1 and state.s == ARGV[2] then held_long = held_long + 1 end
  if (state.b or 0) <= now then
    free = free + 1
    local rank = 0
    if state.s == ARGV[2] then
      rank = (state.k == ARGV[3]) and 3 or 2
    elseif (state.s or '') == '' then
      rank = 1
    end
    local used = state.u or 0
    if rank > best_rank or (rank == best_rank and used < best_used) then
      best, best_rank, best_used, before = i, rank, used, state.s or ''
    end
  end
end
if best < 0 then return nil end
if ARGV[7] == '1' and (free <= tonumber(ARGV[8]) or held_long >= tonumber(ARGV[9])) then return nil end
local state = {s = ARGV[2], k = ARGV[3], u = now, b = now + tonumber(ARGV[5]), l = ARGV[6], t = tonumber(ARGV[7])}
redis.call('HSET', KEYS[1], best, cjson.encode(state))
redis.call('EXPIRE', KEYS[1], 86400)
return {best, before}
"""

# Free a slot if this lease still holds it. KEYS: the slots hash. ARGV: slot (-1: whichever this
# lease holds), lease id, erased (1/0).
SLOT_RELEASE_LUA = """
local fields = {ARGV[1]}
if ARGV[1] == '-1' then fields = redis.call('HKEYS', KEYS[1]) end
for _, field in ipairs(fields) do
  local raw = redis.call('HGET', KEYS[1], field)
  local state = raw and cjson.decode(raw)
  if state and state.l == ARGV[2] then
    state.b = 0
    if ARGV[3] == '0' then state.s = '?' end
    redis.call('HSET', KEYS[1], field, cjson.encode(state))
    return 1
  end
end
return 0
"""

# One shadow sample into a knob's pooled window. KEYS: the knob's hash. ARGV: agreed (0/1), window
# size. Returns {samples, agreed} to the one call that fills the window (and empties it), else nil.
KNOB_WINDOW_LUA = """
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
local a = redis.call('HINCRBY', KEYS[1], 'a', ARGV[1])
if n < tonumber(ARGV[2]) then return nil end
redis.call('HSET', KEYS[1], 'n', 0, 'a', 0)
return {n, a}
"""

# Move a knob within its bounds. KEYS: the knob's hash. ARGV: initial, delta, floor, ceiling.
# Returns {before, after} as strings (a Lua number would come back truncated to an integer).
KNOB_MOVE_LUA = """
local before = tonumber(redis.call('HGET', KEYS[1], 'value') or ARGV[1])
local after = math.min(tonumber(ARGV[4]), math.max(tonumber(ARGV[3]), before + tonumber(ARGV[2])))
redis.call('HSET', KEYS[1], 'value', string.format('%.17g', after))
if after ~= before then redis.call('HINCRBY', KEYS[1], 'moves', 1) end
return {string.format('%.17g', before), string.format('%.17g', after)}
"""

# Change the tenant directory in one step. KEYS: tenants hash, keys hash, version, audit list.
# ARGV: the audit entry, the audit log's length, then per write four: table (1 tenants, 2 keys),
# field, expected ('*' anything, '-' nothing, '=' .. the record), value ('-' delete, '=' .. the
# record). Every expectation is checked before anything is written: 0 if one fails, else the new version.
DIRECTORY_WRITE_LUA = """
local writes = (#ARGV - 2) / 4
for i = 0, writes - 1 do
  local hash, field, expected = KEYS[tonumber(ARGV[3 + 4 * i])], ARGV[4 + 4 * i], ARGV[5 + 4 * i]
  local held = redis.call('HGET', hash, field)
  if expected == '-' then
    if held then return 0 end
  elseif expected ~= '*' then
    if held ~= string.sub(expected, 2) then return 0 end
  end
end
for i = 0, writes - 1 do
  local hash, field, value = KEYS[tonumber(ARGV[3 + 4 * i])], ARGV[4 + 4 * i], ARGV[6 + 4 * i]
  if value == '-' then
    redis.call('HDEL', hash, field)
  else
    redis.call('HSET', hash, field, string.sub(value, 2))
  end
end
redis.call('LPUSH', KEYS[4], ARGV[1])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[2]) - 1)
return redis.call('INCR', KEYS[3])
"""

# One learning example. KEYS: the examples list, its counts hash. ARGV: the example, the tenant, the
# tenant's share (-1: none), how many to keep. 0: refused (the tenant has its share), 1: kept.
EXAMPLES_ADD_LUA = """
local total = tonumber(redis.call('HGET', KEYS[2], 'total') or '0')
local share = tonumber(ARGV[3])
if share >= 0 then
  local mine = tonumber(redis.call('HGET', KEYS[2], 't:' .. ARGV[2]) or '0')
  if mine >= math.ceil(share * (total + 1)) then return 0 end
end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[4]), -1)
redis.call('HINCRBY', KEYS[2], 'total', 1)
redis.call('HINCRBY', KEYS[2], 't:' .. ARGV[2], 1)
return 1
"""

# Compare and set a learned check. KEYS: its key. ARGV: the value expected ('' none), the new value.
LEARNED_SWAP_LUA = """
local held = redis.call('GET', KEYS[1])
if (held or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
