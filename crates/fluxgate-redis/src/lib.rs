//! The Redis backend of FluxGate: one atomic Lua script call decides every band of every
//! rule of a request, so that many application instances sharing one Redis enforce one
//! limit exactly.
//!
//! [`RedisLimiter`] implements [`RateLimiter`]: plug it into an
//! [`Engine`](fluxgate_core::Engine) in place of the in-memory limiter.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use fluxgate_core::{Engine, RuleSets, StaticRuleSetProvider};
//! use fluxgate_redis::RedisLimiter;
//!
//! let limiter = RedisLimiter::builder("redis://127.0.0.1:6379/0").prefix("myapp").connect().await?;
//! let rules = RuleSets::from_file("rules.yaml")?;
//! let engine = Engine::builder(StaticRuleSetProvider::new(rules)).limiter(limiter).build();
//! # Ok(()) }
//! ```
//!
//! # The script
//!
//! [`DECIDE_LUA`], joined from one file per algorithm in `lua/` (`lua/README.md` states
//! the `KEYS` / `ARGV` / reply contract), reads Redis `TIME` in microseconds, evaluates
//! every band of every rule, whatever their algorithms, and writes only when every
//! enforced band admits the request. It is loaded with `SCRIPT LOAD` when the limiter
//! connects and called with `EVALSHA`; after `NOSCRIPT` (a restart, a failover,
//! `SCRIPT FLUSH`) it is loaded again and the call retried, so no request fails for it.
//!
//! # Keys
//!
//! `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<capacity>/<window>` (the window as in
//! rule files: `500ms`, `1m`, `1h`), followed by `:lb`, `:fw`, `:swl` or `:swc` for the
//! leaky bucket, fixed window, sliding window log and sliding window counter. Rule set and
//! rule ids and band names are validated ids, and key values are encoded by
//! [`fluxgate_core::key`] so that no user value contains `{`, `}` or `:`, nor grows without
//! bound. The braces make all bands of one rule share a hash slot. A key expires one
//! second after its state stops counting (see `docs/algorithms.md`).
//!
//! # Deployments
//!
//! A standalone Redis (`redis://` or `rediss://`, with database, user and password), or a
//! Redis Cluster named by several comma-separated nodes (`redis://h1:7000,h2:7001`) or a
//! `redis-cluster://` URL. On a cluster the buckets of a request are grouped by hash slot,
//! one call per slot goes out concurrently, and when a slot rejects, the slots that
//! admitted give back what they consumed (`lua/refund.lua`). Sentinel: a
//! `redis-sentinel://` URL with the sentinels and `sentinelServiceName`; after a failover
//! the client follows the new primary and reloads the scripts on `NOSCRIPT`.

#![deny(unsafe_code)]

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest, RateLimiter, Wait};
use fluxgate_core::{Algorithm, Band, BandReport, BoxError, MaybeReady, Rule, RuleError, RuleSet};
use fred::clients::{Client, Pool};
use fred::interfaces::ClientLike;
use fred::types::config::{Config, ReconnectPolicy};
use fred::types::scripts::Script;
use fred::types::Builder;

/// The files of `lua/`, joined in order into one script.
macro_rules! lua {
    ($($file:literal),+ $(,)?) => {
        concat!($(include_str!(concat!("../lua/", $file))),+)
    };
}

/// The decision script (see `lua/README.md`): every band of every rule of a request, of
/// any algorithm, all or nothing. The single-band token bucket returns from
/// `fast_path.lua`, before the other algorithms' functions are created.
pub const DECIDE_LUA: &str = lua!(
    "common.lua",
    "protocol.lua",
    "token_bucket.lua",
    "fast_path.lua",
    "helpers.lua",
    "leaky_bucket.lua",
    "fixed_window.lua",
    "sliding_window_log.lua",
    "sliding_window_counter.lua",
    "algorithms.lua",
    "decide.lua",
);

/// The refund script, for requests that a cluster's hash slots decided differently.
pub const REFUND_LUA: &str = lua!(
    "common.lua",
    "protocol.lua",
    "token_bucket.lua",
    "helpers.lua",
    "leaky_bucket.lua",
    "fixed_window.lua",
    "sliding_window_log.lua",
    "sliding_window_counter.lua",
    "algorithms.lua",
    "refund.lua",
);

