-- Token bucket: the exact GCRA form.
--
-- A band of `capacity` per `window_us` refills one token every window_us / capacity
-- microseconds. To keep that exact when the division is not whole, time is counted in
-- units of 1/scale microsecond, where scale = capacity / g and interval = window_us / g with
-- g = gcd(capacity, window_us): a token costs `interval` units and a full bucket holds
-- capacity * interval units (at most 2^52, checked by the caller).
--
-- State: one key per rule holds all its bands, "<layout>|<s1>|<s2>...". The layout names
-- the bands, "<band>:<capacity>/<window>" each, joined by commas; each band's state is
-- "<t>" or "<t>:<f>" in hexadecimal, t the theoretical arrival time (when the band is full
-- again) in whole microseconds and f the remainder in units (0 <= f < scale), or empty for
-- a full band. The caller sends the rule's layout with its final "|": when the stored one
-- is the same, the states are read by position; when the rule changed, band by band, so
-- that a band whose name, capacity or window changed starts full and the others keep their
-- state. A missing key is a rule whose bands are all full. The key expires one second after
-- the rule's longest window.
--
-- Band arguments: capacity, scale, interval. The leaky bucket (leaky_bucket.lua) keeps a
-- key per band, its state "<t>" or "<t>:<f>" in decimal.
-- Every `*_eval(key, permits, capacity, a, b)` of the algorithm files returns:
--   the value to store when the request is committed, or false when the band rejects;
--   the wait in microseconds (0 none, -1 never);
--   remaining and reset_after_us if not committed; the same if committed;
--   for a window algorithm that admits, `last`: the instant its state must outlive (the
--   end of the last window it counts, or the log's newest entry).
-- Every `*_store(key, value, permits, capacity, a, b, last)` commits.
-- Every `*_refund(key, decided_us, permits, capacity, a, b)` gives back what a request
-- committed at decided_us (the decision's now), for refund.lua.

-- The stored instant and remainder, or nil for a missing key.
local function tat_of(key)
  local v = redis.call('GET', key)
  if not v then
    return nil, 0
  end
  -- Converted by the arithmetic: one strtod each, where tonumber makes two.
  local colon = string.find(v, ':', 1, true)
  if not colon then
    return v + 0, 0
  end
  return string.sub(v, 1, colon - 1) + 0, string.sub(v, colon + 1) + 0
end

-- The GCRA step shared with the leaky bucket: `debt` is how far the stored instant lies
-- ahead of now, in units; `credit` (only with no debt) moves an admitted request's
-- instant back before now by less than one interval. A debt above the capacity (requests
-- waiting for a later instant, or a rule changed) leaves no permit, and the reset and the
-- wait count from all of it.
local function gcra(debt, credit, permits, capacity, scale, interval)
  local cap = capacity * interval
  local rem, reset = 0, cdiv(debt, scale)
  if debt < cap then
    rem = idiv(cap - debt, interval)
  end
  if permits > capacity then
    return false, -1, rem, reset, rem, reset
  end
  local d = debt + permits * interval
  if d > cap then
    local wait = cdiv(d - cap, scale)
    if wait < 1 then
      wait = 1
    end
    return false, wait, rem, reset, rem, reset
  end
  d = d - credit
  return d, 0, rem, reset, idiv(cap - d, interval), cdiv(d, scale)
end

-- The debt of a stored instant at now, or nil when it lies in the past.
local function debt_of(tat, frac, scale)
  if tat and (tat > now or (tat == now and frac > 0)) then
    return (tat - now) * scale + frac
  end
  return nil
end

-- The states of the `count` bands of a token-bucket rule of `layout` stored in `v` (nil for
-- a missing key), one string or nil per band; then, when the stored layout is not the
-- caller's, the bands of another version it keeps (layout.lua).
local function rule_states(v, layout, count)
  if not v then
    return {}
  end
  if string.find(v, layout, 1, true) ~= 1 then
    return matching_states(v, layout, now)
  end
  local states, at = {}, #layout + 1
  for i = 1, count do
    local bar = string.find(v, '|', at, true)
    states[i] = string.sub(v, at, (bar or 0) - 1)
    if not bar then
      break
    end
    at = bar + 1
  end
  return states
end

-- The instant and remainder of a band's state, nil for a full band.
local function state_tat(s)
  if not s or s == '' then
    return nil, 0
  end
  local t = tonumber(s, 16)
  if t then
    return t, 0
  end
  local colon = string.find(s, ':', 1, true)
  return tonumber(string.sub(s, 1, colon - 1), 16), tonumber(string.sub(s, colon + 1), 16)
end

-- The state of a band whose instant lies `debt` units from now (%x writes an integer below
-- 2^53 in full).
local function state_of(debt, scale)
  local whole = idiv(debt, scale)
  local frac = debt - whole * scale
  if frac == 0 then
    return string.format('%x', now + whole)
  end
  return string.format('%x:%x', now + whole, frac)
end

-- The value of a rule of `layout` whose `count` bands hold `states` (nil for full).
local function rule_value(layout, states, count)
  local parts = {}
  for i = 1, count do
    parts[i] = states[i] or ''
  end
  return layout .. table.concat(parts, '|')
end

-- A band of a token-bucket rule, from its stored state.
local function token_bucket_band_eval(state, permits, capacity, scale, interval)
  local tat, frac = state_tat(state)
  return gcra(debt_of(tat, frac, scale) or 0, 0, permits, capacity, scale, interval)
end

-- Refund of band `index` of the `count` bands of a token-bucket rule of `layout` (see
-- gcra_refund below): returns its remaining and reset_after_us after the refund. The
-- band keeps one instant, so a refund moves back what was taken last. `expect` says how
-- far that may go:
-- - '': the whole cost;
-- - a state (a waiting request's place, a lease): only while the band's state is that
--   one, since a place taken after it was counted behind it, and giving it back would let
--   a new request share that later place;
-- - '~' then a state, the band's state right after the request (a refund across cluster
--   slots, made at once, the request decided at `decided` µs): the part of the request's
--   permits still ahead of now, which is at most what that state says and at most what
--   has not refilled since the decision (a refund since of permits taken before it may
--   have moved its permits earlier than the state says, even back to the decision; and
--   the same state may come back with other permits behind it, so it tells nothing on
--   its own): so that the permits taken since move back no earlier than they would have
--   come without the request; and nothing while the band holds more than its capacity, a
--   waiting request's place pending behind them.
local function token_bucket_refund(key, layout, index, count, permits, capacity, scale, interval, expect, decided)
  local v = redis.call('GET', key)
  -- When the stored layout is not the request's (the rule changed since, or another
  -- version of it writes the key too), its band is matched by name, and the bands of the
  -- other versions that hold permits are written back with the request's (layout.lua).
  local states, kept = rule_states(v, layout, count)
  local tat, frac = state_tat(states[index])
  local debt = debt_of(tat, frac, scale)
  local cost = permits * interval
  if debt and string.sub(expect, 1, 1) == '~' then
    local end_tat, end_frac = state_tat(string.sub(expect, 2))
    local ahead = math.min(debt_of(end_tat, end_frac, scale) or 0, cost - (now - decided) * scale)
    if debt > capacity * interval or ahead < 0 then
      ahead = 0
    end
    if ahead < cost then
      cost = ahead
    end
  elseif expect ~= '' and states[index] ~= expect then
    debt = nil
  end
  if debt then
    debt = debt - cost
    if debt < 0 then
      debt = 0
    end
    states[index] = state_of(debt, scale)
    local value = with_kept_bands(rule_value(layout, states, count), 0, kept, now)
    redis.call('SET', key, value, 'KEEPTTL')
  end
  local _, _, rem, reset = gcra(debt or 0, 0, 1, capacity, scale, interval)
  return rem, reset
end

-- Writes the instant `debt` units from now and its expiry (the window, or the instant when
-- it lies further, plus one second): the leaky bucket's commit (a key per band).
local function gcra_store(key, debt, _, capacity, scale, interval)
  local whole = idiv(debt, scale)
  local frac = debt - whole * scale
  local cap = capacity * interval
  if debt > cap then
    cap = debt
  end
  local ttl = px(cap / scale)
  if frac == 0 then
    -- A number argument is written in full (no 14-digit rounding).
    redis.call('SET', key, now + whole, 'PX', ttl)
  else
    redis.call('SET', key, string.format('%.0f:%.0f', now + whole, frac), 'PX', ttl)
  end
end

-- Refund of the leaky bucket (a key per band; token_bucket_refund above is the token
-- bucket's): the stored instant moves back by the cost, as if the request had never come.
-- Nothing ahead of now is an empty queue whose grid a move by whole intervals would leave
-- where it is: nothing to do. The instant may fall before now: it anchors the leak grid,
-- which must not move, and moving it back by whole leak intervals keeps it where it was.
local function gcra_refund(key, _, permits, _, scale, interval)
  local tat, frac = tat_of(key)
  local debt = debt_of(tat, frac, scale)
  if not debt then
    return
  end
  debt = debt - permits * interval
  -- idiv floors, so a negative debt gives an instant before now and frac >= 0.
  local whole = idiv(debt, scale)
  local value = string.format('%.0f', now + whole)
  if debt > whole * scale then
    value = value .. string.format(':%.0f', debt - whole * scale)
  end
  redis.call('SET', key, value, 'KEEPTTL')
end
