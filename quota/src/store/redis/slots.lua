-- All items of one slot-lease call (or, on a Redis Cluster, those of one master or one slot; see
-- lease.lua for how runs are made), atomically: the same step as Holdings::grant in
-- core/src/slot_lease.rs, with the same arithmetic.
-- ARGV: instance, ttl_ms, cold ("0": full, "1": conservative, "2": auto), the number of items,
--   then six per item: the holdings hash (per instance `@<instance>` -> "held:wanted:expires"),
--   the epoch marker of the item's slot (as in lease.lua), concurrent, wanted, keep, known_held
--   (the slots the caller last heard it holds; 0: none).
-- KEYS: as for lease.lua.
-- Returns three numbers per item: held, share, free. (`before` and `max_min_fair`: fair.lua.)
-- Unlike lease.lua, reads and writes interleave: an item served twice with the same arguments
-- (a run that failed on a moved cluster slot, sent again) ends the same, its term renewed.
local floor, min, max = math.floor, math.min, math.max
local byte, sub, match = string.byte, string.sub, string.match
local call, tonumber = redis.call, tonumber

local t = call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
local instance, ttl, cold = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local me = '@' .. instance

local function grant(hkey, mkey, limit, wanted, keep, known_held)
  local e, l = match(call('GET', mkey) or '', '^(%d+)(L?)$')
  local epoch, lost = tonumber(e), l == 'L'
  if epoch == nil then
    epoch, lost = now, false
    call('SET', mkey, now)
  end
  local flat = call('HGETALL', hkey)
  local names, held, wants, expires = {}, {}, {}, {}
  local gone = {}
  for i = 1, #flat, 2 do
    local name = flat[i]
    if byte(name, 1) == 64 then -- '@'
      local h, w, e = match(flat[i + 1], '^(%d+):(%d+):(%d+)$')
      h, w, e = tonumber(h), tonumber(w), tonumber(e)
      -- Expiring more than a term from now: the clock stepped back. A term from now at most
      -- (else a stopped holder's slots stay held for the step's length).
      if e ~= nil and e > now + ttl then
        e = now + ttl
        call('HSET', hkey, name, h .. ':' .. w .. ':' .. e)
      end
      if e ~= nil and e > now then
        names[#names + 1] = name
        held[name], wants[name], expires[name] = h, w, e
      else
        gone[#gone + 1] = name
      end
    end
  end
  hdel_all(hkey, gone)
  local known = expires[me] ~= nil
  -- The caller holds slots this store does not know of: it lost holdings. No new grants for a
  -- term from now (from the epoch, if that is younger).
  if cold ~= '0' and known_held > 0 and not known and not (lost and now - epoch < ttl) then
    epoch, lost = now, true
    call('SET', mkey, now .. 'L')
  end
  -- Settled: the store has held this slot's data for a lease term, or (auto) it lost nothing in
  -- use, or cold starts are full.
  local young = now - epoch < ttl
  local settled = cold == '0' or not young or (cold == '2' and not lost)
  if not known then
    names[#names + 1] = me
    held[me], wants[me] = 0, 0
  end
  table.sort(names, before)
  local others, at = 0, 0
  for i, name in ipairs(names) do
    if name == me then at = i else others = others + held[name] end
  end
  local available = max(limit - others, 0)
  local k
  -- After a loss (not settled), an instance the store does not know keeps what its evidence
  -- says it held; one it knows keeps what it holds (Holdings::grant).
  if known then k = min(keep, held[me]) elseif settled then k = 0 else k = max(keep, known_held) end
  k = min(k, available)
  wants[me] = max(wanted, k)
  local d = {}
  for i, name in ipairs(names) do d[i] = wants[name] end
  local share = max_min_fair(limit, d, #names, at)
  local h
  if settled then
    h = max(k, min(wanted, share, available))
  elseif known then
    h = max(k, min(wanted, held[me], available))
  else
    h = k
  end
  if h == 0 and wanted == 0 then
    call('HDEL', hkey, me)
  else
    call('HSET', hkey, me, h .. ':' .. wants[me] .. ':' .. (now + ttl))
  end
  -- Unused holdings go away with their last holder's term.
  call('PEXPIRE', hkey, 2 * ttl)
  return h, share, max(limit - others - h, 0)
end

local out, n = {}, tonumber(ARGV[4])
for i = 0, n - 1 do
  local a = 5 + i * 6
  local h, share, free = grant(ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]))
  out[#out + 1] = h
  out[#out + 1] = share
  out[#out + 1] = free
end
return out
