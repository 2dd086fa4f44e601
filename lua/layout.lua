-- FluxGate: the layout of a token-bucket rule's key, shared by the general scripts (before
-- token_bucket.lua) and token_buckets.lua. A rule is one key, "<layout>|<s1>|<s2>...": the
-- layout names its bands ("<band>:<capacity>/<window>", joined by commas), then come their
-- states (token_bucket.lua, "State"). The scripts read the states by position when the
-- stored layout is the one the caller sent; after the rule changed, this matches them by
-- name.
--
-- Instances may hold two versions of a rule at once (a rolling change, a file each instance
-- polls, an instance whose reload failed), and both write the rule's one key. So that
-- neither refills the other's bands, a write keeps, after the caller's own bands, the
-- stored bands the caller's layout does not name while they still hold permits (their
-- instant ahead of now), at most KEPT_BANDS of them: each version counts against its own
-- bands, and a band of a version no longer written is dropped once it is full again.
--
-- A band of one name and window in two versions (its capacity changed) is one limit: a
-- caller's band counts at least the permits the other versions' bands of its name and
-- window hold in use (`(instant - now) × capacity / window` each), at most its own
-- capacity. So a client taking turns between the versions gets no more than the looser
-- one allows, rather than each version's capacity in turn; and a capacity changed on every
-- instance goes on from the permits its former band holds in use, rather than full. (A
-- band whose window changed still starts full: its former band's permits refill at the
-- former rate, which would hold a faster new band to the old one for a whole window.)

-- The most bands of other versions a rule's value keeps.
local KEPT_BANDS = 16

-- The states of a stored rule value `v` for the bands of `layout`, matched by name: a band
-- the stored layout names keeps its state, any other starts full (nil). Then the stored
-- bands `layout` does not name that still hold permits at `now` (µs): nil, or their names
-- (joined by commas), their states (each after a `|`), the furthest of their instants and
-- `layout` itself, for `with_kept_bands`. Then nil, or per band of `layout` (by position)
-- the most permits that stored bands of its name and window and another capacity hold in
-- use, as the µs its own instant would lie ahead of now for as many (`(instant - now) ×
-- their capacity / its capacity`, a remainder counted as a whole µs): the caller's band
-- counts at least that times its scale in units, rounded up, at most its capacity in units.
local function matching_states(v, layout, now)
  local states = {}
  local bar = string.find(v, '|', 1, true)
  if not bar then
    return states
  end
  local stored, order, at = {}, {}, bar + 1
  for name in string.gmatch(string.sub(v, 1, bar - 1), '[^,]+') do
    local next_bar = string.find(v, '|', at, true)
    stored[name] = string.sub(v, at, (next_bar or 0) - 1)
    order[#order + 1] = name
    if not next_bar then
      break
    end
    at = next_bar + 1
  end
  local i, own = 1, {}
  for name in string.gmatch(string.sub(layout, 1, #layout - 1), '[^,]+') do
    states[i] = stored[name]
    own[name] = true
    i = i + 1
  end
  local kept, count, in_use = nil, 0, nil
  for _, name in ipairs(order) do
    local s = stored[name]
    if not own[name] and s ~= '' then
      local t, f = tonumber(s, 16), 0
      if not t then
        local colon = string.find(s, ':', 1, true)
        if colon then
          t, f = tonumber(string.sub(s, 1, colon - 1), 16), tonumber(string.sub(s, colon + 1), 16)
        end
      end
      if t and f and (t > now or (t == now and f > 0)) then
        -- The permits it holds in use, `(t - now) × capacity / window`, by its band's name
        -- and window.
        local band, c = string.match(name, '^([^:]*):(%d+)/')
        if band then
          local same = string.sub(name, #band + #c + 2)
          local ahead = (t - now + (f > 0 and 1 or 0)) * c
          in_use = in_use or {}
          if not in_use[band .. same] or ahead > in_use[band .. same] then
            in_use[band .. same] = ahead
          end
        end
        if count < KEPT_BANDS then
          count = count + 1
          if kept then
            kept.names, kept.states = kept.names .. ',' .. name, kept.states .. '|' .. s
            if t > kept.last then
              kept.last = t
            end
          else
            kept = {names = name, states = '|' .. s, last = t, layout = layout}
          end
        end
      end
    end
  end
  local seeds = nil
  if in_use then
    i = 1
    for name in string.gmatch(string.sub(layout, 1, #layout - 1), '[^,]+') do
      local band, c = string.match(name, '^([^:]*):(%d+)/')
      local ahead = band and in_use[band .. string.sub(name, #band + #c + 2)]
      if ahead then
        seeds = seeds or {}
        seeds[i] = ahead / c
      end
      i = i + 1
    end
  end
  return states, kept, seeds
end

-- A rule's `value` (its layout, then its bands' states) with the `kept` bands of another
-- version after its own, and the expiry `ms` (ms) raised so that the key outlives their
-- furthest instant by one second, both as they were when nothing is kept.
local function with_kept_bands(value, ms, kept, now)
  if not kept then
    return value, ms
  end
  local layout = kept.layout
  value = string.sub(layout, 1, #layout - 1) .. ',' .. kept.names .. '|' .. string.sub(value, #layout + 1) .. kept.states
  local ahead = kept.last - now
  local least = (ahead - ahead % 1000) / 1000 + 1001
  if least > ms + 0 then
    ms = string.format('%d', least)
  end
  return value, ms
end
