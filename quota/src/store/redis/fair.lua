-- Helpers shared by the stores' scripts: prepended to lease.lua and slots.lua when they are
-- loaded.
local floor, min, byte = math.floor, math.min, string.byte

-- Byte order, as Rust sorts strings (Lua's `<` follows the server's locale).
local function before(x, y)
  for i = 1, min(#x, #y) do
    local a, b = byte(x, i), byte(y, i)
    if a ~= b then return a < b end
  end
  return #x < #y
end

-- HDEL of any number of fields, in batches: unpack() fails past a few thousand values.
local function hdel_all(key, fields)
  for i = 1, #fields, 512 do
    redis.call('HDEL', key, unpack(fields, i, min(i + 511, #fields)))
  end
end

-- Max-min fair division (core/src/global/fair_share.rs, max_min_fair_from) of `capacity` among the
-- first `n` demands: the allocation of demand `at`. Remainders go to the unsatisfied in order from
-- `at` on (then from the start): to the caller asking now first.
local function max_min_fair(capacity, d, n, at)
  local total = 0
  for i = 1, n do total = total + d[i] end
  if total <= capacity then return d[at] end
  local alloc, open = {}, {}
  for i = 1, n do
    alloc[i] = 0
    if d[i] > 0 then open[#open + 1] = i end
  end
  -- One token each to the first `left` of `list` (sorted), counted from the first at or after `at`.
  local function remainders(list, left)
    local k = 1
    while k <= #list and list[k] < at do k = k + 1 end
    for j = 0, min(left, #list) - 1 do
      local i = list[(k - 1 + j) % #list + 1]
      alloc[i] = alloc[i] + 1
    end
  end
  local left = capacity
  while left > 0 and #open > 0 do
    local share = floor(left / #open)
    if share == 0 then
      remainders(open, left)
      break
    end
    local still = {}
    for _, i in ipairs(open) do
      local take = min(d[i] - alloc[i], share)
      alloc[i] = alloc[i] + take
      left = left - take
      if alloc[i] < d[i] then still[#still + 1] = i end
    end
    if #still == #open then
      remainders(still, left)
      break
    end
    open = still
  end
  return alloc[at]
end
