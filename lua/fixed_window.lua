-- Fixed window: a counter per window aligned on the Unix epoch.
--
-- State per band: "<end>:<count>", the end of the counted window in microseconds and the
-- permits admitted in it. Expires one second after the window ends.
--
-- Band arguments: capacity, window_us, 0.

local function fixed_window_eval(key, permits, capacity, w)
  local e = window_end(w)
  local stored_end, count = fields(redis.call('GET', key) or '')
  if stored_end ~= e then
    count = 0
  elseif count > capacity then
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
  return string.format('%.0f:%.0f', e, count), 0, rem, reset, capacity - count, e - now
end

local function fixed_window_store(key, value, _, _, w)
  redis.call('SET', key, value, 'PX', px(window_end(w) - now))
end

-- Refund: the permits come off the count of the decision's window, if it is still the
-- stored one.
local function fixed_window_refund(key, decided, permits, _, w)
  local e = window_end(w, decided)
  local stored_end, count = fields(redis.call('GET', key) or '')
  if stored_end == e then
    redis.call('SET', key, string.format('%.0f:%.0f', e, math.max(0, count - permits)), 'KEEPTTL')
  end
end
