-- FluxGate decision: every band of every bucket of one request, all or nothing, whatever
-- the algorithm of each rule. (The crate sends requests of token buckets alone to
-- one_token_bucket.lua or token_buckets.lua, which decide them alike at less cost.) KEYS,
-- ARGV and the reply: README.md, "The decision call".
--
-- Pass 1 evaluates every band without writing. Enforced buckets are all or nothing.
-- Shadow buckets consume only when the enforced ones admitted and every shadow band
-- admits too. Nothing is written on rejection. A token-bucket rule is one key (its layout
-- follows its flags in ARGV) and one write; a band of another algorithm is a key. A
-- request refused that may wait takes its places for a later instant in between
-- ("Waiting for the refill" below), then pass 2 commits and reports.

-- Pass 1: evaluate every band. ARGV's decimal numbers are converted by the arithmetic
-- (`s + 0`): one strtod each, where tonumber makes two.
local bands = {}
local rules = {}
local allowed, shadow_allowed, waits = true, true, false
local arg, n, k = 2, 0, 0
local head = ARGV[1] + 0
local marks = head >= CALL_MARKS
for _ = 1, head % CALL_MARKS do
  local permits = ARGV[arg] + 0
  local flags = ARGV[arg + 1] + 0
  local shadow = flags % FLAG_ALGORITHM == FLAG_SHADOW
  local algorithm = floor((flags % FLAG_WAITS) / FLAG_ALGORITHM)
  local count = floor(flags / FLAG_BANDS)
  arg = arg + 2
  local eval, store, states, seeds
  if algorithm == TOKEN_BUCKET then
    k = k + 1
    local layout = ARGV[arg]
    arg = arg + 1
    local kept
    states, kept, seeds = rule_states(redis.call('GET', KEYS[k]), layout, count)
    rules[#rules + 1] = {KEYS[k], layout, n + 1, count, shadow, kept}
  else
    eval, store = algorithm_functions(algorithm)
  end
  local max_wait = false
  if flags % FLAG_BANDS >= FLAG_WAITS then
    max_wait = ARGV[arg] + 0
    arg = arg + 1
    waits = true
  end
  for i = 1, count do
    local c, a, b = ARGV[arg] + 0, ARGV[arg + 1] + 0, ARGV[arg + 2] + 0
    arg = arg + 3
    n = n + 1
    local value, wait, rem, reset, rem_after, reset_after, last, key, state
    if states then
      state = states[i]
      if seeds and seeds[i] then
        -- The permits another version's band of its name and window holds in use
        -- (layout.lua), at most the capacity: the band counts at least as many.
        local tat, frac = state_tat(state)
        local least = seeds[i] * a
        least = math.min(least - least % 1 + (least % 1 > 0 and 1 or 0), c * b)
        if least > (debt_of(tat, frac, a) or 0) then
          state = state_of(least, a)
        end
      end
      value, wait, rem, reset, rem_after, reset_after = token_bucket_band_eval(state, permits, c, a, b)
    else
      k = k + 1
      key = KEYS[k]
      value, wait, rem, reset, rem_after, reset_after, last = eval(key, permits, c, a, b)
    end
    if not value then
      if shadow then shadow_allowed = false else allowed = false end
    end
    bands[n] = {store, permits, c, a, b, shadow, value, wait, rem, reset, rem_after, reset_after, key,
      algorithm, state, max_wait, last}
  end
end

-- Waiting for the refill: a request some enforced band refuses waits until the last of
-- them admits it, `at`, when each such band's bucket lets it wait that long.
-- Every band takes the request's place for `at` now (`place` below), all or nothing for
-- the enforced bands; the shadow ones only if they all admit it then. The places become
-- the values pass 2 commits. Its functions are defined on this path only: Redis runs a
-- script from the top on every call, and a function defined there costs every call.
local after = 0
if not allowed and waits then
  -- A token or leaky bucket's place, its stored instant and remainder being `tat` and
  -- `frac` (nil: a full band): its debt from now once the place is taken, or false. Only
  -- where the stored instant lies at or past `at`: taking the place now is then what
  -- taking it at `at` would be. Before `at`, the instant would have to jump ahead,
  -- refusing everyone until then.
  local function gcra_place(tat, frac, at, permits, capacity, scale, interval)
    if not tat or tat < at or permits > capacity then
      return false
    end
    local cost = permits * interval
    if (tat - at) * scale + frac + cost > capacity * interval then
      return false
    end
    return (tat - now) * scale + frac + cost
  end

  -- Band `t`'s place for a request admitted at `at` (not before now): the value to store
  -- and, for a window algorithm, the instant its state must outlive; false when the band
  -- does not admit the request then. A fixed window or sliding window counter takes it in
  -- now's window or the next one, whose count the state keeps apart (`later`); a sliding
  -- window log when every window holding `at` keeps to the capacity, counting the entries
  -- after `at - window` (later ones included).
  local function place(t, at)
    local algorithm, key, permits, capacity, a, b = t[14], t[13], t[2], t[3], t[4], t[5]
    if algorithm == TOKEN_BUCKET then
      local tat, frac = state_tat(t[15])
      return gcra_place(tat, frac, at, permits, capacity, a, b)
    elseif algorithm == LEAKY_BUCKET then
      local tat, frac = tat_of(key)
      return gcra_place(tat, frac, at, permits, capacity, a, b)
    elseif permits > capacity then
      return false
    end
    local w = a
    if algorithm == SLIDING_WINDOW_LOG then
      local count = redis.call('ZCOUNT', key, string.format('(%.0f', at - w), '+inf')
      if count + permits > capacity then
        return false
      end
      local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
      return at, math.max(at, newest and newest + 0 or at)
    end
    local stored_end, x, y, z = fields(redis.call('GET', key) or '')
    local e, t = current_window(w, stored_end)
    -- With Redis's clock gone back, `at` may fall before the stored window: the place is
    -- then taken there, from its start.
    local e_at = math.max(window_end(w, at), e)
    at = math.max(at, t)
    if algorithm == FIXED_WINDOW then
      local _, count, later = window_counts(stored_end, e, w, nil, x, y)
      if e_at == e and count + permits <= capacity then
        count = count + permits
      elseif e_at == e + w and later + permits <= capacity then
        later = later + permits
      else
        return false
      end
      if later > 0 then
        return string.format('%.0f:%.0f:%.0f', e, count, later), e + w
      end
      return string.format('%.0f:%.0f', e, count), e
    end
    -- A sliding window counter: a place in the next window counts there in full and, once
    -- that window has begun, as its previous one.
    local p, q, later = window_counts(stored_end, e, w, x, y, z)
    local left, full, cost = e_at - at, capacity * w, permits * w
    if e_at == e and p * left + q * w + cost <= full and (later == 0 or q + later + permits <= capacity) then
      q = q + permits
    elseif e_at == e + w and q * left + later * w + cost <= full then
      later = later + permits
    else
      return false
    end
    if later > 0 then
      return string.format('%.0f:%.0f:%.0f:%.0f', e, p, q, later), e + 2 * w
    end
    return string.format('%.0f:%.0f:%.0f', e, p, q), e + w
  end

  -- The longest wait of the refusing enforced bands, and the shortest their buckets allow.
  local wait, most = 0, nil
  for i = 1, n do
    local t = bands[i]
    if not t[7] and not t[6] then
      if t[16] and t[8] > 0 then
        if t[8] > wait then
          wait = t[8]
        end
        if not most or t[16] < most then
          most = t[16]
        end
      else
        wait = false
        break
      end
    end
  end
  if wait and wait <= most then
    local at, values, lasts, enforced, shadowed = now + wait, {}, {}, true, true
    for i = 1, n do
      local t = bands[i]
      local value, last = place(t, at)
      if not value then
        if not t[6] then
          enforced = false
          break
        end
        shadowed = false
      end
      values[i], lasts[i] = value, last
    end
    if enforced then
      allowed, shadow_allowed, after = true, shadowed, wait
      for i = 1, n do
        bands[i][7], bands[i][17] = values[i], lasts[i]
      end
    end
  end
end

-- Pass 2: commit when admitted, and report. A waiting request's bands report their figures
-- once its places are taken.
local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now, after}
for i = 1, n do
  local t = bands[i]
  local commit = t[7] and allowed and (not t[6] or shadow_allowed)
  if commit then
    if t[1] then
      t[1](t[13], t[7], t[2], t[3], t[4], t[5], t[17])
    end
    local rem, reset = t[11], t[12]
    if after > 0 then
      -- The figures once the place is taken: from the debt, or the band's state read again.
      local _
      if t[14] == TOKEN_BUCKET or t[14] == LEAKY_BUCKET then
        _, _, rem, reset = gcra(t[7], 0, 1, t[3], t[4], t[5])
      else
        local eval = algorithm_functions(t[14])
        _, _, rem, reset = eval(t[13], t[2], t[3], t[4], t[5])
      end
    end
    reply[#reply + 1] = 1
    reply[#reply + 1] = rem
    reply[#reply + 1] = reset
    reply[#reply + 1] = 0
  else
    reply[#reply + 1] = t[7] and 1 or 0
    reply[#reply + 1] = t[9]
    reply[#reply + 1] = t[10]
    reply[#reply + 1] = t[8]
  end
end
-- A waiting request's marks, or a call's that asks for them: each committed token or leaky
-- band's state, its instant and remainder, which a refund of the place expects to find.
if after > 0 or marks then
  for i = 1, n do
    local t = bands[i]
    local tat, frac = 0, 0
    if (t[14] == TOKEN_BUCKET or t[14] == LEAKY_BUCKET) and t[7] and allowed and (not t[6] or shadow_allowed) then
      local whole = idiv(t[7], t[4])
      tat, frac = now + whole, t[7] - whole * t[4]
    end
    reply[#reply + 1] = tat
    reply[#reply + 1] = frac
  end
end
-- A committed token-bucket rule: its bands' new instants in one write, the key outliving
-- its longest window, or the furthest instant a waiting request put in it, by one second.
for _, rule in ipairs(rules) do
  if allowed and (not rule[5] or shadow_allowed) then
    local states, window = {}, 0
    for i = 1, rule[4] do
      local t = bands[rule[3] + i - 1]
      states[i] = state_of(t[7], t[4])
      local longest = math.max(t[3] * t[5], t[7]) / t[4]
      if longest > window then
        window = longest
      end
    end
    local value, ms = with_kept_bands(rule_value(rule[2], states, rule[4]), px(window), rule[6], now)
    redis.call('SET', rule[1], value, 'PX', ms)
  end
end
return reply
