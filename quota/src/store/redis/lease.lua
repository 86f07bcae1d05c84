-- All items of one lease call (or, on a Redis Cluster, those whose keys share one slot),
-- atomically: the same step as GlobalBucket::new, reconcile and lease in
-- core/src/global/lease/bucket/, with the same arithmetic in the same order, so both stores
-- grant alike.
-- ARGV: ttl_ms, cold ("0": full, "1": conservative, "2": auto), the number of items, when the
--   run was sent in this Redis's clock (ms; 0: not known), then four per item: the bucket's key, the epoch marker of the item's slot, 14 numbers as little-endian doubles (one string, read
--   with struct.unpack: cheaper than 14 arguments): requests, per_ms, burst, wanted, demand
--   (milli-tokens per second), known_ms, known_remaining, known_debt (the caller's evidence of
--   the bucket; 0: none), returned, owed (what it spent beyond its grants: charged now), held
--   (what it holds unspent: taken back while the bucket owes), share (milli-tokens per second)
--   and share_ms (the caller's evidence of its own reservation), period_end (a calendar quota's
--   period's end, ms: no refill, full again then; 0: none), and the calling instance (items of
--   several calls may run together).
-- A bucket is one string, set with its expiry: three little-endian doubles, `tokens` in
--   millionths (below zero in debt), `reserve` (the tokens kept for instances within their fair
--   share) in millionths and `updated`; then per holder, sorted by name (bytewise), its name's
--   length (2 bytes), its name (the empty name: the holders of before a loss) and six doubles:
--   wanted, demand, asked, share, until, outstanding. (A bucket written by a service of before is
--   a hash, `tokens`, `reserve`, `updated` and `@<instance>` -> "w:d:a:s:u:o": read, and written
--   back as a string.)
-- The marker holds the slot's epoch (ms), with an "L" once a call showed that the slot lost
--   buckets in use: then (cold "2") buckets it does not know start as with cold "1".
-- KEYS: the same key names, declared (one Redis, or one slot of a cluster); none when the
--   script runs all of a cluster master's items (its keys span slots: allow-cross-slot-keys).
-- Returns eight numbers per item: granted, remaining, reset_ms, share (milli-tokens per
--   second), retry_ms, returned (what of the item's `returned` the bucket took back), debt (what
--   the bucket owes), revoked (what of the item's `held` it took back).
-- Written for speed (Redis's Lua makes every table, string and command costly): holders live in
-- parallel arrays reused from item to item; a bucket is read with one command and written with
-- one (the value and its expiry).
local floor, ceil, min, max, huge = math.floor, math.ceil, math.min, math.max, math.huge
local byte, sub, match, find, format = string.byte, string.sub, string.match, string.find,
  string.format
local call, tonumber = redis.call, tonumber
local pack, unpack_numbers, concat = struct.pack, struct.unpack, table.concat
-- A bucket's head, and one holder (see above).
local HEAD, HOLDER = '<ddd', '<I2c0dddddd'

local t = call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
local ttl, cold = tonumber(ARGV[1]), ARGV[2]
-- The instance of the item being served.
local instance
local checks = cold ~= '0'
-- The most tokens a bucket owes (MAX_DEBT).
local max_debt = 1000000000000
-- A capped holder's renewal reaches the service this long after it is due (RENEWAL_MARGIN_MS).
local renewal_margin = 20
-- A call and its answer on top of the age of a caller's evidence (EVIDENCE_TRANSIT_MS).
local evidence_transit_ms = 250

-- A slot's marker: its epoch, and whether it lost buckets in use.
local function read_marker(v)
  if not v then return nil, false end
  local e, l = match(v, '^(%d+)(L?)$')
  return tonumber(e), l == 'L'
end

-- Holders of the current item: name, wanted, demand, asked, share, until, outstanding; n of them.
local N, W, D, A, S, U, O = {}, {}, {}, {}, {}, {}, {}
local wants, demands = {}, {}

local out = {}
-- Holders of the item being served.
local n = 0

-- The holders of before a loss (the empty name, first), holding the whole rate for a TTL.
local function hold_for_before(rate_mtps)
  if n == 0 or N[1] ~= '' then
    for i = n, 1, -1 do
      N[i + 1], W[i + 1], D[i + 1], A[i + 1], S[i + 1], U[i + 1] = N[i], W[i], D[i], A[i], S[i], U[i]
      O[i + 1] = O[i]
    end
    n = n + 1
  end
  N[1], W[1], D[1], A[1], S[1], U[1], O[1] = '', 0, 0, now, rate_mtps + 1, now + ttl, 0
end

-- Asked after now, or reserved for more than a term from now: the clock stepped back. A term
-- from now at most (else the share stays reserved for the step's length).
local function unstep(i)
  if A[i] > now or U[i] > now + ttl then
    A[i], U[i] = min(A[i], now), min(U[i], now + ttl)
  end
end

-- A bucket's string: its tokens, reserve and update, its holders into N.. (n of them), in the
-- order written (sorted). Raises on a string that is not one (the caller starts anew): too
-- short, a record cut off, a holder's number that is not one (NaN). (The head's numbers are
-- checked with a hash's, in `lease`.)
local function read_string(v)
  local tokens, kept, updated, at = unpack_numbers(HEAD, v)
  local len = #v
  while at <= len do
    n = n + 1
    N[n], W[n], D[n], A[n], S[n], U[n], O[n], at = unpack_numbers(HOLDER, v, at)
    if W[n] ~= W[n] or D[n] ~= D[n] or A[n] ~= A[n] or S[n] ~= S[n] or U[n] ~= U[n]
        or O[n] ~= O[n] then
      error('not a bucket')
    end
    unstep(n)
  end
  return tokens / 1e6, kept / 1e6, updated
end

local function lease(bkey, mkey, b, marker, requests, per, burst, wanted, demand, known, kr, kd,
                     returned, owed, held_by, claimed, claimed_ms, period_end)
  local rate = requests / per
  local rate_mtps = floor(requests * 1000000 / per)
  local reserve = floor(burst / 8)
  -- A calendar quota: no refill and no reserve; it starts full (whatever the cold-start mode:
  -- nothing would refill it before its period ends), and the evidence says what is left.
  local calendar = period_end > 0
  if calendar then rate, rate_mtps, reserve = 0, 0, 0 end
  local tokens, updated
  local kept = 0
  n = 0
  if type(b) == 'string' then
    local read, t, k, u = pcall(read_string, b)
    if read then
      tokens, kept, updated = t, k, u
    else
      n, kept = 0, 0
    end
    b = nil
  end
  for i = 1, (b and #b or 0), 2 do
    local f = b[i]
    if f == 'tokens' then
      tokens = tonumber(b[i + 1]) / 1e6
    elseif f == 'reserve' then
      kept = tonumber(b[i + 1]) / 1e6
    elseif f == 'updated' then
      updated = tonumber(b[i + 1])
    elseif byte(f, 1) == 64 then
      -- (No outstanding field: written by a service of before; none.)
      local w, dm, a, s, u, o = match(b[i + 1], '^(%d+):(%d+):(%d+):(%d+):(%d+):?(%d*)$')
      if w then
        n = n + 1
        N[n], W[n], D[n] = sub(f, 2), tonumber(w), tonumber(dm)
        A[n], S[n], U[n], O[n] = tonumber(a), tonumber(s), tonumber(u), tonumber(o) or 0
        unstep(n)
      end
    end
  end
  -- A head that is not one (NaN: a hash's "nan" text reads so; a reserve below zero): none.
  if tokens ~= tokens or updated ~= updated or not (kept >= 0) then
    tokens, kept, n = nil, 0, 0
  end
  local fresh = tokens == nil or updated == nil
  local reconciled = false
  if fresh then
    n = 0
    -- The slot's epoch: set with its first bucket (whatever the cold-start mode, so that a
    -- change of mode finds it), gone when the node loses its data.
    if marker == nil then marker = call('GET', mkey) end
    local epoch, lost = read_marker(marker)
    if epoch == nil then epoch, lost = now, false end
    -- A bucket the caller has evidence of is one this slot lost.
    local lose = checks and known > 0 and not lost
    if lose or marker == false then
      call('SET', mkey, format('%d', epoch) .. (lose and 'L' or ''))
    end
    kept = 0
    if calendar then
      tokens, updated = burst, now
    elseif cold == '1' or (cold == '2' and (lost or known > 0)) then
      tokens, updated, kept = 0, min(epoch, now), reserve
      n = 1
      N[1], W[1], D[1], A[1], S[1], U[1], O[1] = '', 0, 0, epoch, rate_mtps + 1, epoch + ttl, 0
    else
      tokens, updated = burst, now
    end
  elseif b then
    -- A hash's holders, sorted by name in O(n log n): nothing caps how many holders a bucket
    -- has. (A string's are sorted as written.)
    if n > 1 then
      local order = {}
      for i = 1, n do order[i] = i end
      table.sort(order, function(x, y) return before(N[x], N[y]) end)
      local n2, w2, d2, a2, s2, u2, o2 = {}, {}, {}, {}, {}, {}, {}
      for i = 1, n do
        local k = order[i]
        n2[i], w2[i], d2[i], a2[i], s2[i], u2[i], o2[i] = N[k], W[k], D[k], A[k], S[k], U[k], O[k]
      end
      N, W, D, A, S, U, O = n2, w2, d2, a2, s2, u2, o2
    end
  end

  -- Refill: the rate, less what was reserved for holders meanwhile. A bucket updated after now
  -- means the clock stepped back: the step counts as no time (else nothing would flow in until
  -- the clock caught up).
  if updated > now then updated = now end
  -- Tokens in (GlobalBucket::add): a debt first, then the reserve to its size, then the rest.
  local function add(x)
    if tokens < 0 then
      local repaid = min(x, -tokens)
      tokens = tokens + repaid
      x = x - repaid
    end
    local into = min(x, max(reserve - kept, 0))
    kept = kept + into
    tokens = min(tokens + x - into, burst - kept)
  end
  local elapsed = max(now - updated, 0)
  local reserved = 0.0
  for i = 1, n do
    reserved = reserved + min(S[i] / 1e6, rate) * max(min(U[i], now) - updated, 0)
  end
  add(max(elapsed * rate - reserved, 0))
  updated = max(updated, now)

  -- More tokens than the caller's evidence allows: the slot lost writes (or the bucket, made
  -- anew meanwhile). Empty (or in the debt the evidence shows), the whole rate held for a TTL
  -- (GlobalBucket::reconcile).
  -- (Not if the slot has served the caller since the answer its evidence is of: nothing was
  -- lost; tokens others gave back or repaid meanwhile may exceed the evidence.)
  local served_since = false
  for i = 1, n do
    if N[i] == instance and A[i] >= now - known - evidence_transit_ms then served_since = true end
  end
  if calendar and known > 0 and not served_since then
    -- (GlobalBucket::reconcile_calendar: what the evidence says was left, not emptied.)
    local bound = kr
    if kd > 0 then bound = -min(kd, max_debt) end
    if tokens + kept > bound then
      tokens, kept = max(bound, -max_debt), 0
      reconciled = true
    end
  elseif checks and known > 0 and not served_since then
    local bound
    if kd > 0 then
      bound = -min(kd, max_debt) + 1 + rate * known
    else
      bound = kr + reserve + 1 + rate * known
    end
    -- A slot that served the caller within a term remembers it: one that does not lost the
    -- bucket since, whatever it holds now (unless the loss is known: the rate already held).
    local holding = n > 0 and N[1] == '' and U[1] > now
    local forgot = not holding and known + evidence_transit_ms < ttl
    if forgot or tokens + kept > bound then
      local held = tokens + kept
      tokens = max(min(bound, 0, held), -max_debt)
      -- (One reserve per loss: not again while the rate is held for the holders of before.)
      if bound < 0 or held < 0 then
        kept = 0
      elseif holding then
        kept = min(kept, reserve)
      else
        kept = reserve
      end
      if not holding then hold_for_before(rate_mtps) end
      reconciled = true
      local epoch, lost = read_marker(call('GET', mkey))
      if not lost then call('SET', mkey, format('%d', epoch or now) .. 'L') end
    end
  end

  -- The caller's evidence of its own reservation, at a bucket whose holders of before a loss
  -- hold the rate: that much is the caller's again (GlobalBucket::restore).
  local restored = 0
  if claimed > 0 and claimed_ms > 0 and n > 0 and N[1] == '' and U[1] > now then
    local known_share = false
    for i = 1, n do
      if N[i] == instance and S[i] > 0 and U[i] > now then known_share = true end
    end
    if not known_share then
      restored = min(claimed, S[1])
      S[1] = S[1] - restored
    end
  end

  -- What the instance may give back: what it was granted, and what its reservation let it
  -- accrue since its last call (replaced now), less what it gave back.
  local outstanding, demand_before, share_before = 0, 0, 0
  for i = 1, n do
    if N[i] == instance and (A[i] + ttl > now or U[i] > now) then
      outstanding = O[i] + floor(S[i] * max(min(U[i], now) - A[i], 0) / 1e6)
      demand_before = D[i]
      if U[i] > now then share_before = S[i] end
    end
  end
  local back = min(returned, outstanding)
  add(back)
  -- A debt charged (GlobalBucket::charge): the tokens, then the reserve, then below zero.
  tokens = tokens - owed
  if tokens < 0 then
    local from = min(kept, -tokens)
    kept = kept - from
    tokens = tokens + from
  end
  tokens = max(tokens, -max_debt)
  -- In debt, what the instance holds unspent repays it.
  local revoked = 0
  if tokens < 0 then
    revoked = min(held_by, outstanding - back, ceil(-tokens))
  end
  add(revoked)
  outstanding = outstanding - back - revoked

  -- Forget the quiet and unreserved, and this instance's previous standing; place this one.
  local live_n = 0
  demand = min(demand, rate_mtps)
  for i = 1, n do
    local name = N[i]
    if name ~= instance and (A[i] + ttl > now or U[i] > now) then
      live_n = live_n + 1
      local k = live_n
      N[k], W[k], D[k], A[k], S[k], U[k], O[k] = name, W[i], D[i], A[i], S[i], U[i], O[i]
    end
  end
  local at = live_n + 1
  while at > 1 and before(instance, N[at - 1]) do
    local j = at - 1
    N[at], W[at], D[at], A[at], S[at], U[at], O[at] = N[j], W[j], D[j], A[j], S[j], U[j], O[j]
    at = j
  end
  n = live_n + 1
  N[at], W[at], D[at], A[at], S[at], U[at] = instance, wanted, demand, now, 0, now
  O[at] = outstanding

  for i = 1, n do
    local live = A[i] + ttl > now
    wants[i] = live and W[i] or 0
    demands[i] = live and D[i] or 0
  end
  local fair_tokens = max_min_fair(burst, wants, n, at)
  -- The reserve for newcomers: short of it, shares take at most three quarters of the rate, so
  -- that it fills again (not while the holders of before a loss hold the rate).
  local after_loss = n > 0 and N[1] == '' and U[1] > now
  local pool = rate_mtps
  if not after_loss and kept < reserve then
    pool = rate_mtps - floor(rate_mtps / 4)
  end
  local fair_rate = max_min_fair(pool, demands, n, at)
  local held = 0
  for i = 1, n do
    if U[i] > now then held = held + S[i] end
  end
  -- After a loss, an instance with evidence of the bucket renews: it may take what it asks for
  -- of the rate held for the holders of before; what nobody claims stays held.
  local held_for_before = 0
  if after_loss and known > 0 and at > 1 then held_for_before = S[1] end
  local share = min(demand, fair_rate, max(pool + held_for_before - held, 0))
  -- One that had a share grows by at most half of it out of what is held (the holders of
  -- before not yet renewed count for nothing in the fair shares).
  local had = max(share_before, claimed)
  if held_for_before > 0 and had > 0 then
    share = min(share, max(pool - held, had + floor(had / 2)))
  end
  -- A share that cannot accrue two tokens within the lease is none (MIN_RESERVED_MTPS_MS); a
  -- bucket in debt reserves nothing.
  if share * ttl < 2000000 or tokens < 0 then share = 0 end

  -- Within its fair share (by the smaller of its demands before and now), it may take the
  -- reserve; the others take only above it.
  local light = min(demand, demand_before) <= fair_rate
  -- (After a loss, not one that got all the rate it asked for: the reserve bridges the others
  -- until the first renewers, which may have taken more than their fair share, renew.)
  local may_take = (light or share == 0) and (not after_loss or share < demand or demand == 0)
  local function reachable()
    local r = max(tokens, 0)
    if may_take then r = r + kept end
    return max(floor(r), 0)
  end
  local granted = min(wanted, fair_tokens, reachable())
  -- From the tokens first, then the reserve.
  local from_tokens = min(granted, max(tokens, 0))
  tokens = tokens - from_tokens
  -- (Floating point: tokens and reserve that add up to the grant may leave the reserve a hair
  -- below zero, which reads back as no bucket at all — a full one: never below zero.)
  kept = max(kept - (granted - from_tokens), 0)
  O[at] = O[at] + granted
  if share > 0 then
    S[at], U[at] = share, now + ttl
  end
  if held_for_before > 0 then
    S[1] = S[1] - min(max(share - max(share_before, restored), 0), held_for_before)
  end

  -- When the bucket is full again, and when one that got nothing may ask again.
  held = 0
  local last_until, ends, renews = 0, huge, huge
  for i = 1, n do
    if U[i] > now then
      held = held + S[i]
      if S[i] > 0 then
        ends = min(ends, U[i] - now)
        if light and (S[i] < D[i] or D[i] >= rate_mtps) then
          renews = min(renews, max(A[i] + floor(ttl / 16), now) - now + renewal_margin)
        end
      end
    end
    last_until = max(last_until, max(U[i] - now, 0))
  end
  local free = max(rate - held / 1e6, 0)
  local missing_full = max(burst - tokens - kept, 0)
  local reset
  if calendar then
    reset = max(period_end - now, 1)
  elseif missing_full == 0 then
    reset = 0
  elseif free > 0 and missing_full / free <= last_until then
    reset = missing_full / free
  else
    reset = last_until + max(missing_full - free * last_until, 0) / rate
  end
  reset = ceil(reset)
  local retry = 0
  if calendar then
    if granted == 0 and (wanted > 0 or demand > 0) then retry = reset end
  elseif granted == 0 and share == 0 and (wanted > 0 or demand > 0) then
    local need
    if tokens < 0 then
      need = 1 - tokens
    else
      need = 1 - (tokens - floor(tokens))
    end
    local token = need / rate
    local first_free = huge
    if free > 0 then first_free = need / free end
    retry = max(min(first_free, ends, renews), token)
    if retry == huge then retry = token end
    retry = max(ceil(retry), 1)
  end

  local idle_at = now + reset
  for i = 1, n do
    idle_at = max(idle_at, U[i], A[i] + ttl)
  end
  -- The whole bucket, its live holders, and its expiry: one command.
  local parts = {pack(HEAD, floor(tokens * 1e6), floor(kept * 1e6), updated)}
  for i = 1, n do
    local name = N[i]
    parts[i + 1] = pack(HOLDER, #name, name, W[i], D[i], A[i], S[i], U[i], O[i])
  end
  -- (At most 10^15 ms, some 30 000 years: past 10^17 Redis would be sent "1e+17", no integer.)
  call('SET', bkey, concat(parts), 'PX', min(max(idle_at - now, 1), 1e15))
  local debt = 0
  if tokens < 0 then debt = ceil(-tokens) end
  local o = #out
  out[o + 1], out[o + 2], out[o + 3] = granted, reachable(), reset
  out[o + 4], out[o + 5], out[o + 6] = share, retry, back
  out[o + 7], out[o + 8] = debt, revoked
end

-- Every read first: a key this node does not serve (a cluster that moved slots) fails the
-- script before anything was written, so the caller can run the items again elsewhere. (A key
-- that comes again, in another call's items run together or in a caller's own, is read again
-- when served, after the writes before it.)
-- A bucket as stored: its string, a hash (written by a service of before; not a string: GET
-- answers WRONGTYPE), or false (none).
-- Another type under the name (not ours) is none: the bucket's SET replaces it. Any other error
-- (a key this node does not serve) fails the run before anything was written.
local function read_bucket(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then
    if not find(v.err or '', 'WRONGTYPE', 1, true) then call('GET', key) end
    local h = redis.pcall('HGETALL', key)
    if h.err then return false end
    return h
  end
  return v
end

local items = tonumber(ARGV[3])
-- How long the run waited to run (a Redis that paused, or was busy): the callers' evidence is
-- that much older than they said. Up to 2 s: the send time is the service's estimate of this
-- clock, and a wrong one must not excuse much.
local late = 0
local sent = tonumber(ARGV[4]) or 0
if sent > 0 then late = min(max(now - sent, 0), 2000) end
local buckets, markers, seen = {}, {}, {}
for i = 0, items - 1 do
  local key = ARGV[5 + i * 4]
  if not seen[key] then
    seen[key] = true
    local b = read_bucket(key)
    buckets[i] = b
    if not b or (type(b) == 'table' and #b == 0) then
      markers[i] = call('GET', ARGV[6 + i * 4])
    end
  end
end
for i = 0, items - 1 do
  local a = 5 + i * 4
  local requests, per, burst, wanted, demand, known, kr, kd, returned, owed, held_by, claimed,
        claimed_ms, period_end = unpack_numbers('<dddddddddddddd', ARGV[a + 2])
  if known > 0 then known = known + late end
  instance = ARGV[a + 3]
  local b = buckets[i]
  if b == nil then b = read_bucket(ARGV[a]) end
  lease(ARGV[a], ARGV[a + 1], b, markers[i], requests, per, burst, wanted, demand, known, kr, kd,
        returned, owed, held_by, claimed, claimed_ms, period_end)
end
return out
