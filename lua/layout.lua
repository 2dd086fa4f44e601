-- FluxGate: the layout of a token-bucket rule's key, shared by the general scripts (before
-- token_bucket.lua) and token_buckets.lua. A rule is one key, "<layout>|<s1>|<s2>...": the
-- layout names its bands ("<band>:<capacity>/<window>", joined by commas), then come their
-- states (token_bucket.lua, "State"). The scripts read the states by position when the
-- stored layout is the one the caller sent; after the rule changed, this matches them by
-- name.

-- The states of a stored rule value `v` for the bands of `layout`, matched by name: a band
-- the stored layout names keeps its state, any other starts full (nil).
local function matching_states(v, layout)
  local states = {}
  local bar = string.find(v, '|', 1, true)
  if not bar then
    return states
  end
  local stored, at = {}, bar + 1
  for name in string.gmatch(string.sub(v, 1, bar - 1), '[^,]+') do
    local next_bar = string.find(v, '|', at, true)
    stored[name] = string.sub(v, at, (next_bar or 0) - 1)
    if not next_bar then
      break
    end
    at = next_bar + 1
  end
  local i = 1
  for name in string.gmatch(string.sub(layout, 1, #layout - 1), '[^,]+') do
    states[i] = stored[name]
    i = i + 1
  end
  return states
end

