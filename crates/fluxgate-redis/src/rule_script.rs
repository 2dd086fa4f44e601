//! A rule's own one-band script: `one_token_bucket.lua` with the rule's layout, capacity,
//! key expiry, scale and longest wait written into it as constants, so that a call sends
//! the request's cost alone. Redis converts every argument of every call into a Lua string
//! in the script's `ARGV` table, and the script converts the numbers again: the constants
//! save that work (about 5,900 of 59,700 instructions of `redis-server` per call, see
//! `docs/benchmarks.md`, "A rule's own script"), and the client encodes three arguments
//! fewer.
//!
//! Each rule script has a batch script beside it, for a batch whose requests are all of
//! its rule (batched decisions, the common case): the same decision, a function of the
//! request's key and cost, the constants written in, called for each key of the batch
//! (`lua/rule_batch.lua`). The batch sends each request's key and cost alone, where the
//! shared batch script reads a header and an argument list for each (about 37,300 against
//! 29,400 instructions of `redis-server` per request, `docs/benchmarks.md`, "Batched
//! decisions").
//!
//! The scripts are kept process-wide by their constants, so that the plans of one rule on
//! every thread, and rules of the same bands, share one: at most [`MOST`]. A rule past
//! that is decided by `one_token_bucket.lua` with its arguments, as before (and batched by
//! the shared batch script), so that rules changed again and again (a reloaded rule set
//! whose capacities move) do not fill Redis's script cache. Each
//! [`Scripts`](crate::script::Scripts) loads a rule's script, and its batch script, on its
//! connections at its first call, in a task of its own that no call waits for, the calls
//! going to the shared scripts meanwhile ([`Loaded`]); Redis keeps them until it restarts
//! or `SCRIPT FLUSH` runs, after which the call that finds one missing loads it again.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use fred::types::scripts::Script;

use crate::script::ONE_TOKEN_BUCKET_LUA;

/// The rule scripts a process makes at most.
pub(crate) const MOST: usize = 256;

/// The lines of `one_token_bucket.lua` that read the rule's arguments, which a rule's
/// script replaces with its constants.
const ARGUMENTS: &str = "local key, layout, offset = KEYS[1], ARGV[1], nil
local cap, cost, ttl, scale, wait = tonumber(ARGV[2], 16), tonumber(ARGV[3], 16), ARGV[4], ARGV[5], ARGV[6]
scale = scale and tonumber(scale, 16) or 1
";

/// The loop of a rule's batch script (`lua/rule_batch.lua`), written after the rule's
/// function.
const RULE_BATCH_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/rule_batch.lua"));

/// The lines of `one_token_bucket.lua` that read the clock, which a batch reads once.
const TIME: &str = "local time = redis.call('TIME')\nlocal now = time[1] * 1000000 + time[2]\n";

/// The reply of `one_token_bucket.lua`, whose `now` a batch's reply holds once.
const REPLY: &str = "return {now, debt}\n";

/// The line of `one_token_bucket.lua` that reads the key, which a batch reads with the
/// batch's other keys, and again only for a key an earlier request of the batch may have
/// written.
const READ: &str = "local v = redis.call('GET', key)\n";

/// What a batch's function has in place of [`READ`]: the value read with the batch's
/// keys; or the key read now, when that is `nil` (a key an earlier request may have
/// written) or `false` (`MGET` found no string: the key is missing, or holds another type,
/// which `GET` refuses with `WRONGTYPE`, as in a call of its own, rather than the write
/// replacing it).
const READ_IN_BATCH: &str = "local v = stored\nif not v then\n  v = redis.call('GET', key)\nend\n";

/// A rule's one-band script, and its batch script.
#[derive(Debug)]
pub(crate) struct RuleScript {
    /// Its place among the process's rule scripts, below [`MOST`].
    id: usize,
    pub(crate) script: Script,
    /// Its batch script: the requests of a batch all of its rule, each decided in turn.
    pub(crate) batch: Script,
}

/// What a rule's one-band script holds as constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Constants<'a> {
    /// The rule's layout (`lua/token_bucket.lua`, "State").
    pub(crate) layout: &'a str,
    /// The band's capacity in units.
    pub(crate) cap: i64,
    /// The key's expiry in ms.
    pub(crate) expiry_ms: i64,
    /// The band's scale.
    pub(crate) scale: i64,
    /// The longest a request may wait for the band, in µs; 0: not at all.
    pub(crate) max_wait_us: i64,
}

