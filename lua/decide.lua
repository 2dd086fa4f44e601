-- FluxGate decision: every band of every bucket of one request, all or nothing, whatever
-- the algorithm of each rule. (The crate sends requests of token buckets alone to
-- one_token_bucket.lua or token_buckets.lua, which decide them alike at less cost.) KEYS,
-- ARGV and the reply: README.md, "The decision call".
--
-- Pass 1 evaluates every band without writing. Enforced buckets are all or nothing.
-- Shadow buckets consume only when the enforced ones admitted and every shadow band
-- admits too. Nothing is written on rejection.

-- Pass 1: evaluate every band.
local bands = {}
local allowed, shadow_allowed = true, true
local arg, n = 2, 0
for _ = 1, tonumber(ARGV[1]) do
  local permits = tonumber(ARGV[arg])
  local flags = tonumber(ARGV[arg + 1])
  local shadow = flags % FLAG_ALGORITHM == FLAG_SHADOW
  local eval, store = algorithm_functions(floor((flags % FLAG_BANDS) / FLAG_ALGORITHM))
  arg = arg + 2
  for _ = 1, floor(flags / FLAG_BANDS) do
    local c, a, b = tonumber(ARGV[arg]), tonumber(ARGV[arg + 1]), tonumber(ARGV[arg + 2])
    arg = arg + 3
    n = n + 1
    local value, wait, rem, reset, rem_after, reset_after = eval(KEYS[n], permits, c, a, b)
    if not value then
      if shadow then shadow_allowed = false else allowed = false end
    end
    bands[n] = {store, permits, c, a, b, shadow, value, wait, rem, reset, rem_after, reset_after}
  end
end

-- Pass 2: commit when admitted, and report.
local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now}
for i = 1, n do
  local t = bands[i]
  local commit = t[7] and allowed and (not t[6] or shadow_allowed)
  if commit then
    t[1](KEYS[i], t[7], t[2], t[3], t[4], t[5])
    reply[#reply + 1] = 1
    reply[#reply + 1] = t[11]
    reply[#reply + 1] = t[12]
  else
    reply[#reply + 1] = t[7] and 1 or 0
    reply[#reply + 1] = t[9]
    reply[#reply + 1] = t[10]
  end
  reply[#reply + 1] = t[8]
end
return reply
