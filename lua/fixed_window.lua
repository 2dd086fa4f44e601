-- Fixed window: a counter per window aligned on the Unix epoch.
--
-- State per band: "<end>:<count>", the end of the counted window in microseconds and the
-- permits admitted in it, then ":<later>" when requests waiting for the window after it
-- have taken `later` places there. Expires one second after the last window it counts
-- ends.
--
-- Band arguments: capacity, window_us, 0.

-- The counts of the window ending at `e` (now's) and of the one after it, as stored in
-- `key`.
local function fixed_window_counts(key, e, w)
  local stored_end, count, later = fields(redis.call('GET', key) or '')
  if stored_end == e then
    return count, later or 0
  elseif stored_end == e - w then
    return later or 0, 0
  end
  return 0, 0
end

-- The state of the window ending at `e` that counts `count`, `later` taken in the one after.
local function fixed_window_value(e, count, later)
  if later > 0 then
    return string.format('%.0f:%.0f:%.0f', e, count, later)
  end
  return string.format('%.0f:%.0f', e, count)
end

local function fixed_window_eval(key, permits, capacity, w)
  local e = window_end(w)
  local count, later = fixed_window_counts(key, e, w)
  if count > capacity then
    count = capacity
  end
  local rem, reset = capacity - count, 0
  if count > 0 then
    reset = e - now
  end
  if permits > capacity then
    return false, -1, rem, reset, rem, reset
  end
  if count + permits > capacity then
    return false, math.max(e - now, 1), rem, reset, rem, reset
  end
  count = count + permits
  return fixed_window_value(e, count, later), 0, rem, reset, capacity - count, e - now
end

-- The state once a request waiting until `at` (not before now) took its place: in now's
-- window or the next one, which the state keeps apart; false when the band does not admit
-- it there.
local function fixed_window_reserve(key, at, permits, capacity, w)
  local e = window_end(w)
  local count, later = fixed_window_counts(key, e, w)
  local e_at = window_end(w, at)
  if e_at == e and count + permits <= capacity then
    return fixed_window_value(e, count + permits, later)
  elseif e_at == e + w and later + permits <= capacity then
    return fixed_window_value(e, count, later + permits)
  end
  return false
end

local function fixed_window_store(key, value, _, _, w)
  local last = window_end(w)
  if string.find(value, ':%d+:') then
    -- Places taken in the next window: kept until it ends.
    last = last + w
  end
  redis.call('SET', key, value, 'PX', px(last - now))
end

-- Refund: the permits come off the count of the window of the decision (or of the waiting
-- request's instant), if the state still counts it.
local function fixed_window_refund(key, decided, permits, _, w)
  local e = window_end(w, decided)
  local stored_end, count, later = fields(redis.call('GET', key) or '')
  local value
  if stored_end == e then
    value = fixed_window_value(e, math.max(0, count - permits), later or 0)
  elseif stored_end == e - w and later then
    value = fixed_window_value(stored_end, count, math.max(0, later - permits))
  end
  if value then
    redis.call('SET', key, value, 'KEEPTTL')
  end
end
