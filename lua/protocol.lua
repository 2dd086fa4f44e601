-- FluxGate: the names of the numbers the caller puts in ARGV, shared by the decision and
-- refund scripts. README.md ("Protocol") lays out ARGV and the replies field by field;
-- the Rust side encodes the same values in one place (src/protocol.rs).
--
-- Plain locals, not a table: they cost nothing per call.

-- The algorithm of a bucket.
local TOKEN_BUCKET = 0
local LEAKY_BUCKET = 1
local FIXED_WINDOW = 2
local SLIDING_WINDOW_LOG = 3
local SLIDING_WINDOW_COUNTER = 4

-- The flags of a bucket: band count * FLAG_BANDS + algorithm * FLAG_ALGORITHM, plus
-- FLAG_SHADOW when its rule is in shadow mode and FLAG_WAITS when the request may wait for
-- it (decide.lua: its longest wait follows).
local FLAG_SHADOW = 1
local FLAG_ALGORITHM = 2
local FLAG_WAITS = 16
local FLAG_BANDS = 32

-- decide.lua's ARGV[1]: the bucket count, plus CALL_MARKS when the reply is to give each
-- band's mark even for a request admitted at once (a lease's call).
local CALL_MARKS = 65536
