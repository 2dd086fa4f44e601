-- Sliding window counter: the previous window's count weighted by the part of it the
-- sliding window still covers, plus the current window's count, with windows aligned as
-- for the fixed window. Admitted when
--   previous * (end - now) + current * window + permits * window <= capacity * window,
-- all in exact integers (the caller keeps capacity * window_us within 2^52).
--
-- State per band: "<end>:<previous>:<current>", end the end of the current window in
-- microseconds, then ":<later>" when requests waiting for the window after it have taken
-- `later` places there (decide.lua, "Waiting for the refill"). Expires one second after the
-- window after the last one it counts ends.
--
-- Band arguments: capacity, window_us, 0.

local function sliding_window_counter_eval(key, permits, capacity, w)
  local stored_end, a, b, c = fields(redis.call('GET', key) or '')
  local e, t = current_window(w, stored_end)
  local p, q, later = window_counts(stored_end, e, w, a, b, c)
  -- `left` weighs the previous window as of the band's instant; the figures reported are
  -- counted from now, `ahead` earlier when Redis's clock has gone back behind the state.
  local left, ahead = e - t, t - now
  local full = capacity * w
  local used = p * left + q * w
  if used > full then
    used = full
  end
  local function reset(current)
    if later > 0 then
      return ahead + left + 2 * w
    elseif current > 0 then
      return ahead + left + w
    elseif p > 0 then
      return ahead + left
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
    return false, math.max(ahead + left, 1), rem, reset_now, rem, reset_now
  end
  if used + permits * w > full then
    -- Without other traffic the estimate only falls: the first instant it admits.
    local wait
    if q + permits <= capacity then
      wait = left - idiv((capacity - q - permits) * w, p)
    else
      wait = left + w - math.min(idiv((capacity - permits) * w, q), w)
    end
    return false, math.max(ahead + wait, 1), rem, reset_now, rem, reset_now
  end
  local rem_after, reset_after = idiv(full - used - permits * w, w), reset(q + permits)
  if later > 0 then
    return string.format('%.0f:%.0f:%.0f:%.0f', e, p, q + permits, later), 0, rem, reset_now, rem_after,
      reset_after, e + 2 * w
  end
  return string.format('%.0f:%.0f:%.0f', e, p, q + permits), 0, rem, reset_now, rem_after, reset_after, e + w
end

-- `last`: the end of the window after the last one the state counts.
local function sliding_window_counter_store(key, value, _, _, _, _, last)
  redis.call('SET', key, value, 'PX', px(last - now))
end

-- Refund: the permits come off the count of the window of the decision (or of the waiting
-- request's instant), wherever the state keeps it: the current count if it is still the
-- current window, the previous count if the next window has begun since, the later count
-- if it is the window after the stored one.
local function sliding_window_counter_refund(key, decided, permits, _, w)
  local e = window_end(w, decided)
  local stored_end, previous, current, later = fields(redis.call('GET', key) or '')
  if stored_end == e then
    current = math.max(0, current - permits)
  elseif stored_end == e + w then
    -- The window rolled over: the decision's window is now the previous one.
    previous = math.max(0, previous - permits)
  elseif stored_end == e - w and later then
    later = math.max(0, later - permits)
  else
    return
  end
  local value = string.format('%.0f:%.0f:%.0f', stored_end, previous, current)
  if later and later > 0 then
    value = value .. string.format(':%.0f', later)
  end
  redis.call('SET', key, value, 'KEEPTTL')
end
