"""Lua scripts that make each binding write one atomic Redis round trip.

Every script that changes a binding also PUBLISHes its transfer id on the namespace's change
channel, in the same atomic step, so long-polls on any metaserver replica wake up.
Successful scripts return the record as ``{status, spec, state, instance, created, updated,
mark..., event...}``: one slot per ``MarkKind`` (in its order; nil while that mark is absent),
then the events. Marks are fields ``m:<kind>`` of the binding hash, so they share its expiry
and its deletion.
"""

from pdwire.models import MarkKind


def mark_field(kind: MarkKind) -> str:
    """The binding hash's field that holds a mark of this kind."""
    return f"m:{kind.value}"


MARK_FIELDS = [mark_field(kind) for kind in MarkKind]
_HMGET_MARKS = "".join(f", '{f}'" for f in MARK_FIELDS)
_NO_MARKS = "".join(", false" for _ in MARK_FIELDS)
_N = 5 + len(MARK_FIELDS)

# the record of KEYS[1] (hash) and KEYS[2] (events) with a status in front
_RECORD = f"""
local function record(status)
  local h = redis.call('HMGET', KEYS[1], 'spec', 'state', 'inst', 'created', 'updated'
                       {_HMGET_MARKS})
  local out = {{status}}
  for i = 1, {_N} do out[i + 1] = h[i] end
  for _, e in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do out[#out + 1] = e end
  return out
end
"""

# KEYS: binding hash, event list, binding index, decode instance hash
# ARGV: transfer_id, spec, instance_id, kv_host, kv_port, event, now, ttl_ms, channel, prune_before,
#       vetted ('1': the endpoint was checked by the caller, skip the registry), created channel
# A new binding is also published whole on the created channel (redis.py ``_created`` reads it).
PUT_BINDING = (
    _RECORD
    + """
local spec = redis.call('HGET', KEYS[1], 'spec')
if spec then
  if spec ~= ARGV[2] then return {'conflict'} end
  return record('same')
end
if ARGV[11] ~= '1' then
  local inst = redis.call('HMGET', KEYS[4], 'role', 'kvh', 'kvp')
  if not inst[1] then return {'noinst'} end
  if inst[1] == 'prefill' then return {'prefill'} end
  if (not inst[2]) or inst[2] == '' then return {'nokv'} end
  if inst[2] ~= ARGV[4] or inst[3] ~= ARGV[5] then return {'kvmismatch', inst[2], inst[3]} end
end
redis.call('HSET', KEYS[1], 'spec', ARGV[2], 'state', 'bound', 'inst', ARGV[3],
           'created', ARGV[7], 'updated', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[3], ARGV[7], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[10])
redis.call('PUBLISH', ARGV[9], ARGV[1])
redis.call('PUBLISH', ARGV[12], ARGV[1] .. '\\n' .. ARGV[3] .. '\\n' .. ARGV[7] .. '\\n' .. ARGV[6]
           .. '\\n' .. ARGV[2])
return {'created', ARGV[2], 'bound', ARGV[3], ARGV[7], ARGV[7]"""
    + _NO_MARKS
    + """, ARGV[6]}
"""
)

# KEYS: binding hash, event list, latency list, the actor's instance hash
# ARGV: state, event, now, ttl_active_ms, ttl_terminal_ms, channel, transfer_id, max_events,
#       latency_samples, actor, '1' when an engine credential posts it
# Whose step it is, as ``base.owner_problem`` says: {'taken', holder} (409), {'notprefill'} and
# {'notyours'} (403); the lease's taker is kept in the hash's 'holder'.
ADD_EVENT = (
    _RECORD
    + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'created', 'inst', 'holder')
if not cur[1] then return {'notfound'} end
local rank = {bound=0, prefill_started=1, pushing=2, done=3, failed=3, aborted=3}
local c, n = cur[1], ARGV[1]
local cr, nr = rank[c], rank[n]
local actor, holder, engine = ARGV[10], cur[4], ARGV[11] == '1'
if n == 'prefill_started' then
  if (holder and holder ~= actor) or ((not holder) and c ~= 'bound') then
    return {'taken', holder or 'another prefill'}
  end
  if engine then
    local role = redis.call('HGET', KEYS[4], 'role')
    if role ~= 'prefill' and role ~= 'both' then return {'notprefill'} end
  end
elseif engine then
  local mine = actor == holder or ((not holder) and c ~= 'bound')
  local ok = false
  if n == 'pushing' or n == 'done' then ok = mine
  elseif n == 'failed' then ok = mine or actor == cur[3]
  elseif n == 'aborted' then ok = actor == cur[3] end
  if not ok then return {'notyours'} end
end
local verdict = 'apply'
if cr == 3 then
  if n == c then verdict = 'duplicate' else return {'conflict', c} end
elseif n == c then
  if n ~= 'pushing' then verdict = 'duplicate' end
elseif nr < cr then
  return {'conflict', c}
end
if verdict == 'apply' then
  local len = redis.call('LLEN', KEYS[2])
  if len >= tonumber(ARGV[8]) and n == 'pushing' and c == 'pushing' then
    redis.call('LSET', KEYS[2], -1, ARGV[2])
  else
    redis.call('RPUSH', KEYS[2], ARGV[2])
  end
  redis.call('HSET', KEYS[1], 'state', n, 'updated', ARGV[3])
  if n == 'prefill_started' then redis.call('HSET', KEYS[1], 'holder', actor) end
  local ttl = ARGV[4]
  if nr == 3 then ttl = ARGV[5] end
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
  if n == 'done' then
    redis.call('LPUSH', KEYS[3], tostring(tonumber(ARGV[3]) - tonumber(cur[2])))
    redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[9]) - 1)
  end
  redis.call('PUBLISH', ARGV[6], ARGV[7])
