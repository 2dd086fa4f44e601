-- FluxGate batched decision of one rule, the common case: requests of one token-bucket
-- rule of one band, gathered in one batch, decided one after the other in the order they
-- came by the rule's own script. The crate writes, per rule (src/rule_script.rs), the
-- batch's clock read once (batch_now), then one_token_bucket.lua as a function
-- `decide(key, cost, stored)` with the rule's layout, capacity, expiry, scale and wait
-- written in as constants (its two lines that read TIME become `local now = batch_now`,
-- its GET reads `stored` unless that is nil or false, and it returns its band's debt
-- alone), then this file. README.md, "A rule's own batch script".
--
-- No header, no argument list: every request is of the same rule, of one key. KEYS: each
-- request's key in turn. ARGV: in hexadecimal, how many requests' keys repeat the key of
-- an earlier request of the batch, those requests' places (from 1), then each request's
-- cost in units, or one cost, every request's. Reply: the batch's now_us, then per request,
-- in order, its band's debt before the request (a number), or the error its decision
-- raised (a string: a request's error leaves its neighbours decided).
--
-- The keys are read together, one MGET (in parts of 512, Lua's stack being bounded) rather
-- than a GET each: a command's dispatch costs Redis more than a key's lookup. A request
-- reads its key again, with a GET of its own, when an earlier request of the batch may
-- have written it (after that write), or when MGET found no string there: the key is
-- missing, or holds another type, which GET refuses (WRONGTYPE) as a call of its own does,
-- where the write would replace it.

local n, repeats = #KEYS, tonumber(ARGV[1], 16)
local first = repeats + 2
local reply, cost = {batch_now}, #ARGV == first and tonumber(ARGV[first], 16)
-- A refused MGET (a Redis user allowed only the commands of earlier releases, which read
-- each key with GET) replies an error, a table of no values: every key is then read when
-- decided, as then.
local stored = {}
if n > 0 and n <= 512 then
  stored = redis.pcall('MGET', unpack(KEYS))
elseif n > 512 then
  for from = 1, n, 512 do
    local part = redis.pcall('MGET', unpack(KEYS, from, math.min(from + 511, n)))
    for j = 1, #part do
      stored[from + j - 1] = part[j]
    end
  end
end
-- nil: read when decided.
for j = 2, repeats + 1 do
  stored[tonumber(ARGV[j], 16)] = nil
end
for i = 1, n do
  local ok, r = pcall(decide, KEYS[i], cost or tonumber(ARGV[first + i - 1], 16), stored[i])
  if ok then
    reply[i + 1] = r
  else
    reply[i + 1] = type(r) == 'table' and tostring(r.err) or tostring(r)
  end
end
return reply
