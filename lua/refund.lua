-- FluxGate refund: gives back what a request consumed in some hash slots of a Redis
-- Cluster when another slot rejected it, so that a rejected request consumes nothing.
--
-- The same state and units as token_bucket.lua (a hash {t, f} per band; a token costs
-- `interval` units of 1/scale microsecond). Refunding moves the theoretical arrival time
-- back by the cost, never before now (a bucket is never fuller than full).
--
-- KEYS: one key per band to refund.
-- ARGV: per band: cost (permits * interval), capacity, scale, interval.
-- Returns: per band: remaining, reset_after_us (after the refund).

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

local reply = {}
for i, key in ipairs(KEYS) do
  local at = (i - 1) * 4
  local cost = tonumber(ARGV[at + 1])
  local capacity = tonumber(ARGV[at + 2])
  local scale = tonumber(ARGV[at + 3])
  local interval = tonumber(ARGV[at + 4])
  local state = redis.call('HMGET', key, 't', 'f')
  local tat, frac = tonumber(state[1]), tonumber(state[2]) or 0
  local debt = 0
  if tat and (tat > now or (tat == now and frac > 0)) then
    debt = (tat - now) * scale + frac
  end
  debt = math.max(0, debt - cost)
  local whole = idiv(debt, scale)
  if tat then
    redis.call('HSET', key, 't', now + whole, 'f', debt - whole * scale)
  end
  reply[#reply + 1] = idiv(capacity * interval - debt, interval)
  reply[#reply + 1] = cdiv(debt, scale)
end
return reply