/// The largest number a band may need in the script: token and leaky buckets need
/// `capacity × window µs / gcd(capacity, window µs)`, sliding window counters
/// `capacity × window µs`. Twice it stays below 2^53, so every number in the script is an
/// exact integer.
pub const MAX_SCALED_CAPACITY: u64 = 1 << 52;

/// The largest capacity of a sliding window log band: the log keeps one sorted-set member
/// per admitted permit, and a request adds its permits one member each, so both the key's
/// size and the time one script call takes grow with it.
pub const MAX_LOG_CAPACITY: u64 = 1 << 20;

/// The default deadline of one script call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// Why the Redis backend failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The URL cannot be used.
    #[error("redis URL `{url}`: {reason}")]
    Url {
        /// The URL as given (without its password).
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// Connecting or loading the script failed.
    #[error("cannot connect to redis: {0}")]
    Connect(#[source] fred::error::Error),
    /// A command failed.
    #[error("redis command failed: {0}")]
    Command(#[source] fred::error::Error),
    /// The call did not complete within its deadline.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// The script's reply does not have the expected shape.
    #[error("unexpected reply from the rate-limit script: {0}")]
    Reply(String),
    /// The task deciding a request across hash slots ended without an answer (the runtime
    /// shut down).
    #[error("the rate-limit decision was interrupted")]
    Interrupted,
}

/// The Redis limiter. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    clients: Arc<Clients>,
    script: Script,
    refund: Script,
    cluster: bool,
    prefix: String,
    timeout: Duration,
    denied: Option<DenyCache>,
}

/// Bands known to reject a request until an instant: answered locally, without Redis.
type DenyCache = moka::sync::Cache<String, Denial>;

/// A band that rejected: until `until` it rejects every request of the same cost, because
/// only time adds tokens to a bucket. A local rejection repeats Redis's figures: the
/// remaining permits and the instant the band is full again.
#[derive(Debug, Clone, Copy)]
struct Denial {
    until: Instant,
    remaining: u64,
    reset_at: SystemTime,
}

fn deny_cache() -> DenyCache {
    moka::sync::Cache::builder()
        .max_capacity(100_000)
        .time_to_live(Duration::from_secs(60))
        .build()
}

enum Clients {
    One(Client),
    Pool(Pool),
}

impl Clients {
    fn next(&self) -> &Client {
        match self {
            Self::One(c) => c,
            Self::Pool(p) => p.next(),
        }
    }
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("script_sha1", &self.inner.script.sha1())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisLimiter`] from a URL.
#[derive(Debug, Clone)]
pub struct RedisLimiterBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
    pool_size: usize,
    deny_cache: bool,
    reconnect_delay: Duration,
}

impl RedisLimiter {
    /// A builder for `url`: `redis://[user:password@]host:port[/db]`, `rediss://…`, or
    /// several comma-separated `host:port` nodes of a cluster.
    pub fn builder(url: impl Into<String>) -> RedisLimiterBuilder {
        RedisLimiterBuilder {
            url: url.into(),
            prefix: "fluxgate".to_owned(),
            timeout: DEFAULT_TIMEOUT,
            pool_size: 4,
            deny_cache: true,
            reconnect_delay: Duration::from_millis(100),
        }
    }

    /// A limiter over a client the application already connected. The script is loaded
    /// on the first call that finds it missing. The deny cache is on, except on a
    /// cluster (see [`RedisLimiterBuilder::deny_cache`]).
    pub fn from_client(client: Client, prefix: impl Into<String>) -> Self {
        let cluster = client.is_clustered();
        Self {
            inner: Arc::new(Inner {
                cluster,
                clients: Arc::new(Clients::One(client)),
                script: Script::from_lua(DECIDE_LUA),
                refund: Script::from_lua(REFUND_LUA),
                prefix: prefix.into(),
                timeout: DEFAULT_TIMEOUT,
                // Refunds give tokens back, so on a cluster a denial could end early.
                denied: (!cluster).then(deny_cache),
            }),
        }
    }

    /// Whether rejections are remembered and repeated locally (the deny cache).
    pub fn has_deny_cache(&self) -> bool {
        self.inner.denied.is_some()
    }

    /// A limiter sharing this one's connections, with another key prefix.
    pub fn with_prefix(&self, prefix: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                clients: self.inner.clients.clone(),
                script: self.inner.script.clone(),
                refund: self.inner.refund.clone(),
                cluster: self.inner.cluster,
                prefix: prefix.into(),
                timeout: self.inner.timeout,
                denied: self.inner.denied.as_ref().map(|_| deny_cache()),
            }),
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The SHA-1 of the script, as used with `EVALSHA`.
    pub fn script_sha1(&self) -> &str {
        self.inner.script.sha1()
    }
}

