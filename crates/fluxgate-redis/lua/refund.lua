-- FluxGate refund: gives back what a request consumed in some hash slots of a Redis
-- Cluster when another slot rejected it, so that a rejected request consumes nothing.
--
-- KEYS: one key per band to refund.
-- ARGV: [1] the decision's now_us; then per band: algorithm (as in decide.lua), permits,
--       and the band's three numbers.
-- Token and leaky buckets move their instant back by the cost. A token bucket whose
-- instant would fall before now is full: it is stored as now. A leaky bucket's instant may
-- fall before now: it anchors the leak grid, which must not move, and moving it back by
-- whole leak intervals keeps it where it was. Fixed windows take the permits off the count
-- of the decision's window, if it is still the stored one. Sliding window counters take
-- them off the decision's window: the current count if it is still the current window,
-- the previous count if the next window has begun since. Sliding window logs remove that
-- many members recorded at the decision's microsecond.
-- Returns: per band: remaining, reset_after_us (after the refund).

local EVAL = {
  [0] = token_bucket_eval, leaky_bucket_eval, fixed_window_eval,
  sliding_window_log_eval, sliding_window_counter_eval,
}

local decided = tonumber(ARGV[1])
local reply = {}
for i, key in ipairs(KEYS) do
  local at = 1 + (i - 1) * 5
  local algorithm, permits = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  local c, a, b = tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4]), tonumber(ARGV[at + 5])
  if algorithm <= 1 then
    local tat, frac = tat_of(key)
    local debt = debt_of(tat, frac, a)
    -- Nothing ahead of now: a full token bucket, or an empty queue whose grid a move by
    -- whole intervals would leave where it is.
    if debt then
      debt = debt - permits * b
      if algorithm == 0 and debt < 0 then
        debt = 0
      end
      -- idiv floors, so a negative debt gives an instant before now and frac >= 0.
      local whole = idiv(debt, a)
      local value = string.format('%.0f', now + whole)
      if debt > whole * a then
        value = value .. string.format(':%.0f', debt - whole * a)
      end
      redis.call('SET', key, value, 'KEEPTTL')
    end
  elseif algorithm == 3 then
    local at_us = string.format('%.0f', decided)
    -- The highest sequence numbers go, so that the next member at this microsecond
    -- (numbered from the count) is still unique.
    local members = redis.call('ZRANGEBYSCORE', key, at_us, at_us)
    table.sort(members, function(x, y)
      return tonumber(string.match(x, ':(%d+)$')) < tonumber(string.match(y, ':(%d+)$'))
    end)
    for j = #members, math.max(1, #members - permits + 1), -1 do
      redis.call('ZREM', key, members[j])
    end
  else
    local e = decided - imod(decided, a) + a
    local stored_end, x, y = fields(redis.call('GET', key) or '')
    local value
    if stored_end == e then
      if algorithm == 2 then
        value = string.format('%.0f:%.0f', e, math.max(0, x - permits))
      else
        value = string.format('%.0f:%.0f:%.0f', e, x, math.max(0, y - permits))
      end
    elseif algorithm == 4 and stored_end == e + a then
      -- The window rolled over: the decision's window is now the previous one.
      value = string.format('%.0f:%.0f:%.0f', stored_end, math.max(0, x - permits), y)
    end
    if value then
      redis.call('SET', key, value, 'KEEPTTL')
    end
  end
  local _, _, rem, reset = EVAL[algorithm](key, 1, c, a, b)
  reply[#reply + 1] = rem
  reply[#reply + 1] = reset
end
return reply
