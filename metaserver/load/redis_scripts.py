"""Lua scripts of the Redis load board: ``<ns>:load:<replica>`` holds a replica's report with
Redis's own expiry, ``<ns>:loads`` the replicas that reported."""

# KEYS: the replica's report, the set of replicas; ARGV: its JSON, its ttl in ms, the key prefix
# of reports. One round trip: store the report, read every live one, forget the lapsed.
REPORT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], KEYS[1]:sub(#ARGV[3] + 1))
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local raw = redis.call('GET', ARGV[3] .. name)
  if raw then
    out[#out + 1] = name
    out[#out + 1] = raw
  else
    redis.call('SREM', KEYS[2], name)
  end
end
return out
"""

# KEYS: the set of replicas; ARGV: the key prefix of reports. Reads only: with
# ``appendfsync always`` a write waits for the disk, a read does not.
VIEW = """
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local raw = redis.call('GET', ARGV[1] .. name)
  if raw then
    out[#out + 1] = name
    out[#out + 1] = raw
  end
end
return out
"""
