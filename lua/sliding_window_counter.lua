-- Sliding window counter: the previous window's count weighted by the part of it the
-- sliding window still covers, plus the current window's count, with windows aligned as
-- for the fixed window. Admitted when
--   previous * (end - now) + current * window + permits * window <= capacity * window,
-- all in exact integers (the caller keeps capacity * window_us within 2^52).
--
-- State per band: "<end>:<previous>:<current>", end the end of the current window in
-- microseconds. Expires one second after the next window ends.
--
-- Band arguments: capacity, window_us, 0.

local function sliding_window_counter_eval(key, permits, capacity, w)
  local e = window_end(w)
  local stored_end, a, b = fields(redis.call('GET', key) or '')
  local p, q = 0, 0
  if stored_end == e then
    p, q = a, b
  elseif stored_end == e - w then
    p = b
  end
  local left = e - now
  local full = capacity * w
  local used = p * left + q * w
  if used > full then
    used = full
  end
  local function reset(current)
    if current > 0 then
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
  local value = string.format('%.0f:%.0f:%.0f', e, p, q + permits)
  return value, 0, rem, reset_now, idiv(full - used - permits * w, w), reset(q + permits)
end

local function sliding_window_counter_store(key, value, _, _, w)
  redis.call('SET', key, value, 'PX', px(window_end(w) + w - now))
end

-- Refund: the permits come off the decision's window: the current count if it is still the
-- current window, the previous count if the next window has begun since.
local function sliding_window_counter_refund(key, decided, permits, _, w)
  local e = window_end(w, decided)
  local stored_end, previous, current = fields(redis.call('GET', key) or '')
  local value
  if stored_end == e then
    value = string.format('%.0f:%.0f:%.0f', e, previous, math.max(0, current - permits))
  elseif stored_end == e + w then
    -- The window rolled over: the decision's window is now the previous one.
    value = string.format('%.0f:%.0f:%.0f', stored_end, math.max(0, previous - permits), current)
  end
  if value then
    redis.call('SET', key, value, 'KEEPTTL')
  end
end