end
return record(verdict)
"""
)

# KEYS: binding hash; ARGV: the mark's hash field (m:<kind>), the mark's JSON.
# Returns 1 recorded, 0 already there, -1 no binding. No state, update time, expiry or
# publish, and nothing read back: a mark is an observation, not a change.
ADD_MARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
"""

# KEYS: binding hash, event list
READ_BINDING = (
    _RECORD
    + """
local out = record('ok')
if not out[2] then return {'notfound'} end
return out
"""
)

# KEYS: binding hash, event list, channel-less delete; ARGV: channel, transfer_id
DELETE_BINDING = """
local n = redis.call('DEL', KEYS[1], KEYS[2])
if n > 0 then redis.call('PUBLISH', ARGV[1], ARGV[2]) end
return n
"""

# KEYS: instance hash, instance index, URL index (url -> id), KV index ("host:port" -> id),
#       the owner's instances (a sorted set scored by expiry in ms)
# ARGV: instance_id, spec, role, kv_host, kv_port, now, ttl_ms, expires_at, url, instance hash
#       key prefix, owner ('' : not counted), max_owned (0: no cap), now_ms
# Refused with {'taken', what, holder} when another live instance holds the URL or KV endpoint,
# {'quota', n} when the owner holds max_owned others. A stale index entry (its holder gone or
# moved) is taken over.
PUT_INSTANCE = """
local id = ARGV[1]
local kv = ARGV[4] ~= '' and (ARGV[4] .. ':' .. ARGV[5]) or nil
local function holder(index, key, field)
  local other = redis.call('HGET', index, key)
  if not other or other == id then return nil end
  local h = redis.call('HMGET', ARGV[10] .. other, 'url', 'kvh', 'kvp')
  local theirs = h[1]
  if field == 'kv' then theirs = h[2] and (h[2] .. ':' .. h[3]) end
  if theirs == key then return other end
  return nil
end
local other = holder(KEYS[3], ARGV[9], 'url')
if other then return {'taken', 'url', other} end
if kv then
  other = holder(KEYS[4], kv, 'kv')
  if other then return {'taken', 'kv_endpoint', other} end
end
if ARGV[11] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', ARGV[13])
  local n = redis.call('ZCARD', KEYS[5])
  if tonumber(ARGV[12]) > 0 and not redis.call('ZSCORE', KEYS[5], id)
     and n >= tonumber(ARGV[12]) then
    return {'quota', n}
  end
  redis.call('ZADD', KEYS[5], tonumber(ARGV[13]) + tonumber(ARGV[7]), id)
  if redis.call('PTTL', KEYS[5]) < tonumber(ARGV[7]) then
    redis.call('PEXPIRE', KEYS[5], ARGV[7])
  end
end
local old = redis.call('HMGET', KEYS[1], 'url', 'kvh', 'kvp', 'reg')
if old[1] and old[1] ~= ARGV[9] and redis.call('HGET', KEYS[3], old[1]) == id then
  redis.call('HDEL', KEYS[3], old[1])
end
if old[2] and old[2] ~= '' then
  local was = old[2] .. ':' .. old[3]
  if was ~= kv and redis.call('HGET', KEYS[4], was) == id then redis.call('HDEL', KEYS[4], was) end
end
local reg = old[4]
local status = 'same'
if not reg then reg = ARGV[6]; status = 'created' end
redis.call('HSET', KEYS[1], 'spec', ARGV[2], 'role', ARGV[3], 'kvh', ARGV[4], 'kvp', ARGV[5],
           'reg', reg, 'hb', ARGV[6], 'exp', ARGV[8], 'url', ARGV[9], 'owner', ARGV[11])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[8], id)
redis.call('HSET', KEYS[3], ARGV[9], id)
if kv then redis.call('HSET', KEYS[4], kv, id) end
return {status, reg, redis.call('HGET', KEYS[1], 'drain')}
"""

# KEYS: instance hash, instance index, URL index, KV index; ARGV: instance_id, owner set prefix
# A deregistration also frees its URL, KV endpoint and its place in its owner's count.
DELETE_INSTANCE = """
local h = redis.call('HMGET', KEYS[1], 'url', 'kvh', 'kvp', 'owner')
local n = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if h[1] and redis.call('HGET', KEYS[3], h[1]) == ARGV[1] then redis.call('HDEL', KEYS[3], h[1]) end
if h[2] and h[2] ~= '' then
  local kv = h[2] .. ':' .. h[3]
  if redis.call('HGET', KEYS[4], kv) == ARGV[1] then redis.call('HDEL', KEYS[4], kv) end
end
if h[4] and h[4] ~= '' then redis.call('ZREM', ARGV[2] .. h[4], ARGV[1]) end
return n
"""

# KEYS: instance hash; ARGV: '1' to drain, '' to undrain. Only a live registration is marked
# (a drain never creates a half record); a heartbeat leaves the field alone.
SET_DRAIN = """
if redis.call('HEXISTS', KEYS[1], 'spec') == 0 then return {'notfound'} end
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], 'drain', '1')
else
  redis.call('HDEL', KEYS[1], 'drain')
end
local h = redis.call('HMGET', KEYS[1], 'spec', 'role', 'reg', 'hb', 'exp', 'drain')
return {'ok', h[1], h[2], h[3], h[4], h[5], h[6]}
"""