impl RedisLimiterBuilder {
    /// The key prefix. Default `fluxgate`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The deadline of one script call (including a reload after `NOSCRIPT`). Default 50 ms.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The number of connections, used in turn. Default 4.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The local deny cache (on by default): after a band rejects a request with a
    /// retry-after of T, requests of the same cost that need that band are rejected
    /// locally, without a Redis call, until T has passed. Only time adds tokens, so this
    /// never rejects a request Redis would admit, and never admits one. On a cluster,
    /// refunds give tokens back too, so the cache stays off there.
    pub fn deny_cache(mut self, on: bool) -> Self {
        self.deny_cache = on;
        self
    }

    /// The delay between reconnection attempts after a connection is lost; attempts never
    /// stop. Default 100 ms.
    pub fn reconnect_delay(mut self, delay: Duration) -> Self {
        self.reconnect_delay = delay;
        self
    }

    /// Checks the URL, connects and loads the script.
    ///
    /// # Errors
    ///
    /// [`RedisError::Url`] for a URL that cannot be used, [`RedisError::Connect`] when
    /// Redis cannot be reached or the script not loaded.
    pub async fn connect(self) -> Result<RedisLimiter, RedisError> {
        let shown = redact(&self.url);
        let url_error = |reason: String| RedisError::Url {
            url: shown.clone(),
            reason,
        };
        let config = parse_url(&self.url).map_err(url_error)?;
        let cluster = matches!(config.server, fred::types::config::ServerConfig::Clustered { .. });
        let mut builder = Builder::from_config(config);
        let delay = u32::try_from(self.reconnect_delay.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
        builder.set_policy(ReconnectPolicy::new_constant(0, delay));
        builder.with_performance_config(|p| p.default_command_timeout = self.timeout);
        builder.with_connection_config(|c| c.connection_timeout = self.timeout.max(Duration::from_secs(1)));
        let pool = builder.build_pool(self.pool_size).map_err(RedisError::Connect)?;
        pool.init().await.map_err(RedisError::Connect)?;
        // Loaded on every primary of a cluster.
        let script = Script::from_lua(DECIDE_LUA);
        script.load(pool.next()).await.map_err(RedisError::Connect)?;
        let refund = Script::from_lua(REFUND_LUA);
        refund.load(pool.next()).await.map_err(RedisError::Connect)?;
        Ok(RedisLimiter {
            inner: Arc::new(Inner {
                clients: Arc::new(Clients::Pool(pool)),
                script,
                refund,
                cluster,
                prefix: self.prefix,
                timeout: self.timeout,
                // Refunds give tokens back, so on a cluster a denial could end early.
                denied: (self.deny_cache && !cluster).then(deny_cache),
            }),
        })
    }
}

/// A standalone, cluster or Sentinel configuration from a URL. Several comma-separated
/// nodes name a cluster (`redis://host1:6379,host2:6379`), as does a `redis-cluster://`
/// URL; `redis-sentinel://s1:26379?node=s2:26379&sentinelServiceName=mymaster` names the
/// sentinels of a primary.
fn parse_url(url: &str) -> Result<Config, String> {
    let (scheme, rest) = url
        .split_once("://")
        .filter(|(scheme, _)| {
            matches!(
                *scheme,
                "redis" | "rediss" | "redis-cluster" | "rediss-cluster" | "redis-sentinel" | "rediss-sentinel"
            )
        })
        .ok_or_else(|| "expected a URL starting with redis://, rediss:// or redis-sentinel://".to_owned())?;
    if scheme.ends_with("-sentinel") {
        if !rest.contains("sentinelServiceName=") {
            return Err("a Sentinel URL needs ?sentinelServiceName=<primary name>".to_owned());
        }
        return Config::from_url_sentinel(url).map_err(|e| e.details().to_string());
    }
    let nodes: Vec<&str> = rest.split(',').map(str::trim).collect();
    if nodes.iter().any(|n| n.is_empty()) {
        return Err("a node is empty; list the nodes as host:port,host:port".to_owned());
    }
    if nodes.len() == 1 && !scheme.ends_with("-cluster") {
        return Config::from_url(url).map_err(|e| e.details().to_string());
    }
    let tls = if scheme.starts_with("rediss") {
        "rediss"
    } else {
        "redis"
    };
    let (first, query) = nodes[0].split_once('?').unwrap_or((nodes[0], ""));
    // A cluster has no databases: a `/db` path is dropped.
    let first = first.split('/').next().unwrap_or(first);
    let params: Vec<String> = std::iter::once(query.to_owned())
        .filter(|q| !q.is_empty())
        .chain(
            nodes[1..]
                .iter()
                .map(|n| format!("node={}", n.split('/').next().unwrap_or(n))),
        )
        .collect();
    let mut cluster_url = format!("{tls}-cluster://{first}");
    if !params.is_empty() {
        cluster_url.push('?');
        cluster_url.push_str(&params.join("&"));
    }
    Config::from_url_clustered(&cluster_url).map_err(|e| e.details().to_string())
}

/// The URL without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// One script call: the buckets of one hash slot (all buckets on a standalone Redis).
#[derive(Default)]
struct Call {
    keys: Vec<String>,
    args: Vec<i64>,
    buckets: i64,
    /// Per band of the call: its position among all bands of the request.
    positions: Vec<usize>,
    /// Per band: whether its rule is in shadow mode.
    shadow: Vec<bool>,
    /// Per band: the deny-cache key of an enforced band (its key and the cost), or `None`.
    deny_keys: Vec<Option<String>>,
    /// Per band: what `refund.lua` needs to give its consumption back.
    refund: Vec<[i64; 5]>,
}

/// A number for the scripts: below 2^53 for every value the validation lets through.
fn script_number(n: u64, rule_set: &str, rule: &Rule, band: &Band) -> Result<i64, RuleError> {
    i64::try_from(n).ok().filter(|&n| n < 1 << 53).ok_or_else(|| {
        unsupported(
            rule_set,
            rule,
            band,
            format!("{n} is beyond 2^53, the exact integers of the scripts"),
        )
    })
}

fn unsupported(rule_set: &str, rule: &Rule, band: &Band, message: String) -> RuleError {
    RuleError::Unsupported {
        backend: "redis",
        rule_set: rule_set.to_owned(),
        rule: rule.id().to_string(),
        band: band.name().to_string(),
        message,
    }
}

/// A band's three numbers in the scripts (see `lua/README.md`), or why the scripts cannot
/// decide it exactly.
fn band_args(rule_set: &str, rule: &Rule, band: &Band) -> Result<[u64; 3], RuleError> {
    let fail = |message: String| unsupported(rule_set, rule, band, message);
    let algorithm = rule.algorithm();
    let capacity = band.capacity();
    let window = band.window();
    if window.subsec_nanos() % 1_000 != 0 {
        return Err(fail(format!(
            "the window {window:?} is not a whole number of microseconds, the unit of Redis time"
        )));
    }
    let window_us =
        u64::try_from(window.as_micros()).map_err(|_| fail(format!("the window {window:?} is too long")))?;
    let (a, b, largest, what) = match algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            let g = gcd(capacity, window_us);
            let (scale, interval) = (capacity / g, window_us / g);
            (
                scale,
                interval,
                capacity.checked_mul(interval),
                "capacity × window in µs / gcd(capacity, window in µs)",
            )
        }
        Algorithm::SlidingWindowCounter => (window_us, 0, capacity.checked_mul(window_us), "capacity × window in µs"),
        Algorithm::FixedWindow | Algorithm::SlidingWindowLog => (window_us, 0, Some(window_us), "the window in µs"),
    };
    match largest {
        Some(n) if n <= MAX_SCALED_CAPACITY => {}
        largest => {
            let shown = largest.map_or_else(|| "beyond 2^64".to_owned(), |n| n.to_string());
            return Err(fail(format!(
                "{} per {}: {what} is {shown}, above 2^52 ({MAX_SCALED_CAPACITY}), the largest the script computes \
                 exactly; use a smaller capacity or a shorter window",
                capacity,
                fluxgate_core::format_duration(window),
            )));
        }
    }
    if algorithm == Algorithm::SlidingWindowLog && capacity > MAX_LOG_CAPACITY {
        return Err(fail(format!(
            "a sliding window log keeps one sorted-set member per permit: capacity {capacity} is above \
             {MAX_LOG_CAPACITY}; use a sliding window counter or a smaller capacity"
        )));
    }
    Ok([capacity, a, b])
}

