-- FluxGate refund: gives back what a request consumed in some hash slots of a Redis
-- Cluster when another slot rejected it, so that a rejected request consumes nothing.
-- KEYS, ARGV and the reply: README.md, "The refund call". Each algorithm's file says how
-- it gives a request back (its `*_refund`); the reply describes each band after it.

local decided = tonumber(ARGV[1])
local reply = {}
local arg = 2
for _, key in ipairs(KEYS) do
  local eval, _, refund = algorithm_functions(tonumber(ARGV[arg]))
  local permits = tonumber(ARGV[arg + 1])
  local c, a, b = tonumber(ARGV[arg + 2]), tonumber(ARGV[arg + 3]), tonumber(ARGV[arg + 4])
  arg = arg + 5
  refund(key, decided, permits, c, a, b)
  local _, _, rem, reset = eval(key, 1, c, a, b)
  reply[#reply + 1] = rem
  reply[#reply + 1] = reset
end
return reply
