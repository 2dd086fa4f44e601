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
-- State per band key: a hash {t = TAT in whole microseconds, f = remainder in units,
-- 0 <= f < scale}. A missing key is a full bucket.
--
-- KEYS: one key per band, bucket by bucket, band by band.
-- ARGV: [1] number of buckets; then per bucket: permits, shadow (0|1), band count;
--       then per band of that bucket: capacity, scale, interval, ttl_ms.
--
-- Enforced buckets are all or nothing. Shadow buckets consume only when the enforced
-- ones admitted and every shadow band admits too. Nothing is written on rejection.
--
-- Returns: {allowed, shadow_allowed, now_us, then per band:
--           allowed (0|1), remaining, reset_after_us, wait_us (0 = none, -1 = never)}
-- remaining and reset_after_us describe the band after the decision.

-- Integer division that stays exact: a double quotient can round across an integer.
local function idiv(a, b)
  local q = math.floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

local function cdiv(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local bands = {}
local allowed, shadow_allowed = true, true
local arg, key = 2, 1
for _ = 1, tonumber(ARGV[1]) do
  local permits = tonumber(ARGV[arg])
  local shadow = ARGV[arg + 1] == '1'
  local count = tonumber(ARGV[arg + 2])
  arg = arg + 3
  for _ = 1, count do
    local capacity = tonumber(ARGV[arg])
    local scale = tonumber(ARGV[arg + 1])
    local interval = tonumber(ARGV[arg + 2])
    local ttl = tonumber(ARGV[arg + 3])
    arg = arg + 4

    local state = redis.call('HMGET', KEYS[key], 't', 'f')
    local tat, frac = tonumber(state[1]), tonumber(state[2]) or 0
    local debt = 0
    if tat and (tat > now or (tat == now and frac > 0)) then
      debt = (tat - now) * scale + frac
    end
    local cap = capacity * interval
    if debt > cap then
      debt = cap
    end
    local b = {
      key = KEYS[key], ttl = ttl, shadow = shadow, scale = scale, interval = interval, cap = cap,
      debt = debt, ok = false, wait = -1,
    }
    if permits <= capacity then
      local new_debt = debt + permits * interval
      if new_debt <= cap then
        b.ok, b.wait, b.new_debt = true, 0, new_debt
      else
        b.wait = math.max(1, cdiv(new_debt - cap, scale))
      end
    end
    if not b.ok then
      if shadow then shadow_allowed = false else allowed = false end
    end
    bands[#bands + 1] = b
    key = key + 1
  end
end

local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now}
for _, b in ipairs(bands) do
  local commit = b.ok and allowed and (not b.shadow or shadow_allowed)
  local debt = b.debt
  if commit then
    debt = b.new_debt
    local whole = idiv(debt, b.scale)
    redis.call('HSET', b.key, 't', now + whole, 'f', debt - whole * b.scale)
    redis.call('PEXPIRE', b.key, b.ttl)
  end
  reply[#reply + 1] = b.ok and 1 or 0
  reply[#reply + 1] = idiv(b.cap - debt, b.interval)
  reply[#reply + 1] = cdiv(debt, b.scale)
  reply[#reply + 1] = b.wait
end
return reply
