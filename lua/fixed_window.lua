-- Fixed window: a counter per window aligned on the Unix epoch.
--
-- State per band: "<end>:<count>", the end of the counted window in microseconds and the
-- permits admitted in it, then ":<later>" when requests waiting for the window after it
-- have taken `later` places there (decide.lua, "Waiting for the refill"). Expires one
-- second after the last window it counts ends.
--
-- Band arguments: capacity, window_us, 0.

local function fixed_window_eval(key, permits, capacity, w)
  local stored_end, stored, stored_later = fields(redis.call('GET', key) or '')
  local e = current_window(w, stored_end)
  local _, count, later = window_counts(stored_end, e, w, nil, stored, stored_later)
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
  if later > 0 then
    return string.format('%.0f:%.0f:%.0f', e, count, later), 0, rem, reset, capacity - count, e - now, e + w
  end
  return string.format('%.0f:%.0f', e, count), 0, rem, reset, capacity - count, e - now, e
end

-- `last`: the end of the last window the state counts.
local function fixed_window_store(key, value, _, _, _, _, last)
  redis.call('SET', key, value, 'PX', px(last - now))
end

-- Refund: the permits come off the count of the window of the decision (or of the waiting
-- request's instant), if the state still counts it.
local function fixed_window_refund(key, decided, permits, _, w)
  local e = window_end(w, decided)
  local stored_end, count, later = fields(redis.call('GET', key) or '')
  local value
  if stored_end == e then
    count = math.max(0, count - permits)
    if later then
      value = string.format('%.0f:%.0f:%.0f', e, count, later)
    else
      value = string.format('%.0f:%.0f', e, count)
    end
  elseif stored_end == e - w and later then
    value = string.format('%.0f:%.0f:%.0f', stored_end, count, math.max(0, later - permits))
  end
  if value then
    redis.call('SET', key, value, 'KEEPTTL')
  end
end
