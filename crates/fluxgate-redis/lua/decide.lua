-- FluxGate decision: every band of every bucket of one request, all or nothing, whatever
-- the algorithm of each rule. (The single-band token bucket never gets here: see
-- fast_path.lua.)
--
-- KEYS: one key per band, bucket by bucket, band by band.
-- ARGV: [1] number of buckets; then per bucket: permits, and
--       band count * 16 + algorithm * 2 + shadow (0|1), algorithm being 0 token_bucket,
--       1 leaky_bucket, 2 fixed_window, 3 sliding_window_log, 4 sliding_window_counter;
--       then per band of that bucket three numbers, as its algorithm file says.
--
-- Pass 1 evaluates every band without writing. Enforced buckets are all or nothing.
-- Shadow buckets consume only when the enforced ones admitted and every shadow band
-- admits too. Nothing is written on rejection.
--
-- Returns: {allowed, shadow_allowed, now_us, then per band:
--           allowed (0|1), remaining, reset_after_us, wait_us (0 = none, -1 = never)}
-- remaining and reset_after_us describe the band after the decision.

local EVAL = {
  [0] = token_bucket_eval, leaky_bucket_eval, fixed_window_eval,
  sliding_window_log_eval, sliding_window_counter_eval,
}
local STORE = {
  [0] = gcra_store, gcra_store, fixed_window_store,
  sliding_window_log_store, sliding_window_counter_store,
}

-- Pass 1: evaluate every band.
local bands = {}
local allowed, shadow_allowed = true, true
local arg, n = 2, 0
for _ = 1, tonumber(ARGV[1]) do
  local permits = tonumber(ARGV[arg])
  local flags = tonumber(ARGV[arg + 1])
  local shadow = flags % 2 == 1
  local algorithm = floor(flags / 2) % 8
  arg = arg + 2
  for _ = 1, floor(flags / 16) do
    local c, a, b = tonumber(ARGV[arg]), tonumber(ARGV[arg + 1]), tonumber(ARGV[arg + 2])
    arg = arg + 3
    n = n + 1
    local value, wait, rem, reset, rem_after, reset_after = EVAL[algorithm](KEYS[n], permits, c, a, b)
    if not value then
      if shadow then shadow_allowed = false else allowed = false end
    end
    bands[n] = {algorithm, permits, c, a, b, shadow, value, wait, rem, reset, rem_after, reset_after}
  end
end

-- Pass 2: commit when admitted, and report.
local reply = {allowed and 1 or 0, shadow_allowed and 1 or 0, now}
for i = 1, n do
  local t = bands[i]
  local commit = t[7] and allowed and (not t[6] or shadow_allowed)
  if commit then
    STORE[t[1]](KEYS[i], t[7], t[2], t[3], t[4], t[5])
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
