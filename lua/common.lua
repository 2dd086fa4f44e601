-- FluxGate: the prelude of the decision and refund scripts.
--
-- The general decision script is common.lua, protocol.lua, token_bucket.lua, helpers.lua,
-- the four other algorithm files, algorithms.lua and decide.lua, joined in that order (the
-- refund script: the same with refund.lua last; README.md lists them, and the two scripts
-- of token buckets alone, which do not use this part). This part reads the clock and defines what the
-- token bucket needs; helpers.lua the rest.
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

-- The strings of TIME converted by the arithmetic: once each, where tonumber converts a
-- decimal string twice (to check it, then to read it), each a strtod.
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]

-- The PX argument for a key that must outlive `us` microseconds from now by one second.
local function px(us)
  return floor(us / 1000) + 1001
end
