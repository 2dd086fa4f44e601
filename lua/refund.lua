-- FluxGate refund: gives back what a request consumed in some hash slots of a Redis
-- Cluster when another slot rejected it, so that a rejected request consumes nothing.
-- KEYS, ARGV and the reply: README.md, "The refund call". Each algorithm's file says how
-- it gives a request back (its `*_refund`); the reply describes each band after it.

local decided = tonumber(ARGV[1])
local reply = {}
local arg = 2
for _, key in ipairs(KEYS) do
  local algorithm = tonumber(ARGV[arg])
  local permits = tonumber(ARGV[arg + 1])
  local c, a, b = tonumber(ARGV[arg + 2]), tonumber(ARGV[arg + 3]), tonumber(ARGV[arg + 4])
  arg = arg + 5
  local rem, reset
  if algorithm == TOKEN_BUCKET then
    -- The band's rule: its layout, the band's position in it and its band count; then the
    -- state expected of it, or '' (see token_bucket_refund).
    local layout, index, count = ARGV[arg], tonumber(ARGV[arg + 1]), tonumber(ARGV[arg + 2])
    local expect = ARGV[arg + 3]
    arg = arg + 4
    rem, reset = token_bucket_refund(key, layout, index, count, permits, c, a, b, expect)
  else
    local eval, _, refund = algorithm_functions(algorithm)
    refund(key, decided, permits, c, a, b)
    local _
    _, _, rem, reset = eval(key, 1, c, a, b)
  end
  reply[#reply + 1] = rem
  reply[#reply + 1] = reset
end
return reply
