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
//! `lua/token_bucket.lua` (its header states the `KEYS` / `ARGV` / reply contract) reads
//! Redis `TIME` in microseconds, evaluates every band, and writes only when every enforced
//! band admits the request. It is loaded with `SCRIPT LOAD` when the limiter connects and
//! called with `EVALSHA`; after `NOSCRIPT` (a restart, a failover, `SCRIPT FLUSH`) it is
//! loaded again and the call retried, so no request fails for it.
//!
//! # Keys
//!
//! `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<capacity>/<window ms>`. Rule set and
//! rule ids and band names are validated ids, and key values are encoded by
//! [`fluxgate_core::key`] so that no user value contains `{`, `}` or `:`, nor grows without
//! bound. The braces make all bands of one rule share a hash slot. A key expires one
//! second after its band's window, when the bucket is full again anyway.
//!
//! # Scope of this release
//!
//! A standalone Redis (`redis://` or `rediss://`, with database, user and password).
//! Cluster and Sentinel URLs are rejected with an error saying so.

#![deny(unsafe_code)]

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest, RateLimiter, Wait};
use fluxgate_core::{BandReport, BoxError, MaybeReady};
use fred::clients::{Client, Pool};
use fred::interfaces::ClientLike;
use fred::types::config::{Config, ReconnectPolicy};
use fred::types::scripts::Script;
use fred::types::Builder;

/// The token-bucket script (see `lua/README.md`).
pub const TOKEN_BUCKET_LUA: &str = include_str!("../lua/token_bucket.lua");

/// The largest `capacity × window / gcd(capacity, window µs)` the script computes with:
/// twice it stays below 2^53, so every number in the script is an exact integer.
pub const MAX_SCALED_CAPACITY: u64 = 1 << 52;

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
    /// A band is too large for exact integer arithmetic in the script.
    #[error(
        "rule `{rule}`, band `{band}`: capacity {capacity} per {window:?} is too large for exact arithmetic in \
         Redis (capacity × window in µs / gcd must stay below 2^52); use a smaller capacity or a window whose \
         microseconds the capacity divides"
    )]
    BandTooLarge {
        /// The rule.
        rule: String,
        /// The band.
        band: String,
        /// Its capacity.
        capacity: u64,
        /// Its window.
        window: Duration,
    },
}

/// The Redis limiter. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    clients: Arc<Clients>,
    script: Script,
    prefix: String,
    timeout: Duration,
    denied: Option<DenyCache>,
}

/// Bands known to reject a request until an instant: answered locally, without Redis.
type DenyCache = moka::sync::Cache<String, Denial>;

