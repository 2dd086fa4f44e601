-- FluxGate: the prelude of the decision and refund scripts.
--
-- The Redis backend sends one script, common.lua + the five algorithm files + decide.lua
-- (or refund.lua), joined in that order. This part reads the clock and defines the
-- integer helpers every algorithm uses.
--
-- Time is Redis TIME in microseconds (about 2^51 today): no client clock. Every number
-- stays an exact integer below 2^53 in Lua's doubles; the caller refuses bands that could
-- exceed it. Numbers are written with %.0f, never with Lua's 14-digit tostring.

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

-- a mod b, in [0, b), also for a negative a.
local function imod(a, b)
  return a - idiv(a, b) * b
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- The PX argument for a key that must outlive `us` microseconds from now by one second.
local function px(us)
  return cdiv(us, 1000) + 1000
end

-- The numbers of a stored value "a:b:c" (one to three of them).
local function fields(v)
  local a, b, c = string.match(v, '^(%d+):?(%d*):?(%d*)$')
  if not a then
    return nil
  end
  return tonumber(a), tonumber(b), tonumber(c)
end

-- The end of the window of `w` microseconds (aligned on the Unix epoch) holding now.
local function window_end(w)
  return now - imod(now, w) + w
end
