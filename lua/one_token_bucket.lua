-- FluxGate decision, the common case: a request of one token-bucket rule of one band
-- (exact GCRA, as token_bucket.lua), a script of its own. Redis runs a script from its
-- first line on every call and converts every number it is given, so this one defines no
-- function, builds no table but its reply, and converts as few numbers as it can, in
-- hexadecimal (strtoul instead of strtod). Enforced or shadow, one band decides alike (it
-- consumes when it admits): the script need not know which.
--
-- KEYS[1]: the rule's key. ARGV: the rule's layout (token_bucket.lua, "State"), then in
-- hexadecimal the band's capacity in units and the request's cost in units, then the
-- key's expiry in ms (the window and the request's longest wait plus one second, in
-- decimal, passed to PSETEX as it came),
-- then the scale in hexadecimal, left out when it is 1 unless a wait follows, then the
-- longest the request may wait for the band in µs, in hexadecimal, left out when it may
-- not wait.
-- Reply: now_us and the band's debt before the request; the caller derives the decision,
-- the wait and the band's figures from them. README.md, "The one-band call".

-- offset: the layout's length in decimal, where the band's state starts in the value; a
-- rule's own script has it written in, this one writes it when it needs it.
local key, layout, offset = KEYS[1], ARGV[1], nil
local cap, cost, ttl, scale, wait = tonumber(ARGV[2], 16), tonumber(ARGV[3], 16), ARGV[4], ARGV[5], ARGV[6]
scale = scale and tonumber(scale, 16) or 1
-- The strings of TIME converted by the arithmetic: once each, where tonumber converts a
-- decimal string twice (to check it, then to read it), each a strtod.
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]