/// The rule script of `constants`, the process's kept one when it has it; `None` when
/// the process has made [`MOST`] already.
pub(crate) fn rule_script(constants: Constants<'_>) -> Option<Arc<RuleScript>> {
    /// The scripts by their constants, which make their text.
    type Kept = HashMap<(String, [i64; 4]), Arc<RuleScript>>;
    static KEPT: OnceLock<Mutex<Kept>> = OnceLock::new();
    let layout = constants.layout;
    let numbers = [
        constants.cap,
        constants.expiry_ms,
        constants.scale,
        constants.max_wait_us,
    ];
    let mut kept = KEPT
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    // Found without writing the text: a thread that forgot its plans makes them again.
    if let Some(script) = kept.get(&(layout.to_owned(), numbers)) {
        return Some(script.clone());
    }
    let id = kept.len();
    if id >= MOST {
        return None;
    }
    let script = Arc::new(RuleScript {
        id,
        script: Script::from_lua(lua(constants)?),
        batch: Script::from_lua(batch_lua(constants)?),
    });
    kept.insert((layout.to_owned(), numbers), script.clone());
    Some(script)
}

/// The text of the rule script of `constants`: `one_token_bucket.lua` without its comments,
/// the lines reading the rule's arguments replaced by the constants. `None` if the script
/// has no such lines (a test keeps it so).
fn lua(constants: Constants<'_>) -> Option<String> {
    let (before, after) = ONE_TOKEN_BUCKET_LUA.split_once(ARGUMENTS)?;
    let mut lua = String::with_capacity(ONE_TOKEN_BUCKET_LUA.len());
    lua.push_str("-- FluxGate decision of one token-bucket rule of one band (one_token_bucket.lua), its\n");
    lua.push_str("-- arguments written in. KEYS[1]: the rule's key. ARGV[1]: the request's cost in units.\n");
    without_comments(before, &mut lua);
    lua.push_str("local key, layout, offset = KEYS[1], ");
    quoted(constants.layout, &mut lua);
    let _ = write!(lua, ", '{}'", constants.layout.len());
    lua.push_str("\nlocal cap, cost, ttl, scale, wait = ");
    numbers(constants, "tonumber(ARGV[1], 16), ", &mut lua);
    without_comments(after, &mut lua);
    Some(lua)
}

/// The text of the batch script of `constants`: the clock read once, then
/// `one_token_bucket.lua` as a function of a request's key, cost and stored value (when
/// `nil` or `false`: read it), the constants written in as in [`lua`], reading the batch's clock and
/// returning its band's debt alone; then `lua/rule_batch.lua`, which reads the batch's keys
/// and calls it for each request. `None` if the one-band script has not the lines it
/// replaces, each once.
fn batch_lua(constants: Constants<'_>) -> Option<String> {
    let (before, after) = ONE_TOKEN_BUCKET_LUA.split_once(ARGUMENTS)?;
    if [TIME, REPLY, READ].iter().any(|line| after.matches(line).count() != 1) {
        return None;
    }
    let after = after
        .replacen(TIME, "local now = batch_now\n", 1)
        .replacen(READ, READ_IN_BATCH, 1)
        .replacen(REPLY, "return debt\n", 1);
    let mut lua = String::with_capacity(ONE_TOKEN_BUCKET_LUA.len() + RULE_BATCH_LUA.len());
    lua.push_str("-- FluxGate batched decisions of one token-bucket rule of one band (one_token_bucket.lua,\n");
    lua.push_str("-- rule_batch.lua), its arguments written in. KEYS: each request's key. ARGV: the\n");
    lua.push_str("-- places of repeated keys, counted first, then each request's cost or one for all.\n");
    lua.push_str("local batch_time = redis.call('TIME')\n");
    lua.push_str("local batch_now = batch_time[1] * 1000000 + batch_time[2]\n");
    lua.push_str("local decide = function(key, cost, stored)\n");
    without_comments(before, &mut lua);
    lua.push_str("local layout, offset = ");
    quoted(constants.layout, &mut lua);
    let _ = write!(lua, ", '{}'", constants.layout.len());
    lua.push_str("\nlocal cap, ttl, scale, wait = ");
    numbers(constants, "", &mut lua);
    without_comments(&after, &mut lua);
    lua.push_str("end\n");
    without_comments(RULE_BATCH_LUA, &mut lua);
    Some(lua)
}

