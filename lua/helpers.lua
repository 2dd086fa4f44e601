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

-- The counts of the windows ending at e - w, e and e + w (now's window ends at e), from a
-- state that counts a, b and c (nil for none) in those ending at stored_end - w,
-- stored_end and stored_end + w: the same windows, or those the state's have become since.
-- The window algorithms' states (fixed_window.lua, sliding_window_counter.lua) and the
-- places of waiting requests (decide.lua) read their counts through it.
local function window_counts(stored_end, e, w, a, b, c)
  if stored_end == e then
    return a or 0, b or 0, c or 0
  elseif stored_end == e - w then
    return b or 0, c or 0, 0
  elseif stored_end == e - 2 * w then
    return c or 0, 0, 0
  end
  return 0, 0, 0
end

-- The end of the window of `w` microseconds (aligned on the Unix epoch) holding the
-- instant `t`, now by default.
local function window_end(w, t)
  t = t or now
  return t - imod(t, w) + w
end

-- Now's window for a window state whose window ends at `stored_end` (nil: none): its end
-- and the instant the band takes for now. Redis's clock may go back (a step of the
-- server's clock, a failover to a replica whose clock is behind): a state whose window lies
-- ahead of now's is never read as empty nor moved back, which would count afresh what its
-- window already counted. Its window stays the current one, from its start.
local function current_window(w, stored_end)
  local e = window_end(w)
  if stored_end and stored_end > e then
    return stored_end, stored_end - w
  end
  return e, now
end