impl RedisLimiter {
    /// Encodes a request: one call on a standalone Redis, one call per hash slot on a cluster.
    fn encode(&self, request: &AcquireRequest<'_>) -> Result<Vec<Call>, RuleError> {
        let mut calls: Vec<(u16, Call)> = Vec::new();
        let mut position = 0;
        for bucket in request.buckets {
            let rule = bucket.rule;
            let tag = format!("{{{}:{}:{}}}", bucket.rule_set, rule.id(), bucket.key.as_str());
            let slot = if self.inner.cluster {
                fred::util::redis_keyslot(tag.as_bytes())
            } else {
                0
            };
            let at = match calls.iter().position(|(s, _)| *s == slot) {
                Some(at) => at,
                None => {
                    calls.push((slot, Call::default()));
                    calls.len() - 1
                }
            };
            let call = &mut calls[at].1;
            let algorithm = rule.algorithm();
            let code = algorithm_code(algorithm);
            let bands = i64::try_from(rule.bands().len()).unwrap_or(i64::MAX);
            let Some(first) = rule.bands().first() else {
                continue; // validated rules have at least one band
            };
            let permits = script_number(rule.permits(), bucket.rule_set, rule, first)?;
            call.buckets += 1;
            call.args
                .extend([permits, bands * 16 + code * 2 + i64::from(bucket.shadow())]);
            for band in rule.bands().iter() {
                let numbers = band_args(bucket.rule_set, rule, band)?;
                let [capacity, a, b] = numbers.map(|n| script_number(n, bucket.rule_set, rule, band));
                let (capacity, a, b) = (capacity?, a?, b?);
                let window = fluxgate_core::format_duration(band.window());
                let mut key = format!("{}:{tag}:{}:{capacity}/{window}", self.inner.prefix, band.name());
                if let Some(suffix) = key_suffix(algorithm) {
                    key.push(':');
                    key.push_str(suffix);
                }
                call.args.extend([capacity, a, b]);
                call.deny_keys
                    .push((!bucket.shadow()).then(|| format!("{key}#{}", rule.permits())));
                call.refund.push([code, permits.min(capacity), capacity, a, b]);
                call.keys.push(key);
                call.shadow.push(bucket.shadow());
                call.positions.push(position);
                position += 1;
            }
        }
        Ok(calls
            .into_iter()
            .map(|(_, mut call)| {
                call.args.insert(0, call.buckets);
                call
            })
            .collect())
    }
}

