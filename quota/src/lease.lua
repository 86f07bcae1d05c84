-- One lease item, atomically: the same step as GlobalBucket::lease in core/src/lease.rs.
-- KEYS[1]: bucket hash (tokens, updated); KEYS[2]: demands hash (instance -> "wanted:at").
-- ARGV: instance, requests, per_ms, burst, wanted, ttl_ms. Returns {granted, remaining, reset_ms}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local instance = ARGV[1]
local requests, per, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local wanted, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local rate = requests / per

local b = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens, updated = tonumber(b[1]), tonumber(b[2])
if tokens == nil or updated == nil then
  tokens, updated = burst, now
end
local elapsed = math.max(now - updated, 0)
tokens = math.min(burst, tokens + elapsed * rate)
updated = math.max(updated, now)

local names, wants = {}, {}
local d = redis.call('HGETALL', KEYS[2])
for i = 1, #d, 2 do
  local who = d[i]
  local w, at = string.match(d[i + 1], '^(%d+):(%d+)$')
  w, at = tonumber(w), tonumber(at)
  if who ~= instance and w ~= nil and at + ttl > now then
    table.insert(names, who)
    wants[who] = w
  elseif who ~= instance then
    redis.call('HDEL', KEYS[2], who)
  end
end
table.insert(names, instance)
wants[instance] = wanted
table.sort(names)
redis.call('HSET', KEYS[2], instance, string.format('%d:%d', wanted, now))

-- Max-min fair shares of the capacity (core/src/fair_share.rs).
local n = #names
local alloc, open = {}, {}
for i = 1, n do
  alloc[i] = 0
  if wants[names[i]] > 0 then table.insert(open, i) end
end
local left = burst
while left > 0 and #open > 0 do
  local share = math.floor(left / #open)
  if share == 0 then
    for j = 1, math.min(left, #open) do alloc[open[j]] = alloc[open[j]] + 1 end
    break
  end
  local still = {}
  for _, i in ipairs(open) do
    local take = math.min(wants[names[i]] - alloc[i], share)
    alloc[i] = alloc[i] + take
    left = left - take
    if alloc[i] < wants[names[i]] then table.insert(still, i) end
  end
  if #still == #open then
    for j = 1, math.min(left, #still) do
      alloc[still[j]] = alloc[still[j]] + 1
      left = left - 1
    end
    break
  end
  open = still
end
local fair = 0
for i = 1, n do
  if names[i] == instance then fair = alloc[i] end
end

local granted = math.max(math.min(wanted, fair, math.floor(tokens)), 0)
tokens = tokens - granted
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'updated', string.format('%d', updated))
local reset = math.max(math.ceil((burst - tokens) / rate), 0)
-- Gone once it is as good as new: full again and no live demand.
redis.call('PEXPIRE', KEYS[1], reset + ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return {granted, math.floor(tokens), reset}
