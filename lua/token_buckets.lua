-- FluxGate decision when every rule of the request is a token bucket: every band of every
-- rule, all or nothing, as decide.lua decides them, without the other algorithms'
-- functions, in a script of its own (after layout.lua). README.md, "The token-bucket
-- call".
--
-- A rule is one key holding all its bands (token_bucket.lua, "State"): one MGET reads every
-- rule, and one SET (with its expiry) writes each committed one. The script returns each
-- band's debt before the request and the caller derives the decision and the figures, as
-- the script does. Redis runs a script from its first line on every call and converts
-- every number it is given, so this one reads each rule once, makes two tables (the reply,
-- and each rule's new value, expiry and mode), converts each number once, in hexadecimal
-- (strtoul instead of strtod), takes no scale for a rule whose bands all have a scale of 1,
-- and writes each rule's value by concatenation.

-- The strings of TIME converted by the arithmetic: once each, where tonumber converts a
-- decimal string twice (to check it, then to read it), each a strtod.
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local values = redis.call('MGET', unpack(KEYS))

-- One pass: each band's debt (how far its instant lies ahead of now, in units; more than
-- its capacity in units when requests wait for a later instant or the rule changed) into
-- the reply; a rule admits when each of its bands does, and then
-- its new value (its layout, then each band's state after the request) and its expiry
-- (its longest window and its wait plus one second, in ms, sent by the caller; the wait
-- pass below adds its own) go into `writes`, with
-- whether it is in
-- shadow mode.
local reply = {now}
local writes = {}
local allowed, shadow_allowed, waits = true, true, false
-- Per rule, the bands of another version of it its key holds (layout.lua), when any.
local kept_bands = nil
local arg, n = 1, 1
for r = 1, #KEYS do
  local flags = tonumber(ARGV[arg], 16)
  local layout, expiry = ARGV[arg + 1], ARGV[arg + 2]
  arg = arg + 3
  if flags % 8 >= 4 then
    -- The rule lets the request wait: its longest wait, read again below if needed.
    waits, arg = true, arg + 1
  end
  local v = values[r]
  local at, states, seeds
  if v then
    if string.find(v, layout, 1, true) == 1 then
      at = #layout + 1
    else
      local kept
      states, kept, seeds = matching_states(v, layout, now)
      if kept then
        kept_bands = kept_bands or {}
        kept_bands[r] = kept
      end
    end
  end
  local value = layout
  local scaled = flags % 4 >= 2
  for i = 1, (flags - flags % 8) / 8 do
    local cap, cost, scale = tonumber(ARGV[arg], 16), tonumber(ARGV[arg + 1], 16), 1
    if scaled then
      scale = tonumber(ARGV[arg + 2], 16)
      arg = arg + 3
    else
      arg = arg + 2
    end
    local s
    if at then
      local bar = string.find(v, '|', at, true)
      s = string.sub(v, at, (bar or 0) - 1)
      at = bar and bar + 1
    elseif states then
      s = states[i]
    end
    local debt = 0
    if s and s ~= '' then
      local tat, frac = tonumber(s, 16), 0
      if not tat then
        local colon = string.find(s, ':', 1, true)
        tat, frac = tonumber(string.sub(s, 1, colon - 1), 16), tonumber(string.sub(s, colon + 1), 16)
      end
      if tat > now or (tat == now and frac > 0) then
        debt = (tat - now) * scale + frac
      end
    end
    if seeds and seeds[i] then
      -- The permits another version's band of its name and window holds in use
      -- (layout.lua), at most the capacity: the band counts at least as many.
      local least = seeds[i] * scale
      least = least - least % 1 + (least % 1 > 0 and 1 or 0)
      if least > cap then
        least = cap
      end
      if least > debt then
        debt = least
      end
    end
    n = n + 1
    reply[n] = debt
    local d = debt + cost
    if d > cap then
      value = false
    elseif value then
      -- The band's state after the request: the floor of d / scale, the double quotient
      -- corrected by one when it is off, and the remainder (inline: a function defined
      -- here would cost every call).
      local whole = d / scale
      whole = whole - whole % 1
      if whole * scale > d then
        whole = whole - 1
      elseif (whole + 1) * scale <= d then
        whole = whole + 1
      end
      local frac = d - whole * scale
      if i > 1 then
        value = value .. '|'
      end
      if frac == 0 then
        value = value .. string.format('%x', now + whole)
      else
        value = value .. string.format('%x:%x', now + whole, frac)
      end
    end
  end
  local shadow = flags % 2 == 1
  if not value then
    if shadow then
      shadow_allowed = false
    else
      allowed = false
    end
  end
  writes[3 * r - 2], writes[3 * r - 1], writes[3 * r] = value, expiry, shadow
end

-- Some enforced band refused: when every refusing one lets the request wait until the
-- last of them admits it (its rule's longest wait, in µs) and every band admits it then,
-- `off` µs ahead, the request takes its place there now, all or nothing, as the in-memory
-- limiter does. A band admits it there when its stored instant lies at or past that
-- instant (so no bucket jumps ahead for it) and `debt + cost - off × scale <= cap`; a
-- shadow rule that does not is left as it is. Every band's state becomes `debt + cost`
-- ahead of now, as after an admission. The caller derives the same from the debts.
if not allowed and waits then
  -- A band's state `d` units ahead of now, as in the loop above.
  local function state_after(d, scale)
    local whole = d / scale
    whole = whole - whole % 1
    if whole * scale > d then
      whole = whole - 1
    elseif (whole + 1) * scale <= d then
      whole = whole + 1
    end
    local frac = d - whole * scale
    if frac == 0 then
      return string.format('%x', now + whole)
    end
    return string.format('%x:%x', now + whole, frac)
  end
  -- Each band in turn: visit(rule, band, layout, shadow, wait, cap, cost, scale, debt),
  -- ARGV read as above.
  local function each_band(visit)
    local a, b = 1, 1
    for r = 1, #KEYS do
      local flags, layout, wait = tonumber(ARGV[a], 16), ARGV[a + 1], nil
      a = a + 3
      if flags % 8 >= 4 then
        wait, a = tonumber(ARGV[a], 16), a + 1
      end
      local scaled = flags % 4 >= 2
      for i = 1, (flags - flags % 8) / 8 do
        local scale = scaled and tonumber(ARGV[a + 2], 16) or 1
        b = b + 1
        visit(r, i, layout, flags % 2 == 1, wait, tonumber(ARGV[a], 16), tonumber(ARGV[a + 1], 16), scale, reply[b])
        a = a + (scaled and 3 or 2)
      end
    end
  end
  local off, may, most = 0, true, nil
  each_band(function(_, _, _, shadow, wait, cap, cost, scale, debt)
    local excess = debt + cost - cap
    if excess > 0 and not shadow then
      if wait and excess <= wait * scale then
        if not most or wait < most then
          most = wait
        end
        -- ⌈excess / scale⌉ µs, the double quotient corrected by one when it is off.
        local q = excess / scale
        q = q - q % 1
        if q * scale > excess then
          q = q - 1
        elseif (q + 1) * scale < excess then
          q = q + 1
        end
        if q * scale < excess then
          q = q + 1
        end
        if q > off then
          off = q
        end
      else
        may = false
      end
    end
  end)
  if may and off <= most then
    allowed, shadow_allowed = true, true
    each_band(function(r, i, layout, shadow, _, cap, cost, scale, debt)
      local value = i == 1 and layout or writes[3 * r - 2]
      if debt - debt % scale >= off * scale and debt + cost - off * scale <= cap then
        if value then
          value = (i == 1 and value or value .. '|') .. state_after(debt + cost, scale)
        end
      elseif value then
        value = false
        if shadow then
          shadow_allowed = false
        else
          allowed = false
        end
      end
      writes[3 * r - 2] = value
    end)
    -- A state now lies up to `off` µs further ahead than a window: each key outlives it.
    local extra = (off - off % 1000) / 1000 + 1
    for r = 1, #KEYS do
      writes[3 * r - 1] = writes[3 * r - 1] + extra
    end
  end
end

-- When the enforced rules admitted, one write per rule to commit (a shadow rule only when
-- every shadow rule admitted), the key outliving the rule's longest window by one second.
if allowed then
  for r = 1, #KEYS do
    local value, expiry = writes[3 * r - 2], writes[3 * r - 1]
    if value and (shadow_allowed or not writes[3 * r]) then
      if kept_bands then
        value, expiry = with_kept_bands(value, expiry, kept_bands[r], now)
      end
      redis.call('PSETEX', KEYS[r], expiry, value)
    end
  end
end
return reply