/// Appends the values of `cap, ttl, scale, wait` of `constants`, with `cost` (the Lua that
/// reads it, or nothing) after the capacity, and the line's end.
fn numbers(constants: Constants<'_>, cost: &str, lua: &mut String) {
    let Constants {
        cap,
        expiry_ms,
        scale,
        max_wait_us,
        ..
    } = constants;
    // The numbers as the arguments would give them: integers in hexadecimal, which Lua
    // reads with `strtoul`, as `tonumber(s, 16)`; the wait a string that the script reads
    // so; the expiry a string, passed to `PSETEX` as it is.
    let _ = write!(lua, "0x{cap:x}, {cost}'{expiry_ms}', 0x{scale:x}, ");
    if max_wait_us > 0 {
        let _ = writeln!(lua, "'{max_wait_us:x}'");
    } else {
        lua.push_str("nil\n");
    }
}

/// Appends the lines of `text` that are not comments alone.
fn without_comments(text: &str, lua: &mut String) {
    for line in text.lines() {
        if !line.trim_start().starts_with("--") && !line.trim().is_empty() {
            lua.push_str(line);
            lua.push('\n');
        }
    }
}

/// Appends `text` as a Lua string: letters, digits and the layout's punctuation as they
/// are, every other byte as a decimal escape of three digits (a band's name comes from a
/// rule file and may hold quotes, backslashes or line ends).
fn quoted(text: &str, lua: &mut String) {
    lua.push('\'');
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b":/|,._-=+*".contains(&byte) {
            lua.push(char::from(byte));
        } else {
            let _ = write!(lua, "\\{byte:03}");
        }
    }
    lua.push('\'');
}

/// The rule scripts a [`Scripts`](crate::script::Scripts) has loaded on its connections
/// (each one-band script and batch script apart), those being loaded, and those Redis
/// refused its user the right to load.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    loaded: Bits,
    batches_loaded: Bits,
    loading: Bits,
    batches_loading: Bits,
    refused: Bits,
}

/// One bit per rule script.
#[derive(Debug, Default)]
struct Bits([AtomicU64; MOST / 64]);

impl Bits {
    fn get(&self, script: &RuleScript) -> bool {
        self.0[script.id / 64].load(Ordering::Relaxed) & (1 << (script.id % 64)) != 0
    }

    fn set(&self, script: &RuleScript) {
        self.0[script.id / 64].fetch_or(1 << (script.id % 64), Ordering::Relaxed);
    }

    /// Sets the bit of `script`: whether it was clear.
    fn take(&self, script: &RuleScript) -> bool {
        let bit = 1 << (script.id % 64);
        self.0[script.id / 64].fetch_or(bit, Ordering::AcqRel) & bit == 0
    }

    fn clear(&self, script: &RuleScript) {
        self.0[script.id / 64].fetch_and(!(1 << (script.id % 64)), Ordering::AcqRel);
    }
}

impl Loaded {
    /// Whether `script` was loaded.
    pub(crate) fn holds(&self, script: &RuleScript) -> bool {
        self.loaded.get(script)
    }

    /// Records that `script` was loaded.
    pub(crate) fn add(&self, script: &RuleScript) {
        self.loaded.set(script);
    }

    /// Whether the batch script of `script` was loaded.
    pub(crate) fn holds_batch(&self, script: &RuleScript) -> bool {
        self.batches_loaded.get(script)
    }

    /// Records that the batch script of `script` was loaded.
    pub(crate) fn add_batch(&self, script: &RuleScript) {
        self.batches_loaded.set(script);
    }

    /// Whether Redis refused the user the right to load `script` or its batch script
    /// (`NOPERM`, which refuses every `SCRIPT LOAD`): its rule's calls go to the shared
    /// one-band script, and its batches to the shared batch script.
    pub(crate) fn refuses(&self, script: &RuleScript) -> bool {
        self.refused.get(script)
    }

    /// Records that Redis refused the user the right to load `script`.
    pub(crate) fn refuse(&self, script: &RuleScript) {
        self.refused.set(script);
    }

    /// Records that a load of `script` (`batch`: of its batch script) starts: whether none
    /// was under way.
    pub(crate) fn start_load(&self, script: &RuleScript, batch: bool) -> bool {
        if batch {
            self.batches_loading.take(script)
        } else {
            self.loading.take(script)
        }
    }

