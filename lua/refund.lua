-- FluxGate refund: gives back what a request consumed in some hash slots of a Redis
-- Cluster when another slot rejected it, so that a rejected request consumes nothing; and
-- a dropped waiting request's place, and a lease's unused permits.
-- KEYS, ARGV and the reply: README.md, "The refund call". Each algorithm's file says how
-- it gives a request back (its `*_refund`); the reply describes each band after it.

-- ARGV's decimal numbers are converted by the arithmetic (`s + 0`): one strtod each, where
-- tonumber makes two.
local decided = ARGV[1] + 0
local reply = {}
local arg = 3
-- The call's mark, its last key, set for ARGV's last number of ms (0: the call has no
-- mark): a call run again (a client writes a command again when its connection dropped
-- before the reply) finds it set and gives nothing back a second time; it still answers
-- each band's figures.
local bands, fresh = #KEYS, true
if ARGV[#ARGV] ~= '0' then
  bands = #KEYS - 1
  fresh = redis.call('SET', KEYS[#KEYS], '1', 'NX', 'PX', ARGV[#ARGV])
end
-- ARGV[2]: when the permits were taken (the decision's now_us; at or before `decided`, a
-- waiting request's later instant). Taken before this server started (a restart that lost
-- its data, a failover to a server that never held them), they were counted in counters
-- this server does not hold: given back, they would free permits that requests counted
-- here took. Nothing goes back then. INFO gives the second the server started in (its
-- clock's second less its uptime, both of one reading; TIME's where INFO has no clock): a
-- decision made in that second may have come before the start, and counts as before it.
-- Where the start cannot be read (a user without INFO, which ACLs class as @dangerous; a
-- server whose INFO has no uptime), the refund goes back as it would without the check:
-- failing it, or giving nothing back, would lose every refund in normal operation.
local info = redis.pcall('INFO', 'server')
if type(info) == 'string' then
  local uptime = string.match(info, 'uptime_in_seconds:(%d+)')
  local clock = string.match(info, 'server_time_usec:(%d+)') or now
  if uptime and ARGV[2] + 0 < (floor(clock / 1000000) - uptime + 1) * 1000000 then
    fresh = false
  end
end
for i = 1, bands do
  local key = KEYS[i]
  local algorithm = ARGV[arg] + 0
  local permits = ARGV[arg + 1] + 0
  if not fresh then
    permits = 0 -- given back already
  end
  local c, a, b = ARGV[arg + 2] + 0, ARGV[arg + 3] + 0, ARGV[arg + 4] + 0
  arg = arg + 5
  local rem, reset
  if algorithm == TOKEN_BUCKET then
    -- The band's rule: its layout, the band's position in it and its band count; then the
    -- state expected of it, or '' (see token_bucket_refund).
    local layout, index, count = ARGV[arg], ARGV[arg + 1] + 0, ARGV[arg + 2] + 0
    local expect = ARGV[arg + 3]
    arg = arg + 4
    rem, reset = token_bucket_refund(key, layout, index, count, permits, c, a, b, expect, decided)
  else
    local eval, _, refund = algorithm_functions(algorithm)
    local expect = ''
    if algorithm == LEAKY_BUCKET then
      -- As a token bucket's `expect` (token_bucket_refund), the state in decimal,
      -- "<instant>:<remainder>": '', the whole cost; a state (a waiting request's place, a
      -- lease), only while the band holds it; '~' and the state the request left (a refund
      -- across cluster slots, made at once), its permits still to leak. A leaky bucket's
      -- instant moves by whole intervals only, so that its leak grid stays put.
      expect = ARGV[arg]
      arg = arg + 1
    end
    if expect == '' then
      refund(key, decided, permits, c, a, b)
    elseif string.sub(expect, 1, 1) == '~' then
      -- The request's permits leak one interval apart on the band's grid, the first at the
      -- first grid point after its decision at the earliest (a refund of permits before
      -- them may have moved them there since), and no later than its state says: those
      -- still to leak after now, counted the earliest way, go back. Nothing while the band
      -- holds more than its capacity (a waiting request's place pending).
      local tat, frac = tat_of(key)
      local want_tat, want_frac = fields(string.sub(expect, 2))
      local debt = debt_of(tat, frac, a)
      local ahead = want_tat and debt_of(want_tat, want_frac or 0, a)
      if debt and ahead and debt <= c * b then
        -- In units from now: the decision at -elapsed, the grid through the stored instant.
        local elapsed = (now - decided) * a
        local first = imod(debt + elapsed, b)
        if first == 0 then
          first = b
        end
        first = first - elapsed
        local back = permits
        if first <= 0 then
          back = permits - idiv(-first, b) - 1
        end
        local stated = cdiv(ahead, b)
        if stated < back then
          back = stated
        end
        if back > 0 then
          refund(key, decided, back, c, a, b)
        end
      end
    else
      local tat, frac = tat_of(key)
      local want_tat, want_frac = fields(expect)
      if tat and tat == want_tat and frac == want_frac then
        refund(key, decided, permits, c, a, b)
      end
    end
    local _
    _, _, rem, reset = eval(key, 1, c, a, b)
  end
  reply[#reply + 1] = rem
  reply[#reply + 1] = reset
end
return reply
