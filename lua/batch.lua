-- FluxGate batched decision: the requests one instance sends together, decided one after
-- the other in the order they came, each all or nothing as its own script would decide it
-- alone. The build script puts before this file the three decision scripts, each as a
-- function of its own keys and arguments (decide_one, decide_token_buckets,
-- decide_general), and reads the clock once for the batch: each of those scripts' two
-- lines that read `TIME` and convert it to `now` becomes `local now = batch_now`.
-- README.md, "The batch call".
--
-- Requests of the same rules have the same arguments: each distinct list of arguments is
-- sent once. ARGV: the number of lists, each list as its length then its arguments; then
-- one header per request, in order. A header is one number: script + 4 * keys + 1024 *
-- list, its script (1 one token-bucket band, 2 token buckets, 3 general), its number of
-- keys (below 256) and its list (from 0). The numbers are hexadecimal. KEYS: each
-- request's keys in turn. Reply: the batch's now_us, then per request, in order, the length
-- of its script's reply then that reply; for the one-band call, whose reply here is its
-- band's debt alone (the build script drops its now_us, which the batch's reply holds
-- once), -2 then that debt; or -1 then the error that request's script raised (a request's
-- error leaves its neighbours decided).

local scripts = {decide_one, decide_token_buckets, decide_general}
local lists, a = {}, 2
for i = 1, tonumber(ARGV[1], 16) do
  local length, list = tonumber(ARGV[a], 16), {}
  -- A loop, not unpack: a list may hold more values than Lua's stack.
  for j = 1, length do
    list[j] = ARGV[a + j]
  end
  lists[i] = list
  a = a + 1 + length
end
-- One table of keys, refilled for each request (the scripts only read theirs).
local keys, kept = {}, 0
local reply, n, k, last = {batch_now}, 1, 1, #ARGV
while a <= last do
  local header = tonumber(ARGV[a], 16)
  local script, key_count = header % 4, (header % 1024 - header % 4) / 4
  local list = (header - header % 1024) / 1024
  for i = 1, key_count do
    keys[i] = KEYS[k + i - 1]
  end
  for i = key_count + 1, kept do
    keys[i] = nil
  end
  kept, k, a = key_count, k + key_count, a + 1
  local ok, r = pcall(scripts[script], keys, lists[list + 1])
  if not ok then
    reply[n + 1] = -1
    reply[n + 2] = type(r) == 'table' and tostring(r.err) or tostring(r)
    n = n + 2
  elseif type(r) == 'number' then
    -- The one-band call's debt: no table made or copied for it.
    reply[n + 1] = -2
    reply[n + 2] = r
    n = n + 2
  else
    n = n + 1
    reply[n] = #r
    for i = 1, #r do
      reply[n + i] = r[i]
    end
    n = n + #r
  end
end
return reply