/// The algorithm's number in the scripts' arguments.
fn algorithm_code(algorithm: Algorithm) -> i64 {
    match algorithm {
        Algorithm::TokenBucket => 0,
        Algorithm::LeakyBucket => 1,
        Algorithm::FixedWindow => 2,
        Algorithm::SlidingWindowLog => 3,
        Algorithm::SlidingWindowCounter => 4,
    }
}

/// The end of a band's key: none for the token bucket, the algorithm for the others, so
/// that a rule whose algorithm changes starts new counters.
fn key_suffix(algorithm: Algorithm) -> Option<&'static str> {
    match algorithm {
        Algorithm::TokenBucket => None,
        Algorithm::LeakyBucket => Some("lb"),
        Algorithm::FixedWindow => Some("fw"),
        Algorithm::SlidingWindowLog => Some("swl"),
        Algorithm::SlidingWindowCounter => Some("swc"),
    }
}

/// What the limiter needs of the request to read the reply, owned: per band, its rule's
/// id and mode and the band.
struct Shape {
    bands: Vec<(Arc<str>, bool, Band)>,
}

/// The combined reply: `allowed, shadow_allowed, now_us`, and per band (in request
/// order) `allowed, remaining, reset_after_us, wait_us`.
fn decode(shape: &Shape, allowed: bool, shadow_allowed: bool, now_us: i64, per_band: &[[i64; 4]]) -> AcquireOutcome {
    let now_ns = u64::try_from(now_us).unwrap_or(0).saturating_mul(1_000);
    let nonneg = |v: i64| u64::try_from(v).unwrap_or(0);
    let bands = shape
        .bands
        .iter()
        .zip(per_band)
        .map(|((rule, shadow, band), r)| {
            let wait = match r[3] {
                0 => Wait::None,
                w if w < 0 => Wait::Never,
                w => Wait::After(Duration::from_micros(nonneg(w))),
            };
            let reset_after = Duration::from_micros(nonneg(r[2]));
            BandReport {
                rule: rule.clone(),
                band: band.name().clone(),
                labeled: band.label().is_some(),
                limit: band.capacity(),
                remaining: nonneg(r[1]),
                window: band.window(),
                reset_after,
                reset_at: UNIX_EPOCH + Duration::from_nanos(now_ns) + reset_after,
                allowed: r[0] == 1,
                shadow: *shadow,
                wait,
            }
        })
        .collect();
    AcquireOutcome {
        allowed,
        shadow_allowed,
        now_unix_nanos: now_ns,
        bands,
        local: false,
    }
}