/// A band that rejected: until `until` it rejects every request of the same cost, because
/// only time adds tokens to a bucket.
#[derive(Debug, Clone, Copy)]
struct Denial {
    until: Instant,
    remaining: u64,
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
    /// A builder for `url`: `redis://[user:password@]host:port[/db]` or `rediss://…`.
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
    /// on the first call that finds it missing.
    pub fn from_client(client: Client, prefix: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                clients: Arc::new(Clients::One(client)),
                script: Script::from_lua(TOKEN_BUCKET_LUA),
                prefix: prefix.into(),
                timeout: DEFAULT_TIMEOUT,
                denied: Some(deny_cache()),
            }),
        }
    }

    /// A limiter sharing this one's connections, with another key prefix.
    pub fn with_prefix(&self, prefix: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                clients: self.inner.clients.clone(),
                script: self.inner.script.clone(),
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
    /// never rejects a request Redis would admit, and never admits one.
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
        if self.url.contains(',') || self.url.starts_with("redis-cluster://") {
            return Err(url_error(
                "Redis Cluster is not supported yet; use a standalone redis:// URL".into(),
            ));
        }
        if self.url.starts_with("redis-sentinel://") {
            return Err(url_error(
                "Redis Sentinel is not supported yet; use a standalone redis:// URL".into(),
            ));
        }
        if !(self.url.starts_with("redis://") || self.url.starts_with("rediss://")) {
            return Err(url_error("expected a URL starting with redis:// or rediss://".into()));
        }
        let config = Config::from_url(&self.url).map_err(|e| url_error(e.details().to_string()))?;
        let mut builder = Builder::from_config(config);
        let delay = u32::try_from(self.reconnect_delay.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
        builder.set_policy(ReconnectPolicy::new_constant(0, delay));
        builder.with_performance_config(|p| p.default_command_timeout = self.timeout);
        builder.with_connection_config(|c| c.connection_timeout = self.timeout.max(Duration::from_secs(1)));
        let pool = builder.build_pool(self.pool_size).map_err(RedisError::Connect)?;
        pool.init().await.map_err(RedisError::Connect)?;
        let script = Script::from_lua(TOKEN_BUCKET_LUA);
        script.load(pool.next()).await.map_err(RedisError::Connect)?;
        Ok(RedisLimiter {
            inner: Arc::new(Inner {
                clients: Arc::new(Clients::Pool(pool)),
                script,
                prefix: self.prefix,
                timeout: self.timeout,
                denied: self.deny_cache.then(deny_cache),
            }),
        })
    }
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

/// A request encoded for the script.
struct Call {
    keys: Vec<String>,
    args: Vec<i64>,
    /// Per band: the deny-cache key of an enforced band (its key and the cost), or `None`.
    deny_keys: Vec<Option<String>>,
}

impl RedisLimiter {
    fn encode(&self, request: &AcquireRequest<'_>) -> Result<Call, RedisError> {
        let mut keys = Vec::new();
        let mut deny_keys = Vec::new();
        let mut args = vec![request.buckets.len() as i64];
        for bucket in request.buckets {
            let rule = bucket.rule;
            args.extend([
                rule.permits() as i64,
                i64::from(bucket.shadow()),
                rule.bands().len() as i64,
            ]);
            for band in rule.bands().iter() {
                let capacity = band.capacity();
                let window_us = u64::try_from(band.window().as_micros()).unwrap_or(u64::MAX);
                let g = gcd(capacity, window_us);
                let (scale, interval) = (capacity / g, window_us / g);
                if capacity
                    .checked_mul(interval)
                    .is_none_or(|cap| cap > MAX_SCALED_CAPACITY)
                {
                    return Err(RedisError::BandTooLarge {
                        rule: rule.id().to_string(),
                        band: band.name().to_string(),
                        capacity,
                        window: band.window(),
                    });
                }
                let window_ms = band.window().as_millis();
                keys.push(format!(
                    "{}:{{{}:{}:{}}}:{}:{capacity}/{window_ms}",
                    self.inner.prefix,
                    bucket.rule_set,
                    rule.id(),
                    bucket.key.as_str(),
                    band.name()
                ));
                let ttl_ms = i64::try_from(window_ms).unwrap_or(i64::MAX / 2) + 1_000;
                deny_keys.push((!bucket.shadow()).then(|| format!("{}#{}", keys[keys.len() - 1], rule.permits())));
                args.extend([capacity as i64, scale as i64, interval as i64, ttl_ms]);
            }
        }
        Ok(Call { keys, args, deny_keys })
    }
}

/// What the limiter needs of the request to read the reply, owned: per band, its rule's
/// id and mode and the band.
struct Shape {
    bands: Vec<(Arc<str>, bool, fluxgate_core::Band)>,
}

fn decode(shape: &Shape, reply: &[i64]) -> Result<AcquireOutcome, RedisError> {
    let expected = 3 + 4 * shape.bands.len();
    if reply.len() != expected {
        return Err(RedisError::Reply(format!(
            "{} numbers, expected {expected}",
            reply.len()
        )));
    }
    let now_us = u64::try_from(reply[2]).map_err(|_| RedisError::Reply("negative time".into()))?;
    let now_ns = now_us.saturating_mul(1_000);
    let nonneg = |v: i64| u64::try_from(v).unwrap_or(0);
    let bands = shape
        .bands
        .iter()
        .zip(reply[3..].chunks_exact(4))
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
                reset_at: std::time::UNIX_EPOCH + Duration::from_nanos(now_ns) + reset_after,
                allowed: r[0] == 1,
                shadow: *shadow,
                wait,
            }
        })
        .collect();
    Ok(AcquireOutcome {
        allowed: reply[0] == 1,
        shadow_allowed: reply[1] == 1,
        now_unix_nanos: now_ns,
        bands,
    })
}

