-- FluxGate: helpers of the window algorithms, the leaky bucket and the refunds (see
-- common.lua for how the scripts are put together).

-- a mod b, in [0, b), also for a negative a.
local function imod(a, b)
  return a - idiv(a, b) * b
end

-- The numbers of a stored value "a:b:c:d" (one to four of them).
local function fields(v)
  local a, b, c, d = string.match(v, '^(%d+):?(%d*):?(%d*):?(%d*)$')
  if not a then
    return nil
  end
  -- Converted by the arithmetic: one strtod each, where tonumber makes two.
  return a + 0, b ~= '' and b + 0 or nil, c ~= '' and c + 0 or nil, d ~= '' and d + 0 or nil
end

-- The end of the window of `w` microseconds (aligned on the Unix epoch) holding the
-- instant `t`, now by default.
local function window_end(w, t)
  t = t or now
  return t - imod(t, w) + w
end
