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

-- The ceiling of a / b.
local function cdiv(a, b)
  local q = idiv(a, b)
  if q * b < a then
    return q + 1
  end
  return q
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- A band's debt at `now` (how far its TAT lies ahead, in units), at most `cap`.
local function debt_of(key, scale, cap)
  local v = redis.call('GET', key)
  if not v then
    return 0
  end
  local tat, frac = tonumber(v), 0
  if not tat then
    local colon = string.find(v, ':', 1, true)
    tat, frac = tonumber(string.sub(v, 1, colon - 1)), tonumber(string.sub(v, colon + 1))
  end
  if tat < now or (tat == now and frac == 0) then
    return 0
  end
  local debt = (tat - now) * scale + frac
  if debt > cap then
    return cap
  end
  return debt
end

-- The debt after admitting `permits` (or -1 when the band rejects) and the wait in
-- microseconds (0 = none, -1 = never).
local function evaluate(debt, permits, capacity, scale, interval, cap)
  if permits > capacity then
    return -1, -1
  end
  local d = debt + permits * interval
  if d <= cap then
    return d, 0
  end
  local wait = cdiv(d - cap, scale)
  if wait < 1 then
    wait = 1
  end
  return -1, wait
end

-- Writes a band's state and its expiry (the window plus one second) in one command.
local function store(key, debt, scale, cap)
  local whole = idiv(debt, scale)
  local frac = debt - whole * scale
  local ttl = cap / scale / 1000 + 1000
  if frac == 0 then
    -- A number argument is written in full (no 14-digit rounding).
    redis.call('SET', key, now + whole, 'PX', ttl)
  else
    redis.call('SET', key, string.format('%.0f:%.0f', now + whole, frac), 'PX', ttl)
  end
end

-- One bucket of one band, the common case: the same steps without the bookkeeping below.
if ARGV[1] == '1' and (ARGV[3] == '2' or ARGV[3] == '3') then
  local permits, capacity = tonumber(ARGV[2]), tonumber(ARGV[4])
  local scale, interval = tonumber(ARGV[5]), tonumber(ARGV[6])
  local cap = capacity * interval
  local debt = debt_of(KEYS[1], scale, cap)
  local new_debt, wait = evaluate(debt, permits, capacity, scale, interval, cap)
  local ok = new_debt >= 0
  if ok then
    debt = new_debt
    store(KEYS[1], debt, scale, cap)
  end
  local shadow = ARGV[3] == '3'
  return {
    (ok or shadow) and 1 or 0, (ok or not shadow) and 1 or 0, now,
    ok and 1 or 0, idiv(cap - debt, interval), cdiv(debt, scale), wait,
  }
end

-- Pass 1: evaluate every band. Per band, 6 slots of `st`:
-- debt, new debt (or -1 when the band rejects), wait, scale, interval, cap; and `shadows`.
local st, shadows = {}, {}
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
    local cap = capacity * interval
    local debt = debt_of(KEYS[n], scale, cap)
    local new_debt, wait = evaluate(debt, permits, capacity, scale, interval, cap)
    if new_debt < 0 then
      if shadow then shadow_allowed = false else allowed = false end
    end
    local at = (n - 1) * 6
    st[at + 1], st[at + 2], st[at + 3] = debt, new_debt, wait
    st[at + 4], st[at + 5], st[at + 6] = scale, interval, cap
    shadows[n] = shadow
  end
end

-- Pass 2: commit when admitted, and report.
local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now}
for i = 1, n do
  local at = (i - 1) * 6
  local debt, new_debt, scale, cap = st[at + 1], st[at + 2], st[at + 4], st[at + 6]
  local ok = new_debt >= 0
  if ok and allowed and (not shadows[i] or shadow_allowed) then
    debt = new_debt
    store(KEYS[i], debt, scale, cap)
  end
  reply[#reply + 1] = ok and 1 or 0
  reply[#reply + 1] = idiv(cap - debt, st[at + 5])
  reply[#reply + 1] = cdiv(debt, scale)
  reply[#reply + 1] = st[at + 3]
end
return reply
