-- FluxGate decision, the common case: a request of one token-bucket band (exact GCRA, as
-- token_bucket.lua), a script of its own. Redis runs a script from its first line on every
-- call and converts every number it is given, so this one defines no function and builds
-- no table on the admitting path but its reply, and converts as few numbers as it can.
-- Enforced or shadow, one band decides alike (it consumes when it admits): the script
-- need not know which, the caller tells the request's verdict from the band's.
--
-- KEYS[1]: the band's key. ARGV: capacity, interval (token_bucket.lua's band numbers), the
-- key's expiry in ms (the window plus one second), then permits and scale, each left out
-- when it is 1 and nothing follows it (every argument costs Redis a parse).
-- Reply: now_us, then the band's allowed, remaining, reset_after_us, wait_us.
-- README.md, "The one-band call".
--
-- The state, the expiry and the arithmetic are token_bucket.lua's: the key holds "<t>" or
-- "<t>:<f>", and a floor division (x - x % 1) is corrected by one when the double quotient
-- is off.

local key = KEYS[1]
local capacity, interval, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
-- A cost or a scale of 1 is the common case: it comes as no argument, or as text compared
-- without a conversion.
local permits, scale = ARGV[4], ARGV[5]
permits = (not permits or permits == '1') and 1 or tonumber(permits)
scale = (not scale or scale == '1') and 1 or tonumber(scale)
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local cap = capacity * interval

-- The debt: how far the stored instant lies ahead of now, in units (at most cap).
local debt = 0
local v = redis.call('GET', key)
if v then
  local tat, frac = tonumber(v), 0
  if not tat then
    local colon = string.find(v, ':', 1, true)
    tat, frac = tonumber(string.sub(v, 1, colon - 1)), tonumber(string.sub(v, colon + 1))
  end
  if tat > now or (tat == now and frac > 0) then
    debt = (tat - now) * scale + frac
    if debt > cap then
      debt = cap
    end
  end
end

local d = debt + permits * interval
if permits <= capacity and d <= cap then
  -- Admitted: the instant moves d units ahead of now.
  local whole = d / scale
  whole = whole - whole % 1
  if whole * scale > d then
    whole = whole - 1
  elseif (whole + 1) * scale <= d then
    whole = whole + 1
  end
  local frac = d - whole * scale
  -- %d writes an integer below 2^53 in full (Lua's tostring keeps 14 digits) and costs
  -- less than %.0f or a number argument, which Redis writes with %.17g. `whole` becomes the
  -- reset: the instant rounded up to a whole microsecond.
  if frac == 0 then
    redis.call('SET', key, string.format('%d', now + whole), 'PX', ttl)
  else
    redis.call('SET', key, string.format('%d:%d', now + whole, frac), 'PX', ttl)
    whole = whole + 1
  end
  local left = cap - d
  local rem = left / interval
  rem = rem - rem % 1
  if rem * interval > left then
    rem = rem - 1
  elseif (rem + 1) * interval <= left then
    rem = rem + 1
  end
  return {now, 1, rem, whole, 0}
end

-- Rejected: nothing is written; the figures are the band's as it stands.
local function idiv(a, b)
  local q = a / b
  q = q - q % 1
  if q * b > a then
    return q - 1
  elseif (q + 1) * b <= a then
    return q + 1
  end
  return q
end
local function cdiv(a, b)
  local q = idiv(a, b)
  if q * b < a then
    return q + 1
  end
  return q
end
local wait = -1
if permits <= capacity then
  wait = cdiv(d - cap, scale)
  if wait < 1 then
    wait = 1
  end
end
return {now, 0, idiv(cap - debt, interval), cdiv(debt, scale), wait}
