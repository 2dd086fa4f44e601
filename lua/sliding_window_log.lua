-- Sliding window log: a sorted set with one member per admitted permit, scored by its
-- instant in microseconds. Members are "<us>:<n>", n counting the members already at that
-- microsecond, so requests in the same microsecond are all counted. Only entries newer
-- than now - window count, those of requests waiting for a later instant as well; older
-- ones are removed when a request is committed. The key expires one second after its
-- newest entry leaves the window.
--
-- Band arguments: capacity, window_us, 0.
--
-- The value eval returns for a request it admits, which store receives, is the instant of
-- the request's entries (now; a waiting request's later instant, decide.lua), and `last`
-- the instant of the log's newest entry once the request is in.

local function sliding_window_log_eval(key, permits, capacity, w)
  local after = string.format('(%.0f', now - w)
  local count = redis.call('ZCOUNT', key, after, '+inf')
  if count > capacity then
    count = capacity
  end
  local rem, reset = capacity - count, 0
  if count > 0 then
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    reset = math.max(newest[2] + w - now, 0)
  end
  if permits > capacity then
    return false, -1, rem, reset, rem, reset
  end
  if count + permits > capacity then
    -- The oldest entries leave first: wait for the one that makes room.
    local k = count + permits - capacity
    local entry = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', k - 1, 1)
    return false, math.max(entry[2] + w - now, 1), rem, reset, rem, reset
  end
  -- The newest entry lies at reset + now - w (before now - w: none counts).
  return now, 0, rem, reset, capacity - count - permits, w, math.max(now, reset + now - w)
end

local function sliding_window_log_store(key, value, permits, _, w, _, last)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.0f', now - w))
  local at = string.format('%.0f', value)
  local n = redis.call('ZCOUNT', key, at, at)
  local args = {}
  for i = 1, permits do
    args[#args + 1] = at
    args[#args + 1] = string.format('%s:%.0f', at, n + i)
    if #args >= 1000 then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then
    redis.call('ZADD', key, unpack(args))
  end
  redis.call('PEXPIRE', key, px(last + w - now))
end

-- Refund: removes as many members as the request added at the decision's microsecond,
-- the highest sequence numbers first, so that the next member at that microsecond
-- (numbered from the count) is still unique.
local function sliding_window_log_refund(key, decided, permits)
  local at = string.format('%.0f', decided)
  local members = redis.call('ZRANGEBYSCORE', key, at, at)
  table.sort(members, function(x, y)
    return tonumber(string.match(x, ':(%d+)$')) < tonumber(string.match(y, ':(%d+)$'))
  end)
  for j = #members, math.max(1, #members - permits + 1), -1 do
    redis.call('ZREM', key, members[j])
  end
end
