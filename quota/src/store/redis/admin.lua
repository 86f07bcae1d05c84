-- The admin API's look at one bucket, and its reset (GlobalBucket::reset), atomically.
-- KEYS: the bucket's key, its slot's epoch marker. ARGV[1]: "get" or "reset".
-- A reset sets the bucket's tokens (in millionths) above any burst: its next lease run refills
-- it, which caps them at the burst (and so forgives a debt); holders and expiry are kept.
-- Returns: the key's type ("string", "hash" — written by a service of before — or "none"), its
-- value (the string, or the hash's fields and values; "" for none), the marker ("" for none),
-- and the key's time to live (ms; below zero: none).
local RESET = 1e21
local key, reset = KEYS[1], ARGV[1] == 'reset'
local kind = redis.call('TYPE', key).ok
local value = ''
if kind == 'string' then
  value = redis.call('GET', key)
  if reset and #value >= 24 then
    value = struct.pack('<d', RESET) .. string.sub(value, 9)
    redis.call('SET', key, value, 'KEEPTTL')
  end
elseif kind == 'hash' then
  if reset then redis.call('HSET', key, 'tokens', string.format('%.0f', RESET)) end
  value = redis.call('HGETALL', key)
end
return {kind, value, redis.call('GET', KEYS[2]) or '', redis.call('PTTL', key)}