    /// Records that the load of `script` (`batch`: of its batch script) ended, loaded or
    /// not.
    pub(crate) fn end_load(&self, script: &RuleScript, batch: bool) {
        if batch {
            self.batches_loading.clear(script);
        } else {
            self.loading.clear(script);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn constants(layout: &str) -> Constants<'_> {
        Constants {
            layout,
            cap: 0xd693_a400,
            expiry_ms: 3_601_001,
            scale: 1,
            max_wait_us: 0,
        }
    }

    #[test]
    fn the_one_band_script_reads_its_arguments_in_the_lines_a_rule_script_replaces() {
        assert_eq!(ONE_TOKEN_BUCKET_LUA.matches(ARGUMENTS).count(), 1);
        let lua = lua(constants("b0:10/1h|")).unwrap();
        assert!(!lua.contains("ARGV[2]"), "{lua}");
        assert!(
            lua.contains("local key, layout, offset = KEYS[1], 'b0:10/1h|', '9'\n"),
            "{lua}"
        );
        assert!(
            lua.contains(
                "local cap, cost, ttl, scale, wait = 0xd693a400, tonumber(ARGV[1], 16), '3601001', 0x1, nil\n"
            ),
            "{lua}"
        );
        assert!(lua.ends_with("return {now, debt}\n"), "{lua}");
    }

    /// A rule's batch script: the clock read once, the rule's decision a function of a
    /// key and a cost with the same constants, reading the batch's clock and returning the
    /// debt alone, then the loop of `lua/rule_batch.lua`; no comment, no argument but the
    /// costs.
    #[test]
    fn a_batch_script_is_the_rule_script_as_a_function_called_per_request() {
        let lua = batch_lua(Constants {
            max_wait_us: 1_000,
            scale: 3,
            ..constants("b0:10/1h|")
        })
        .unwrap();
        assert!(lua.contains("local decide = function(key, cost, stored)\n"), "{lua}");
        assert!(lua.contains("local layout, offset = 'b0:10/1h|', '9'\n"), "{lua}");
        assert!(
            lua.contains("local cap, ttl, scale, wait = 0xd693a400, '3601001', 0x3, '3e8'\n"),
            "{lua}"
        );
        assert_eq!(lua.matches("redis.call('TIME')").count(), 1, "{lua}");
        assert!(lua.contains("local now = batch_now\n"), "{lua}");
        assert!(lua.contains("return debt\nend\n"), "{lua}");
        assert!(!lua.contains("return {now"), "{lua}");
        assert!(!lua.contains("KEYS[1]") && !lua.contains("ARGV[2]"), "{lua}");
        // The key read with the batch's keys, or now when `stored` is nil or false.
        assert!(lua.contains(READ_IN_BATCH), "{lua}");
        assert_eq!(lua.matches("redis.call('GET', key)").count(), 1, "{lua}");
        assert!(lua.contains("redis.pcall('MGET', unpack(KEYS))"), "{lua}");
        assert!(
            lua.contains("pcall(decide, KEYS[i], cost or tonumber(ARGV[first + i - 1], 16), stored[i])"),
            "{lua}"
        );
        assert_eq!(
            lua.lines().filter(|l| l.trim_start().starts_with("--")).count(),
            3,
            "{lua}"
        );
        assert!(lua.ends_with("return reply\n"), "{lua}");
    }

    #[test]
    fn a_wait_is_written_as_the_argument_was() {
        let lua = lua(Constants {
            max_wait_us: 1_000,
            scale: 3,
            ..constants("b0:10/1h|")
        })
        .unwrap();
        assert!(lua.contains(", 0x3, '3e8'\n"), "{lua}");
    }

    #[test]
    fn a_layout_of_any_bytes_stays_one_string() {
        let lua = lua(constants("a'b\"c\\d\ne]]f{g}|")).unwrap();
        assert!(lua.contains(r"'a\039b\034c\092d\010e\093\093f\123g\125|'"), "{lua}");
    }

    #[test]
    fn one_text_is_one_script_and_the_process_makes_a_bounded_number() {
        let a = rule_script(constants("same:1/1s|")).unwrap();
        let b = rule_script(constants("same:1/1s|")).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let loaded = Loaded::default();
        assert!(!loaded.holds(&a));
        loaded.add(&a);
        assert!(loaded.holds(&b));
        // A rule's batch script is loaded apart.
        assert!(!loaded.holds_batch(&a));
        loaded.add_batch(&a);
        assert!(loaded.holds_batch(&b));
        // One load of each at a time.
        assert!(loaded.start_load(&a, true));
        assert!(!loaded.start_load(&b, true));
        assert!(loaded.start_load(&a, false));
        loaded.end_load(&a, true);
        assert!(loaded.start_load(&b, true));
        let mut made = 0;
        for i in 0..=MOST {
            if rule_script(constants(&format!("many{i}:1/1s|"))).is_some() {
                made += 1;
            }
        }
        assert!(made < MOST, "{made}");
        assert!(rule_script(constants("past:1/1s|")).is_none());
        // Those already made are still found.
        assert!(rule_script(constants("same:1/1s|")).is_some());
    }
}
