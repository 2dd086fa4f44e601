-- FluxGate batched decision of one rule, the common case: requests of one token-bucket
-- rule of one band, gathered in one batch, decided one after the other in the order they
-- came by the rule's own script. The crate writes, per rule (src/rule_script.rs), the
-- batch's clock read once (batch_now), then one_token_bucket.lua as a function
-- `decide(key, cost)` with the rule's layout, capacity, expiry, scale and wait written in
-- as constants (its two lines that read TIME become `local now = batch_now`, and it
-- returns its band's debt alone), then this file. README.md, "A rule's own batch script".
--
-- No header, no argument list: every request is of the same rule, of one key. KEYS: each
-- request's key in turn. ARGV: each request's cost in units, in hexadecimal; or one cost,
-- every request's. Reply: the batch's now_us, then per request, in order, its band's debt
-- before the request (a number), or the error its decision raised (a string: a request's
-- error leaves its neighbours decided).

local reply, cost = {batch_now}, #ARGV == 1 and tonumber(ARGV[1], 16)
for i = 1, #KEYS do
  local ok, r = pcall(decide, KEYS[i], cost or tonumber(ARGV[i], 16))
  if ok then
    reply[i + 1] = r
  else
    reply[i + 1] = type(r) == 'table' and tostring(r.err) or tostring(r)
  end
end
return reply
