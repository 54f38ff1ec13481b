"""Lua scripts of the Redis KV index (``kvindex.redis_index``): a bounded store, the prefix match,
and the lease that elects the one replica following the engines."""

# KEYS: the instance's block set; ARGV: max_blocks, the TTL in ms, then the keys to add. Adds
# what room is left; answers how many it dropped.
STORE = """
local room = tonumber(ARGV[1]) - redis.call('SCARD', KEYS[1])
local n = #ARGV - 2
if room > 0 then
  local last = math.min(n, room) + 2
  redis.call('SADD', KEYS[1], unpack(ARGV, 3, last))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return n - (last - 2)
end
return n
"""

# KEYS: per candidate its block set and its placed set; ARGV: now, '1' to count placements,
# then the prompt's keys, first block first. Answers the leading keys each candidate holds.
MATCH = """
local now, placed = tonumber(ARGV[1]), ARGV[2] == '1'
local out = {}
for i = 1, #KEYS, 2 do
  local n = 0
  for j = 3, #ARGV do
    if redis.call('SISMEMBER', KEYS[i], ARGV[j]) == 0 then
      if not placed then break end
      local until_at = redis.call('ZSCORE', KEYS[i + 1], ARGV[j])
      if (not until_at) or tonumber(until_at) < now then break end
    end
    n = n + 1
  end
  out[#out + 1] = n
end
return out
"""

# KEYS: the lease; ARGV: who asks, the lease in ms. 1 when it holds (took or renewed) the lease.
LEAD = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
