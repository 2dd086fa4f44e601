-- FluxGate decision when every rule of the request is a token bucket: every band of every
-- bucket, all or nothing, as decide.lua decides them, without the other algorithms'
-- functions, in a script of its own (after protocol.lua). KEYS and ARGV are decide.lua's
-- (every bucket's algorithm TOKEN_BUCKET) and so is the reply: README.md, "The decision
-- call".
--
-- One MGET reads every band, and one SET (with its expiry) writes each admitted one. The
-- state, the expiry and the arithmetic are token_bucket.lua's. Redis runs a script from
-- its first line on every call and converts every number it is given, so this one makes
-- one function, two tables (the bands' numbers and the reply) and as few conversions as
-- it can: a cost or a scale of '1' is compared as text, and numbers are written with
-- string.format('%d'), exact below 2^53 and cheaper than %.0f or a number argument.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local values = redis.call('MGET', unpack(KEYS))

-- a // b for integers below 2^53: the double quotient is off by at most one.
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

-- Pass 1: each band's debt (how far its instant lies ahead of now, in units, at most
-- capacity * interval) and, when it admits, its debt after the request (else false), kept
-- with its numbers in one flat table, 7 entries a band.
local bands = {}
local allowed, shadow_allowed = true, true
local arg, n = 2, 0
for _ = 1, tonumber(ARGV[1]) do
  local permits = ARGV[arg]
  permits = permits == '1' and 1 or tonumber(permits)
  local flags = tonumber(ARGV[arg + 1])
  local shadow = flags % FLAG_ALGORITHM == FLAG_SHADOW
  arg = arg + 2
  for _ = 1, (flags - flags % FLAG_BANDS) / FLAG_BANDS do
    local capacity, scale, interval = tonumber(ARGV[arg]), ARGV[arg + 1], tonumber(ARGV[arg + 2])
    scale = scale == '1' and 1 or tonumber(scale)
    arg = arg + 3
    local cap = capacity * interval
    local debt = 0
    local v = values[n / 7 + 1]
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
    if permits > capacity or d > cap then
      d = false
      if shadow then
        shadow_allowed = false
      else
        allowed = false
      end
    end
    bands[n + 1] = d
    bands[n + 2] = debt
    bands[n + 3] = permits
    bands[n + 4] = capacity
    bands[n + 5] = scale
    bands[n + 6] = interval
    bands[n + 7] = shadow
    n = n + 7
  end
end

-- Pass 2: commit when admitted, and report each band: allowed, remaining, reset_after_us,
-- wait_us.
local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now}
local at = 4
for i = 1, n, 7 do
  local d, debt, permits, capacity = bands[i], bands[i + 1], bands[i + 2], bands[i + 3]
  local scale, interval = bands[i + 4], bands[i + 5]
  local cap = capacity * interval
  local wait = 0
  if d then
    if allowed and (shadow_allowed or not bands[i + 6]) then
      local whole = idiv(d, scale)
      local frac = d - whole * scale
      -- cap / scale is the window in µs: the key outlives it by one second.
      local ttl = cap / scale / 1000
      ttl = string.format('%d', ttl - ttl % 1 + 1001)
      -- %d writes an integer below 2^53 in full (Lua's tostring keeps 14 digits).
      if frac == 0 then
        redis.call('SET', KEYS[(i + 6) / 7], string.format('%d', now + whole), 'PX', ttl)
      else
        redis.call('SET', KEYS[(i + 6) / 7], string.format('%d:%d', now + whole, frac), 'PX', ttl)
      end
      debt = d
    end
  elseif permits > capacity then
    wait = -1
  else
    wait = debt + permits * interval - cap
    local q = idiv(wait, scale)
    if q * scale < wait then
      q = q + 1
    end
    wait = q < 1 and 1 or q
  end
  local reset = idiv(debt, scale)
  if reset * scale < debt then
    reset = reset + 1
  end
  reply[at] = d and 1 or 0
  reply[at + 1] = idiv(cap - debt, interval)
  reply[at + 2] = reset
  reply[at + 3] = wait
  at = at + 4
end
return reply
