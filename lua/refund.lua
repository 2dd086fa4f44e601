-- FluxGate refund: gives back what a request consumed in some hash slots of a Redis
-- Cluster when another slot rejected it, so that a rejected request consumes nothing.
--
-- KEYS: one key per band to refund.
-- ARGV: [1] the decision's now_us; then per band: algorithm (as in decide.lua), permits,
--       and the band's three numbers.
-- Token and leaky buckets move their instant back by the cost, never before now. Fixed
-- windows and sliding window counters take the permits off the count of the decision's
-- window, if it is still the stored one. Sliding window logs remove that many members
-- recorded at the decision's microsecond.
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
    if debt then
      debt = math.max(0, debt - permits * b)
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
    if stored_end == e then
      local value
      if algorithm == 2 then
        value = string.format('%.0f:%.0f', e, math.max(0, x - permits))
      else
        value = string.format('%.0f:%.0f:%.0f', e, x, math.max(0, y - permits))
      end
      redis.call('SET', key, value, 'KEEPTTL')
    end
  end
  local _, _, rem, reset = EVAL[algorithm](key, 1, c, a, b)
  reply[#reply + 1] = rem
  reply[#reply + 1] = reset
end
return reply