/// Runs one decision call within the deadline.
async fn run(inner: &Inner, keys: Vec<String>, args: Vec<i64>) -> Result<Vec<i64>, RedisError> {
    let bands = keys.len();
    let client = inner.clients.next();
    let script = inner.script.evalsha_with_reload::<Vec<i64>, _, _>(client, keys, args);
    let reply = match tokio::time::timeout(inner.timeout, script).await {
        Ok(Ok(reply)) => reply,
        Ok(Err(e)) => return Err(RedisError::Command(e)),
        Err(_) => return Err(RedisError::Timeout(inner.timeout)),
    };
    if reply.len() != 3 + 4 * bands {
        return Err(RedisError::Reply(format!("{} numbers for {bands} bands", reply.len())));
    }
    Ok(reply)
}

/// The bands a call committed that the request as a whole must not keep: every band of
/// a slot that admitted when another slot rejected (or failed), and the shadow bands of a
/// slot whose shadow rules admitted when another slot's shadow rules rejected.
fn to_refund(call: &Call, reply: &[i64], allowed: bool, shadow_allowed: bool) -> Vec<usize> {
    (0..call.keys.len())
        .filter(|&j| {
            let band_allowed = reply[3 + 4 * j] == 1;
            let committed = reply[0] == 1 && band_allowed && (!call.shadow[j] || reply[1] == 1);
            let keep = allowed && band_allowed && (!call.shadow[j] || shadow_allowed);
            committed && !keep
        })
        .collect()
}

/// Gives back what the slots of a request committed and the request must not keep, all
/// slots at once under one deadline. Returns, per band position, the figures after the
/// refund.
async fn refund(
    inner: &Inner,
    calls: &[Call],
    replies: &[Option<Vec<i64>>],
    allowed: bool,
    shadow_allowed: bool,
) -> Result<Vec<(usize, i64, i64)>, RedisError> {
    let mut pending = Vec::new();
    for (call, reply) in calls.iter().zip(replies) {
        let Some(reply) = reply else {
            continue; // this slot failed: it consumed nothing
        };
        let bands = to_refund(call, reply, allowed, shadow_allowed);
        if bands.is_empty() {
            continue;
        }
        // The decision's instant tells the windows and log entries to take back.
        let mut args = vec![reply[2]];
        for &j in &bands {
            args.extend(call.refund[j]);
        }
        let keys: Vec<String> = bands.iter().map(|&j| call.keys[j].clone()).collect();
        let positions: Vec<usize> = bands.iter().map(|&j| call.positions[j]).collect();
        let client = inner.clients.next();
        let script = inner.refund.evalsha_with_reload::<Vec<i64>, _, _>(client, keys, args);
        pending.push(async move { (positions, script.await) });
    }
    if pending.is_empty() {
        return Ok(Vec::new());
    }
    let results = tokio::time::timeout(inner.timeout, futures_util::future::join_all(pending))
        .await
        .map_err(|_| RedisError::Timeout(inner.timeout))?;
    let mut figures = Vec::new();
    for (positions, result) in results {
        let reply = result.map_err(RedisError::Command)?;
        if reply.len() != 2 * positions.len() {
            return Err(RedisError::Reply(format!(
                "{} numbers for {} refunds",
                reply.len(),
                positions.len()
            )));
        }
        figures.extend(
            positions
                .into_iter()
                .zip(reply.chunks_exact(2))
                .map(|(p, r)| (p, r[0], r[1])),
        );
    }
    Ok(figures)
}

