-- Sliding window counter: the previous window's count weighted by the part of it the
-- sliding window still covers, plus the current window's count, with windows aligned as
-- for the fixed window. Admitted when
--   previous * (end - now) + current * window + permits * window <= capacity * window,
-- all in exact integers (the caller keeps capacity * window_us within 2^52).
--
-- State per band: "<end>:<previous>:<current>", end the end of the current window in
-- microseconds, then ":<later>" when requests waiting for the window after it have taken
-- `later` places there. Expires one second after the window after the last one it counts
-- ends.
--
-- Band arguments: capacity, window_us, 0.

-- The counts of the window before the one ending at `e` (now's), of that one and of the
-- one after it, as stored in `key`.
local function sliding_window_counter_counts(key, e, w)
  local stored_end, a, b, c = fields(redis.call('GET', key) or '')
  if stored_end == e then
    return a, b, c or 0
  elseif stored_end == e - w then
    return b, c or 0, 0
  elseif stored_end == e - 2 * w then
    return c or 0, 0, 0
  end
  return 0, 0, 0
end

-- The state of the window ending at `e` whose window before counts `p`, itself `q`, and
-- the one after it `later`.
local function sliding_window_counter_value(e, p, q, later)
  if later > 0 then
    return string.format('%.0f:%.0f:%.0f:%.0f', e, p, q, later)
  end
  return string.format('%.0f:%.0f:%.0f', e, p, q)
end

local function sliding_window_counter_eval(key, permits, capacity, w)
  local e = window_end(w)
  local p, q, later = sliding_window_counter_counts(key, e, w)
  local left = e - now
  local full = capacity * w
  local used = p * left + q * w
  if used > full then
    used = full
  end
  local function reset(current)
    if later > 0 then
      return left + 2 * w
    elseif current > 0 then
      return left + w
    elseif p > 0 then
      return left
    end
    return 0
  end
  local rem, reset_now = idiv(full - used, w), reset(q)
  if permits > capacity then
    return false, -1, rem, reset_now, rem, reset_now
  end
  if later > 0 and q + permits + later > capacity then
    -- Requests wait for the next window: none may take a place now that would leave them
    -- over the capacity there.
    return false, math.max(left, 1), rem, reset_now, rem, reset_now
  end
  if used + permits * w > full then
    -- Without other traffic the estimate only falls: the first instant it admits.
    local wait
    if q + permits <= capacity then
      wait = left - idiv((capacity - q - permits) * w, p)
    else
      wait = left + w - math.min(idiv((capacity - permits) * w, q), w)
    end
    return false, math.max(wait, 1), rem, reset_now, rem, reset_now
  end
  local value = sliding_window_counter_value(e, p, q + permits, later)
  return value, 0, rem, reset_now, idiv(full - used - permits * w, w), reset(q + permits)
end

-- The state once a request waiting until `at` (not before now) took its place: in now's
-- window or the next one, which the state keeps apart; false when the band does not admit
-- it there. A place in the next window counts there in full and, once that window has
-- begun, as its previous one.
local function sliding_window_counter_reserve(key, at, permits, capacity, w)
  local e = window_end(w)
  local p, q, later = sliding_window_counter_counts(key, e, w)
  local e_at = window_end(w, at)
  local left, full, cost = e_at - at, capacity * w, permits * w
  if e_at == e then
    if p * left + q * w + cost <= full and (later == 0 or q + later + permits <= capacity) then
      return sliding_window_counter_value(e, p, q + permits, later)
    end
  elseif e_at == e + w then
    if q * left + later * w + cost <= full then
      return sliding_window_counter_value(e, p, q, later + permits)
    end
  end
  return false
end

local function sliding_window_counter_store(key, value, _, _, w)
  local last = window_end(w) + w
  if string.find(value, ':%d+:%d+:%d+:') then
    -- Places taken in the next window: kept until the one after it ends.
    last = last + w
  end
  redis.call('SET', key, value, 'PX', px(last - now))
end

-- Refund: the permits come off the count of the window of the decision (or of the waiting
-- request's instant), wherever the state keeps it: the current count if it is still the
-- current window, the previous count if the next window has begun since, the later count
-- if it is the window after the stored one.
local function sliding_window_counter_refund(key, decided, permits, _, w)
  local e = window_end(w, decided)
  local stored_end, previous, current, later = fields(redis.call('GET', key) or '')
  later = later or 0
  local value
  if stored_end == e then
    value = sliding_window_counter_value(e, previous, math.max(0, current - permits), later)
  elseif stored_end == e + w then
    -- The window rolled over: the decision's window is now the previous one.
    value = sliding_window_counter_value(stored_end, math.max(0, previous - permits), current, later)
  elseif stored_end == e - w then
    value = sliding_window_counter_value(stored_end, previous, current, math.max(0, later - permits))
  end
  if value then
    redis.call('SET', key, value, 'KEEPTTL')
  end
end
