-- FluxGate token bucket: every band of every bucket of one request, all or nothing.
--
-- The exact GCRA form of the token bucket. A band of `capacity` per `window_us` refills
-- one token every window_us / capacity microseconds. To keep that exact when the division
-- is not whole, time is counted in units of 1/scale microsecond, where
-- scale = capacity / g and interval = window_us / g with g = gcd(capacity, window_us):
-- a token costs `interval` units and a full bucket holds capacity * interval units. The
-- caller guarantees capacity * interval <= 2^52, so every number below stays an exact
-- integer in Lua's doubles. Time is Redis TIME in microseconds (about 2^51 today).
--
-- State per band key: a string "<t>" or "<t>:<f>", t the TAT in whole microseconds and f
-- the remainder in units (0 <= f < scale). A missing key is a full bucket.
--
-- KEYS: one key per band, bucket by bucket, band by band.
-- ARGV: [1] number of buckets; then per bucket: permits, and band count * 2 + shadow (0|1);
--       then per band of that bucket: capacity, scale, interval.
-- A written key expires one second after its band's window (capacity * interval / scale
-- microseconds), when the bucket is full again anyway.
--
-- Enforced buckets are all or nothing. Shadow buckets consume only when the enforced
-- ones admitted and every shadow band admits too. Nothing is written on rejection.
--
-- Returns: {allowed, shadow_allowed, now_us, then per band:
--           allowed (0|1), remaining, reset_after_us, wait_us (0 = none, -1 = never)}
-- remaining and reset_after_us describe the band after the decision.

local floor = math.floor

-- a // b for integers below 2^53: the double quotient is off by at most one.
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then
    return q - 1
  elseif (q + 1) * b <= a then
    return q + 1
  end
  return q
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- One bucket of one band, the common case: the same steps without the bookkeeping below.
if ARGV[1] == '1' and (ARGV[3] == '2' or ARGV[3] == '3') then
  local permits, capacity = tonumber(ARGV[2]), tonumber(ARGV[4])
  local scale, interval = tonumber(ARGV[5]), tonumber(ARGV[6])
  local v = redis.call('GET', KEYS[1])
  local debt = 0
  if v then
    local tat, frac = tonumber(v), 0
    if not tat then
      local colon = string.find(v, ':', 1, true)
      tat, frac = tonumber(string.sub(v, 1, colon - 1)), tonumber(string.sub(v, colon + 1))
    end
    if tat > now or (tat == now and frac > 0) then
      debt = (tat - now) * scale + frac
    end
  end
  local cap = capacity * interval
  if debt > cap then
    debt = cap
  end
  local ok, wait = 0, -1
  if permits <= capacity then
    local d = debt + permits * interval
    if d <= cap then
      ok, wait, debt = 1, 0, d
      local whole = idiv(d, scale)
      local frac = d - whole * scale
      local ttl = cap / scale / 1000 + 1000
      if frac == 0 then
        redis.call('SET', KEYS[1], now + whole, 'PX', ttl)
      else
        redis.call('SET', KEYS[1], string.format('%.0f:%.0f', now + whole, frac), 'PX', ttl)
      end
    else
      local over = d - cap
      wait = idiv(over, scale)
      if wait * scale < over then wait = wait + 1 end
      if wait < 1 then wait = 1 end
    end
  end
  local reset = idiv(debt, scale)
  if reset * scale < debt then reset = reset + 1 end
  local shadow = ARGV[3] == '3'
  local admitted = (ok == 1 or shadow) and 1 or 0
  local shadow_ok = (ok == 1 or not shadow) and 1 or 0
  return {admitted, shadow_ok, now, ok, idiv(cap - debt, interval), reset, wait}
end

-- Pass 1: evaluate every band. Per band, 8 slots of `st`:
-- debt, new debt (or -1 when the band rejects), wait, scale, interval, cap, ttl_ms, shadow.
local st = {}
local allowed, shadow_allowed = true, true
local arg, n = 2, 0
for _ = 1, tonumber(ARGV[1]) do
  local permits = tonumber(ARGV[arg])
  local flags = tonumber(ARGV[arg + 1])
  local shadow = flags % 2 == 1
  arg = arg + 2
  for _ = 1, floor(flags / 2) do
    local capacity = tonumber(ARGV[arg])
    local scale = tonumber(ARGV[arg + 1])
    local interval = tonumber(ARGV[arg + 2])
    arg = arg + 3
    n = n + 1

    local v = redis.call('GET', KEYS[n])
    local debt = 0
    if v then
      local tat, frac = tonumber(v), 0
      if not tat then
        local colon = string.find(v, ':', 1, true)
        tat, frac = tonumber(string.sub(v, 1, colon - 1)), tonumber(string.sub(v, colon + 1))
      end
      if tat > now or (tat == now and frac > 0) then
        debt = (tat - now) * scale + frac
      end
    end
    local cap = capacity * interval
    local ttl = cap / scale / 1000 + 1000
    if debt > cap then
      debt = cap
    end
    local new_debt, wait = -1, -1
    if permits <= capacity then
      local d = debt + permits * interval
      if d <= cap then
        new_debt, wait = d, 0
      else
        local over = d - cap
        wait = idiv(over, scale)
        if wait * scale < over then wait = wait + 1 end
        if wait < 1 then wait = 1 end
      end
    end
    if new_debt < 0 then
      if shadow then shadow_allowed = false else allowed = false end
    end
    local at = (n - 1) * 8
    st[at + 1], st[at + 2], st[at + 3], st[at + 4] = debt, new_debt, wait, scale
    st[at + 5], st[at + 6], st[at + 7], st[at + 8] = interval, cap, ttl, shadow
  end
end

-- Pass 2: commit when admitted, and report.
local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now}
for i = 1, n do
  local at = (i - 1) * 8
  local debt, new_debt, scale = st[at + 1], st[at + 2], st[at + 4]
  local ok = new_debt >= 0
  if ok and allowed and (not st[at + 8] or shadow_allowed) then
    debt = new_debt
    local whole = idiv(debt, scale)
    local frac = debt - whole * scale
    if frac == 0 then
      -- A number argument is written in full (no 14-digit rounding).
      redis.call('SET', KEYS[i], now + whole, 'PX', st[at + 7])
    else
      redis.call('SET', KEYS[i], string.format('%.0f:%.0f', now + whole, frac), 'PX', st[at + 7])
    end
  end
  local reset = idiv(debt, scale)
  if reset * scale < debt then reset = reset + 1 end
  reply[#reply + 1] = ok and 1 or 0
  reply[#reply + 1] = idiv(st[at + 6] - debt, st[at + 5])
  reply[#reply + 1] = reset
  reply[#reply + 1] = st[at + 3]
end
return reply