-- The debt: how far the stored instant lies ahead of now, in units. It exceeds cap when
-- requests wait for a later instant (their places are taken) or the rule has changed.
local debt, ahead = 0, 0
-- The bands of another version of the rule the key holds, kept with this one (layout.lua):
-- their names, their states (each after a `|`) and their furthest instant.
local kept_names, kept_states, kept_last
-- The most permits the bands of another version of the rule of the band's name and window
-- hold in use, as the µs the band's instant would lie ahead of now for as many (layout.lua):
-- the band counts at least as many.
local seed
-- Whether the key holds this layout, and then the instant before which a new instant may
-- keep the key's expiry: see the write below.
local own_layout, keep_before
local v = redis.call('GET', key)
if v then
  if string.find(v, layout, 1, true) == 1 then
    v = string.sub(v, #layout + 1)
    own_layout = true
  else
    -- The rule changed since the write, or another instance holds another version of it:
    -- the band's state if the stored layout names it, and the other bands still holding
    -- permits, kept (layout.lua's matching_states, for one band, inline: no function on
    -- the common path).
    local bar = string.find(v, '|', 1, true) or #v
    local tag, at, s, count = string.sub(layout, 1, #layout - 1), bar + 1, nil, 0
    local own, capacity = string.match(tag, '^([^:]*):(%d+)/')
    local window = own and string.sub(tag, #own + #capacity + 2)
    for name in string.gmatch(string.sub(v, 1, bar - 1), '[^,]+') do
      local next_bar = string.find(v, '|', at, true)
      local state = string.sub(v, at, (next_bar or 0) - 1)
      if name == tag then
        s = state
      elseif state ~= '' then
        local t, f = tonumber(state, 16), 0
        if not t then
          local colon = string.find(state, ':', 1, true)
          if colon then
            t, f = tonumber(string.sub(state, 1, colon - 1), 16), tonumber(string.sub(state, colon + 1), 16)
          end
        end
        if t and f and (t > now or (t == now and f > 0)) then
          -- A band of the band's name and window: the permits it holds in use, as the µs
          -- the band's instant would lie ahead for as many (a remainder counted as a µs).
          local band, c = string.match(name, '^([^:]*):(%d+)/')
          if band == own and band and string.sub(name, #band + #c + 2) == window then
            local used = (t - now + (f > 0 and 1 or 0)) * c / capacity
            if not seed or used > seed then
              seed = used
            end
          end
          if count < 16 then
            count = count + 1
            kept_names = kept_names and kept_names .. ',' .. name or name
            kept_states = (kept_states or '') .. '|' .. state
            if not kept_last or t > kept_last then
              kept_last = t
            end
          end
        end
      end
      if not next_bar then
        break
      end
      at = next_bar + 1
    end
    v = s
  end
end
if v and v ~= '' then
  local tat, frac = tonumber(v, 16), 0
  if not tat then
    local colon = string.find(v, ':', 1, true)
    tat, frac = tonumber(string.sub(v, 1, colon - 1), 16), tonumber(string.sub(v, colon + 1), 16)
  end
  if tat > now or (tat == now and frac > 0) then
    ahead = (tat - now) * scale
    debt = ahead + frac
  end
  if own_layout then
    keep_before = tat - tat % 1000000 + 900000
  end
end
if seed then
  -- At least the permits the other version's band holds in use, at most the capacity; its
  -- instant then lies where that debt puts it.
  seed = seed * scale
  seed = seed - seed % 1 + (seed % 1 > 0 and 1 or 0)
  if seed > cap then
    seed = cap
  end
  if seed > debt then
    debt, ahead = seed, seed - seed % scale
  end
end

local d = debt + cost
-- Admitted now; or, when the request may wait, at the instant the band admits it (`d -
-- cap` units ahead, rounded up to the µs), if that is at most `wait` µs ahead and the
-- stored instant already lies at or past it: the place is taken now either way.
if d <= cap or (wait and d - cap <= tonumber(wait, 16) * scale and ahead >= d - cap) then
  -- The instant moves d units ahead of now (a floor division, x - x % 1, corrected by one
  -- when the double quotient is off).
  local whole = d / scale
  whole = whole - whole % 1
  if whole * scale > d then
    whole = whole - 1
  elseif (whole + 1) * scale <= d then
    whole = whole + 1
  end
  local frac = d - whole * scale
  local at = now + whole
  -- The value; or, for an instant written by `bit.tohex`, its 13 digits alone (the value is
  -- the layout and them).
  local value, digits
  if frac ~= 0 then
    value = string.format('%s%x:%x', layout, at, frac)
  else
    -- The instant in hexadecimal: as its high 5 and low 8 digits by `bit.tohex` (LuaBitOp,
    -- in every Redis), the same 13 digits `%x` writes for the instants of 1978 to 2112,
    -- without the C library's formatting; `%x` for any other.
    local low = at % 4294967296
    local high = (at - low) / 4294967296
    if high >= 65536 and high < 1048576 then
      digits = bit.tohex(high, 5) .. bit.tohex(low, 8)
    else
      value = string.format('%s%x', layout, at)
    end
  end
  if kept_names then
    -- layout.lua's with_kept_bands, inline.
    value = string.sub(layout, 1, #layout - 1) .. ',' .. kept_names .. '|' .. (digits or string.sub(value, #layout + 1)) .. kept_states
    local least = (kept_last - now - (kept_last - now) % 1000) / 1000 + 1001
    if least > ttl + 0 then
      ttl = string.format('%d', least)
    end
    redis.call('PSETEX', key, ttl, value)
  elseif keep_before and at < keep_before then
    -- Every writer of a rule's key sets its expiry a second or more past the furthest
    -- instant it writes (this script: the window, the wait and a second; the others alike;
    -- a refund moves an instant back and keeps the expiry). So the key lives past the end of
    -- the whole second in which its stored instant lies, less the time Redis may count a
    -- relative expiry from before this script read TIME (a few ms at most when measured).
    -- A new instant 100 ms or more before that end needs no new expiry, and the same then
    -- holds for the next write: the write keeps the expiry (PSETEX removes the expiry, sets
    -- it again and rewrites the command for replication). A key decided more than once a
    -- second, the common case under load, is mostly written so; its key then outlives its
    -- state by 100 ms or more, not a second.
    -- A write refused (a Redis user allowed only the commands of earlier releases, ACL; a
    -- full Redis) is made as every release makes it, which fails the call if refused too.
    if digits and #v == 13 then
      -- The stored state is 13 characters after the layout, as the new one: its
      -- characters are replaced in place, which keeps the expiry too and costs Redis less
      -- than a new value (SETRANGE; its reply the value's length, where SET's is a table).
      if redis.pcall('SETRANGE', key, offset or string.format('%d', #layout), digits) ~= #layout + 13 then
        redis.call('PSETEX', key, ttl, layout .. digits)
      end
    elseif redis.pcall('SET', key, value or layout .. digits, 'KEEPTTL').err then
      redis.call('PSETEX', key, ttl, value or layout .. digits)
    end
  else
    redis.call('PSETEX', key, ttl, value or layout .. digits)
  end
end
return {now, debt}
