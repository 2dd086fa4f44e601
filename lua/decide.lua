-- FluxGate decision: every band of every bucket of one request, all or nothing, whatever
-- the algorithm of each rule. (The crate sends requests of token buckets alone to
-- one_token_bucket.lua or token_buckets.lua, which decide them alike at less cost.) KEYS,
-- ARGV and the reply: README.md, "The decision call".
--
-- Pass 1 evaluates every band without writing. Enforced buckets are all or nothing.
-- Shadow buckets consume only when the enforced ones admitted and every shadow band
-- admits too. Nothing is written on rejection. A token-bucket rule is one key (its layout
-- follows its flags in ARGV) and one write; a band of another algorithm is a key.

-- Pass 1: evaluate every band. ARGV's decimal numbers are converted by the arithmetic
-- (`s + 0`): one strtod each, where tonumber makes two.
local bands = {}
local rules = {}
local allowed, shadow_allowed = true, true
local arg, n, k = 2, 0, 0
for _ = 1, ARGV[1] + 0 do
  local permits = ARGV[arg] + 0
  local flags = ARGV[arg + 1] + 0
  local shadow = flags % FLAG_ALGORITHM == FLAG_SHADOW
  local algorithm = floor((flags % FLAG_BANDS) / FLAG_ALGORITHM)
  local count = floor(flags / FLAG_BANDS)
  arg = arg + 2
  local eval, store, states
  if algorithm == TOKEN_BUCKET then
    k = k + 1
    local layout = ARGV[arg]
    arg = arg + 1
    states = rule_states(redis.call('GET', KEYS[k]), layout, count)
    rules[#rules + 1] = {KEYS[k], layout, n + 1, count, shadow}
  else
    eval, store = algorithm_functions(algorithm)
  end
  for i = 1, count do
    local c, a, b = ARGV[arg] + 0, ARGV[arg + 1] + 0, ARGV[arg + 2] + 0
    arg = arg + 3
    n = n + 1
    local value, wait, rem, reset, rem_after, reset_after, key
    if states then
      value, wait, rem, reset, rem_after, reset_after = token_bucket_band_eval(states[i], permits, c, a, b)
    else
      k = k + 1
      key = KEYS[k]
      value, wait, rem, reset, rem_after, reset_after = eval(key, permits, c, a, b)
    end
    if not value then
      if shadow then shadow_allowed = false else allowed = false end
    end
    bands[n] = {store, permits, c, a, b, shadow, value, wait, rem, reset, rem_after, reset_after, key}
  end
end

-- Pass 2: commit when admitted, and report.
local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now}
for i = 1, n do
  local t = bands[i]
  local commit = t[7] and allowed and (not t[6] or shadow_allowed)
  if commit then
    if t[1] then
      t[1](t[13], t[7], t[2], t[3], t[4], t[5])
    end
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
-- A committed token-bucket rule: its bands' new instants in one write, the key outliving
-- its longest window by one second.
for _, rule in ipairs(rules) do
  if allowed and (not rule[5] or shadow_allowed) then
    local states, window = {}, 0
    for i = 1, rule[4] do
      local t = bands[rule[3] + i - 1]
      states[i] = state_of(t[7], t[4])
      if t[3] * t[5] / t[4] > window then
        window = t[3] * t[5] / t[4]
      end
    end
    redis.call('SET', rule[1], rule_value(rule[2], states, rule[4]), 'PX', px(window))
  end
end
return reply
