-- Leaky bucket: a queue of `capacity` that leaks one unit every window_us / capacity.
--
-- The same units and state as the token bucket ("<t>" or "<t>:<f>"), where t is when the
-- queue drains. Leaks happen on a fixed grid: the stored instant only ever moves by whole
-- leaked units, so when a request finds the queue empty part-way through an interval, its
-- unit leaves at the end of that interval (the credit), not one whole interval later.
--
-- Band arguments: capacity, scale, interval.

local function leaky_bucket_eval(key, permits, capacity, scale, interval)
  local tat, frac = tat_of(key)
  local debt = debt_of(tat, frac, scale)
  if debt then
    return gcra(debt, 0, permits, capacity, scale, interval)
  end
  local credit = 0
  if tat then
    -- (now - drain) mod interval, in units, without forming now * scale.
    credit = imod(imod(now - tat, interval) * scale - frac, interval)
  end
  return gcra(0, credit, permits, capacity, scale, interval)
end

-- Refund: the instant moves back by the cost even before now, by whole leak intervals, so
-- the leak grid stays put (see gcra_refund in token_bucket.lua).
local function leaky_bucket_refund(key, decided, permits, capacity, scale, interval)
  gcra_refund(key, decided, permits, capacity, scale, interval)
end
