-- FluxGate decision, the common case: one bucket of one token-bucket band (the arguments
-- of decide.lua with one bucket whose flags are ONE_TOKEN_BUCKET_BAND or
-- ONE_SHADOW_TOKEN_BUCKET_BAND, see protocol.lua). It comes right after token_bucket.lua
-- in the decision script, so that it returns before the other algorithms' functions are
-- even created: a call costs what a token-bucket-only script would. Its reply is
-- decide.lua's, for one band.

-- The admission test of gcra() inline, and gcra() itself only for the figures of a
-- rejection.
if ARGV[1] == '1' and (ARGV[3] == ONE_TOKEN_BUCKET_BAND or ARGV[3] == ONE_SHADOW_TOKEN_BUCKET_BAND) then
  local key, permits, capacity = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[4])
  local scale, interval = tonumber(ARGV[5]), tonumber(ARGV[6])
  local cap = capacity * interval
  local tat, frac = tat_of(key)
  local debt = debt_of(tat, frac, scale) or 0
  if debt > cap then
    debt = cap
  end
  local d = debt + permits * interval
  if permits <= capacity and d <= cap then
    gcra_store(key, d, permits, capacity, scale, interval)
    return {1, 1, now, 1, idiv(cap - d, interval), cdiv(d, scale), 0}
  end
  local _, wait, rem, reset = gcra(debt, 0, permits, capacity, scale, interval)
  local shadow = ARGV[3] == ONE_SHADOW_TOKEN_BUCKET_BAND
  return {shadow and 1 or 0, shadow and 0 or 1, now, 0, rem, reset, wait}
end