/// Decides a request whose buckets live in several hash slots of a cluster: one call per
/// slot, concurrently, then the refunds the decision calls for. Runs as a task of its own,
/// so that a caller who stops waiting (a client gone, an outer timeout) cannot leave a
/// consumption that should have been given back.
async fn decide_across_slots(inner: Arc<Inner>, calls: Vec<Call>, shape: Shape) -> Result<AcquireOutcome, RedisError> {
    let results =
        futures_util::future::join_all(calls.iter().map(|c| run(&inner, c.keys.clone(), c.args.clone()))).await;
    let mut replies = Vec::with_capacity(results.len());
    let mut failure = None;
    for result in results {
        match result {
            Ok(reply) => replies.push(Some(reply)),
            Err(e) => {
                failure = Some(e);
                replies.push(None);
            }
        }
    }
    let answered = || replies.iter().flatten();
    let allowed = failure.is_none() && answered().all(|r| r[0] == 1);
    let shadow_allowed = failure.is_none() && answered().all(|r| r[1] == 1);
    let now_us = answered().map(|r| r[2]).max().unwrap_or(0);
    let mut per_band = vec![[0i64; 4]; shape.bands.len()];
    for (call, reply) in calls.iter().zip(&replies) {
        if let Some(reply) = reply {
            for (j, &p) in call.positions.iter().enumerate() {
                per_band[p].copy_from_slice(&reply[3 + 4 * j..7 + 4 * j]);
            }
        }
    }
    match refund(&inner, &calls, &replies, allowed, shadow_allowed).await {
        Ok(figures) => {
            for (p, remaining, reset) in figures {
                per_band[p][1] = remaining;
                per_band[p][2] = reset;
            }
        }
        // The decision stands; what could not be given back errs towards admitting less.
        Err(error) => tracing::warn!(%error, "rate-limit refund failed: a rejected request's consumption stays"),
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(decode(&shape, allowed, shadow_allowed, now_us, &per_band))
}

/// The result of [`RedisLimiter::health`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// How long a `PING` took.
    pub latency: Duration,
    /// On a cluster, `cluster_state` from `CLUSTER INFO` (`ok` or `fail`).
    pub cluster_state: Option<String>,
}

impl RedisLimiter {
    /// Sends `PING` within the limiter's deadline and reports how long it took; on a
    /// cluster, also the cluster state.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] or [`RedisError::Timeout`] when Redis does not answer.
    pub async fn health(&self) -> Result<Health, RedisError> {
        let deadline = |e| match e {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(RedisError::Command(e)),
            Err(_) => Err(RedisError::Timeout(self.inner.timeout)),
        };
        let client = self.inner.clients.next();
        let start = Instant::now();
        deadline(tokio::time::timeout(self.inner.timeout, client.ping::<String>(None)).await)?;
        let latency = start.elapsed();
        let cluster_state = if self.inner.cluster {
            use fred::interfaces::ClusterInterface;
            let info: String = deadline(tokio::time::timeout(self.inner.timeout, client.cluster_info()).await)?;
            info.lines()
                .find_map(|l| l.strip_prefix("cluster_state:"))
                .map(|s| s.trim().to_owned())
        } else {
            None
        };
        Ok(Health { latency, cluster_state })
    }

    /// A rejection from the deny cache, when a band of the request is known to reject it.
    /// It repeats what Redis said of that band: its remaining permits and the instant it
    /// is full again; the retry-after counts down to the end of the denial.
    fn denied_locally(&self, shape: &Shape, calls: &[Call], now: Instant) -> Option<AcquireOutcome> {
        let cache = self.inner.denied.as_ref()?;
        let (index, denial) = calls
            .iter()
            .flat_map(|call| call.deny_keys.iter().zip(&call.positions))
            .find_map(|(key, &p)| {
                let denial = cache.get(key.as_ref()?)?;
                (denial.until > now).then_some((p, denial))
            })?;
        let (rule, shadow, band) = &shape.bands[index];
        let wait = denial.until - now;
        let now_unix = SystemTime::now();
        let now_ns = now_unix
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        // Only the denying band is known; the others were not asked.
        let report = BandReport {
            rule: rule.clone(),
            band: band.name().clone(),
            labeled: band.label().is_some(),
            limit: band.capacity(),
            remaining: denial.remaining,
            window: band.window(),
            reset_after: denial.reset_at.duration_since(now_unix).unwrap_or_default(),
            reset_at: denial.reset_at,
            allowed: false,
            shadow: *shadow,
            wait: Wait::After(wait.max(Duration::from_micros(1))),
        };
        Some(AcquireOutcome {
            allowed: false,
            shadow_allowed: true,
            now_unix_nanos: now_ns,
            bands: vec![report],
            local: true,
        })
    }

