-- FluxGate: the dispatch from an algorithm's number in ARGV (protocol.lua) to its
-- functions, for decide.lua and refund.lua. Each algorithm's file defines them:
--   eval(key, permits, capacity, a, b): what the band would do (see token_bucket.lua);
--   store(key, value, permits, capacity, a, b, last): commits what eval returned (`last`, its
--     7th value for a window algorithm, the instant the state must outlive);
--   refund(key, decided_us, permits, capacity, a, b): gives a committed request back.
-- A request that waits for the refill takes its places in decide.lua ("Waiting for the
-- refill"), on that path only.
-- The token bucket keeps one key per rule, not per band: decide.lua and refund.lua call its
-- functions (token_bucket.lua) themselves.
--
-- A function rather than a table of tables: Redis runs a script from the top on every
-- call, and comparing a number costs less than building six tables each time.

local function algorithm_functions(algorithm)
  if algorithm == LEAKY_BUCKET then
    return leaky_bucket_eval, gcra_store, leaky_bucket_refund
  elseif algorithm == FIXED_WINDOW then
    return fixed_window_eval, fixed_window_store, fixed_window_refund
  elseif algorithm == SLIDING_WINDOW_LOG then
    return sliding_window_log_eval, sliding_window_log_store, sliding_window_log_refund
  elseif algorithm == SLIDING_WINDOW_COUNTER then
    return sliding_window_counter_eval, sliding_window_counter_store, sliding_window_counter_refund
  end
  return error('FluxGate: unknown algorithm ' .. tostring(algorithm))
end
