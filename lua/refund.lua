-- FluxGate refund: gives back what a request consumed in some hash slots of a Redis
-- Cluster when another slot rejected it, so that a rejected request consumes nothing.
--
-- The same state and units as token_bucket.lua (a string "<t>" or "<t>:<f>" per band; a
-- token costs `interval` units of 1/scale microsecond). Refunding moves the theoretical arrival time
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
  local tat, frac = nil, 0
  local v = redis.call('GET', key)
  if v then
    local colon = string.find(v, ':', 1, true)
    if colon then
      tat, frac = tonumber(string.sub(v, 1, colon - 1)), tonumber(string.sub(v, colon + 1))
    else
      tat = tonumber(v)
    end
  end
  local debt = 0
  if tat and (tat > now or (tat == now and frac > 0)) then
    debt = (tat - now) * scale + frac
  end
  debt = math.max(0, debt - cost)
  local whole = idiv(debt, scale)
  if tat then
    local rest = debt - whole * scale
    local value = string.format('%.0f', now + whole)
    if rest > 0 then
      value = value .. string.format(':%.0f', rest)
    end
    redis.call('SET', key, value, 'KEEPTTL')
  end
  reply[#reply + 1] = idiv(capacity * interval - debt, interval)
  reply[#reply + 1] = cdiv(debt, scale)
end
return reply