    /// Remembers the bands that rejected, counted from before the call so that a denial
    /// never outlives the real wait.
    fn remember_denials(inner: &Inner, calls: &[Call], outcome: &AcquireOutcome, start: Instant) {
        let Some(cache) = &inner.denied else {
            return;
        };
        for call in calls {
            for (key, &p) in call.deny_keys.iter().zip(&call.positions) {
                let band = &outcome.bands[p];
                if let (Wait::After(wait), Some(key)) = (band.wait, key) {
                    let denial = Denial {
                        until: start + wait,
                        remaining: band.remaining,
                        reset_at: band.reset_at,
                    };
                    cache.insert(key.clone(), denial);
                }
            }
        }
    }
}

impl RateLimiter for RedisLimiter {
    fn acquire(&self, request: &AcquireRequest<'_>) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let mut calls = match self.encode(request) {
            Ok(calls) => calls,
            // A configuration error, not a backend failure (see `RateLimiter::validate`).
            Err(e) => return MaybeReady::ready(Err(e.into())),
        };
        let shape = Shape {
            bands: request
                .buckets
                .iter()
                .flat_map(|b| {
                    let (rule, shadow) = (b.rule.id(), b.shadow());
                    b.rule
                        .bands()
                        .iter()
                        .map(move |band| (rule.clone(), shadow, band.clone()))
                })
                .collect(),
        };
        let start = Instant::now();
        if let Some(outcome) = self.denied_locally(&shape, &calls, start) {
            return MaybeReady::ready(Ok(outcome));
        }
        let inner = self.inner.clone();
        if let [call] = calls.as_mut_slice() {
            // One call (always so on a standalone Redis): nothing to refund.
            let (keys, args) = (std::mem::take(&mut call.keys), std::mem::take(&mut call.args));
            return MaybeReady::boxed(async move {
                let reply = run(&inner, keys, args).await?;
                let per_band: Vec<[i64; 4]> = reply[3..].chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect();
                let outcome = decode(&shape, reply[0] == 1, reply[1] == 1, reply[2], &per_band);
                Self::remember_denials(&inner, &calls, &outcome, start);
                Ok(outcome)
            });
        }
        MaybeReady::boxed(async move {
            // Spawned at the first poll: once a call has gone out, the refunds it may need
            // happen whether or not this future is still awaited.
            let task = tokio::spawn(decide_across_slots(inner, calls, shape));
            match task.await {
                Ok(result) => Ok(result?),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => Err(RedisError::Interrupted.into()),
            }
        })
    }

    fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        for rule in set.rules() {
            for band in rule.bands().iter() {
                band_args(set.id(), rule, band)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            redact("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn urls() {
        use fred::types::config::ServerConfig;
        let standalone = parse_url("redis://user:pw@127.0.0.1:6380/2").unwrap();
        assert!(matches!(standalone.server, ServerConfig::Centralized { .. }));
        assert_eq!(standalone.database, Some(2));
        let cluster = parse_url("redis://:pw@10.0.0.1:7000,10.0.0.2:7001,10.0.0.3:7002").unwrap();
        match cluster.server {
            ServerConfig::Clustered { hosts, .. } => assert_eq!(hosts.len(), 3),
            other => panic!("{other:?}"),
        }
        assert_eq!(cluster.password.as_deref(), Some("pw"));
        let sentinel =
            parse_url("redis-sentinel://127.0.0.1:26379?node=127.0.0.1:26380&sentinelServiceName=mymaster").unwrap();
        assert!(matches!(sentinel.server, ServerConfig::Sentinel { .. }));
        for bad in [
            "http://x",
            "redis://a,,b",
            "127.0.0.1:6379",
            "redis://host:notaport",
            "redis-sentinel://127.0.0.1:26379",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn gcd_scales() {
        assert_eq!(gcd(10, 1_000_000), 10);
        assert_eq!(gcd(7, 1_000_000), 1);
        assert_eq!(gcd(1_000_000, 86_400_000_000), 1_000_000);
    }
}