/// The result of [`RedisLimiter::health`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    /// How long a `PING` took.
    pub latency: Duration,
}

impl RedisLimiter {
    /// Sends `PING` within the limiter's deadline and reports how long it took.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] or [`RedisError::Timeout`] when Redis does not answer.
    pub async fn health(&self) -> Result<Health, RedisError> {
        let start = Instant::now();
        let ping = self.inner.clients.next().ping::<String>(None);
        match tokio::time::timeout(self.inner.timeout, ping).await {
            Ok(Ok(_)) => Ok(Health {
                latency: start.elapsed(),
            }),
            Ok(Err(e)) => Err(RedisError::Command(e)),
            Err(_) => Err(RedisError::Timeout(self.inner.timeout)),
        }
    }

    /// A rejection from the deny cache, when a band of the request is known to reject it.
    fn denied_locally(&self, shape: &Shape, deny_keys: &[Option<String>], now: Instant) -> Option<AcquireOutcome> {
        let cache = self.inner.denied.as_ref()?;
        let (index, denial) = deny_keys.iter().enumerate().find_map(|(i, key)| {
            let denial = cache.get(key.as_ref()?)?;
            (denial.until > now).then_some((i, denial))
        })?;
        let (rule, shadow, band) = &shape.bands[index];
        let wait = denial.until - now;
        let now_unix = std::time::SystemTime::now();
        let now_ns = now_unix
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        // Only the denying band is known; the others were not asked.
        let report = BandReport {
            rule: rule.clone(),
            band: band.name().clone(),
            labeled: band.label().is_some(),
            limit: band.capacity(),
            remaining: denial.remaining,
            window: band.window(),
            reset_after: band.window(),
            reset_at: now_unix + band.window(),
            allowed: false,
            shadow: *shadow,
            wait: Wait::After(wait.max(Duration::from_micros(1))),
        };
        Some(AcquireOutcome {
            allowed: false,
            shadow_allowed: true,
            now_unix_nanos: now_ns,
            bands: vec![report],
        })
    }
}

impl RateLimiter for RedisLimiter {
    fn acquire(&self, request: &AcquireRequest<'_>) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let call = match self.encode(request) {
            Ok(call) => call,
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
        if let Some(outcome) = self.denied_locally(&shape, &call.deny_keys, start) {
            return MaybeReady::ready(Ok(outcome));
        }
        let this = self.inner.clone();
        MaybeReady::boxed(async move {
            let client = this.clients.next();
            let Call { keys, args, deny_keys } = call;
            let script = this.script.evalsha_with_reload::<Vec<i64>, _, _>(client, keys, args);
            let reply = match tokio::time::timeout(this.timeout, script).await {
                Ok(Ok(reply)) => reply,
                Ok(Err(e)) => return Err(RedisError::Command(e).into()),
                Err(_) => return Err(RedisError::Timeout(this.timeout).into()),
            };
            let outcome = decode(&shape, &reply)?;
            if let Some(cache) = &this.denied {
                // Counted from before the call, so a denial never outlives the real wait.
                for (report, key) in outcome.bands.iter().zip(deny_keys) {
                    if let (Wait::After(wait), Some(key)) = (report.wait, key) {
                        cache.insert(
                            key,
                            Denial {
                                until: start + wait,
                                remaining: report.remaining,
                            },
                        );
                    }
                }
            }
            Ok(outcome)
        })
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
    fn gcd_scales() {
        assert_eq!(gcd(10, 1_000_000), 10);
        assert_eq!(gcd(7, 1_000_000), 1);
        assert_eq!(gcd(1_000_000, 86_400_000_000), 1_000_000);
    }
}
