//! The server's configuration: a TOML file (`--config`), overridden by flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fluxgate_core::{FailurePolicy, UnknownRuleSet};
use serde::Deserialize;

/// The address the server listens on unless configured.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8082";

/// The server's configuration. Every section and field is optional; see `docs/service.md`
/// for the file, field by field.
///
/// ```
/// let config: fluxgate_server::Config = toml::from_str(r#"
///     listen = "10.0.0.4:8082" # private, gateways only: the check API has no authentication
///     rules = "/etc/fluxgate/rules.yaml"
///     redis = "redis://127.0.0.1:6379"
///     [engine]
///     unknown_rule_set = "deny"
///     [admin]
///     token = "at least 16 random characters"
/// "#)?;
/// assert_eq!(config.listen().port(), 8082);
/// # Ok::<(), toml::de::Error>(())
/// ```
///
/// Its `Debug` shows neither the admin token nor the Redis URL's passwords.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Config {
    /// The address to listen on. Default `127.0.0.1:8082`.
    pub listen: Option<SocketAddr>,
    /// A rule file or directory (YAML, TOML, JSON), watched for changes. Exclusive with
    /// `[store]`.
    pub rules: Option<PathBuf>,
    /// The Redis that holds the buckets (and the rule store); without it, buckets are kept
    /// in memory.
    pub redis: Option<String>,
    /// The Redis limiter.
    #[serde(default)]
    pub limiter: LimiterConfig,
    /// The engine.
    #[serde(default)]
    pub engine: EngineConfig,
    /// Rules kept in Redis (`RedisRuleSetStore`), reloaded on change events.
    #[serde(default)]
    pub store: StoreConfig,
    /// Rule administration over HTTP.
    #[serde(default)]
    pub admin: AdminConfig,
    /// Limits of the HTTP API.
    #[serde(default)]
    pub http: HttpConfig,
    /// Logs.
    #[serde(default)]
    pub log: LogConfig,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            listen,
            rules,
            redis,
            limiter,
            engine,
            store,
            admin,
            http,
            log,
        } = self;
        f.debug_struct("Config")
            .field("listen", listen)
            .field("rules", rules)
            .field("redis", &redis.as_deref().map(fluxgate_redis::redact_url))
            .field("limiter", limiter)
            .field("engine", engine)
            .field("store", store)
            .field("admin", admin)
            .field("http", http)
            .field("log", log)
            .finish()
    }
}

/// `[limiter]`: the Redis limiter's options (`RedisLimiterBuilder`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LimiterConfig {
    /// The key prefix. Default `fluxgate`.
    pub prefix: Option<String>,
    /// The deadline of one decision in Redis, in milliseconds, at least 1. Default 50.
    pub timeout_ms: Option<u64>,
    /// The number of connections. Default 3.
    pub pool_size: Option<usize>,
    /// The local deny cache. Default on.
    pub deny_cache: Option<bool>,
    /// The most calls for one key in flight at once, at least 1. Default 64
    /// (`RedisLimiterBuilder::calls_in_flight_per_key`).
    pub calls_in_flight_per_key: Option<u32>,
    /// `[limiter.batching]`: batched decisions; the table turns them on. Default off.
    pub batching: Option<BatchingConfig>,
    /// The delay between reconnection attempts, in milliseconds. Default 100.
    pub reconnect_delay_ms: Option<u64>,
    /// Failures in a row that open the circuit breaker in front of Redis. Default 3.
    pub circuit_failures: Option<u32>,
    /// How long an open circuit fails decisions at once, in milliseconds. Default 250.
    pub circuit_cool_down_ms: Option<u64>,
}

impl LimiterConfig {
    /// Whether any option is given (the section is written).
    fn is_set(&self) -> bool {
        let Self {
            prefix,
            timeout_ms,
            pool_size,
            deny_cache,
            calls_in_flight_per_key,
            batching,
            reconnect_delay_ms,
            circuit_failures,
            circuit_cool_down_ms,
        } = self;
        prefix.is_some()
            || timeout_ms.is_some()
            || pool_size.is_some()
            || deny_cache.is_some()
            || calls_in_flight_per_key.is_some()
            || batching.is_some()
            || reconnect_delay_ms.is_some()
            || circuit_failures.is_some()
            || circuit_cool_down_ms.is_some()
    }
}

/// `[limiter.batching]`: batched decisions (`fluxgate_redis::Batching`): the requests the
/// service decides while its Redis calls are in flight go to Redis together, one script call
/// per batch. The table's presence turns them on; each option has `Batching`'s default.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct BatchingConfig {
    /// The most requests in one call. Default 64.
    pub max_requests: Option<usize>,
    /// How long a request waits at most for a free call, in microseconds. Default 500.
    pub max_delay_us: Option<u64>,
    /// The most batch calls in flight. Default 2.
    pub max_calls: Option<usize>,
}

impl BatchingConfig {
    /// The batching these options describe.
    pub fn batching(&self) -> fluxgate_redis::Batching {
        let mut batching = fluxgate_redis::Batching::new();
        if let Some(max) = self.max_requests {
            batching = batching.max_requests(max);
        }
        if let Some(us) = self.max_delay_us {
            batching = batching.max_delay(Duration::from_micros(us));
        }
        if let Some(max) = self.max_calls {
            batching = batching.max_calls(max);
        }
        batching
    }
}

/// `[engine]`: the engine's options (`EngineBuilder`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct EngineConfig {
    /// What to do with an unknown rule set id: `allow` (default) or `deny`.
    pub unknown_rule_set: Option<UnknownRuleSetConfig>,
    /// When the backend fails, for rules that name no policy: `fail_open`, `fail_closed`
    /// or `fallback_local` (decide in memory). Default: the request is answered 503.
    pub on_backend_failure: Option<FailurePolicyConfig>,
    /// The prefix length keying IPv6 clients. Default 64.
    pub ipv6_prefix: Option<u8>,
    /// A network-specific NAT64 prefix, a /96 (`2001:db8:64::`): its addresses are keyed
    /// as the IPv4 clients in their last 32 bits. Default: only the well-known
    /// `64:ff9b::/96`.
    pub nat64_prefix: Option<std::net::Ipv6Addr>,
}

/// `[store]`: rules kept in Redis.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct StoreConfig {
    /// Whether rules come from the Redis rule store (needs `redis`). Default `false`.
    #[serde(default)]
    pub enabled: bool,
    /// The store's namespace. Default `fluxgate:rules`.
    pub namespace: Option<String>,
    /// The change channel. Default `fluxgate:rule-changes`.
    pub channel: Option<String>,
    /// Also poll the store every this many milliseconds (a safety net for lost events).
    /// Default: no polling.
    pub poll_interval_ms: Option<u64>,
    /// Whether an empty store is a valid state (no rules). Default `false`.
    #[serde(default)]
    pub allow_empty: bool,
    /// Whether bucket resets need a grant an admin of the store wrote
    /// (`RuleChangeListenerBuilder::require_reset_grants`): a message anyone else publishes
    /// on the channel then resets nothing. Default `false`, so that a plain `PUBLISH` of a
    /// rule set id resets.
    #[serde(default)]
    pub require_reset_grants: bool,
}

/// `[admin]`: rule administration over HTTP. Its `Debug` shows whether a token is set, not
/// the token.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AdminConfig {
    /// The bearer token of the admin endpoints; without one, they are off (404).
    pub token: Option<String>,
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("token", &self.token.as_ref().map(|_| "…"))
            .finish()
    }
}

/// `[http]`: limits of the API.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct HttpConfig {
    /// The largest request body, in bytes; larger ones get 413. Default 1 MiB; a lower
    /// value is raised to 1 MiB ([`MAX_CHECK_BYTES`](fluxgate_core::api::MAX_CHECK_BYTES)),
    /// the largest check.
    pub max_body_bytes: Option<usize>,
    /// The most requests in one batch. Default 1,000.
    pub max_batch: Option<usize>,
    /// The longest a connection may take to send a request head, in milliseconds, from
    /// when it opens or from the previous answer (an idle kept-alive connection is closed
    /// then). Default 10,000.
    pub header_timeout_ms: Option<u64>,
    /// The longest a request's body may take to arrive after its head, in milliseconds;
    /// later, the request is answered 408. Default 10,000.
    pub body_timeout_ms: Option<u64>,
    /// The longest the server waits for a client to read its answer, in milliseconds, from
    /// when the connection stopped taking bytes (a client that reads nothing); then the
    /// connection is closed. Default 10,000.
    pub write_timeout_ms: Option<u64>,
}

/// `[log]`: logs on standard error.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LogConfig {
    /// `text` (default) or `json` (one object per line).
    pub format: Option<LogFormat>,
    /// A `tracing` filter, e.g. `info` (default) or `info,fluxgate_core=debug`; the
    /// `RUST_LOG` variable wins when set.
    pub level: Option<String>,
}

/// The log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The unknown rule set policy, as written in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownRuleSetConfig {
    /// Admit.
    Allow,
    /// Reject.
    Deny,
}

/// A failure policy, as written in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicyConfig {
    /// Admit.
    FailOpen,
    /// Reject.
    FailClosed,
    /// Decide in memory.
    FallbackLocal,
}

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("config file `{}`: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid: the message names the field and the line.
    #[error("config file `{}`: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        message: String,
    },
    /// A flag is wrong.
    #[error("{0}")]
    Flag(String),
    /// The options contradict each other or miss something.
    #[error("configuration: {0}")]
    Inconsistent(String),
}

/// The most a config file may hold.
const MAX_CONFIG_FILE: u64 = 1024 * 1024;

/// A config file's text: a regular file (a pipe or a device is refused before it is
/// opened) of at most [`MAX_CONFIG_FILE`] bytes.
fn read_config_file(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind, Read};
    if !std::fs::metadata(path)?.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_FILE + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_CONFIG_FILE {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("larger than {MAX_CONFIG_FILE} bytes, the most a config file may hold"),
        ));
    }
    Ok(text)
}

/// A TOML error as `line L, column C: <what is wrong>`, without the line itself: toml's own
/// message quotes it, and the line of a misspelled or malformed `token` or `redis` holds
/// the secret (the error goes to standard error, with the service's logs).
fn toml_error(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim_end();
    let Some(span) = error.span() else {
        return message.to_owned();
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!("line {line}, column {column}: {message}")
}

/// `[log] level`: a `tracing` filter whose bare words are levels. A bare word that is not a
/// level is a valid filter (every event of the target of that name) but not what anyone
/// means: a typo of a level (`inof`) would turn every log line off, the errors that stop
/// the service included. The filter is checked as [`Config::log_filter`] writes it.
fn check_log_level(level: &str) -> Result<(), String> {
    const LEVELS: [&str; 12] = [
        "trace", "debug", "info", "warn", "error", "off", "0", "1", "2", "3", "4", "5",
    ];
    let wrong = |why: String| format!("`[log] level` = `{level}`: {why}");
    let filter = normalized_filter(level);
    if filter.is_empty() {
        return Err(wrong("no level".to_owned()));
    }
    tracing_subscriber::EnvFilter::try_new(&filter).map_err(|e| wrong(e.to_string()))?;
    for directive in filter.split(',') {
        if !directive.contains('=') && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(directive)) {
            return Err(wrong(format!(
                "`{directive}` is not a level (trace, debug, info, warn, error, off) nor `target=level`"
            )));
        }
    }
    Ok(())
}

/// A filter's directives, each trimmed (around its `=` too), the empty ones left out:
/// `tracing` reads a directive with spaces around it (` info`, `info, hyper=warn`) as the
/// name of a target.
pub fn normalized_filter(level: &str) -> String {
    level
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| match d.split_once('=') {
            // `fluxgate_core =debug` would name the target `fluxgate_core `.
            Some((target, level)) => format!("{}={}", target.trim(), level.trim()),
            None => d.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl Config {
    /// The log filter of `[log] level` (default `info`), its directives trimmed: what the
    /// service's logs use unless `RUST_LOG` is set.
    pub fn log_filter(&self) -> String {
        self.log
            .level
            .as_deref()
            .map_or_else(|| "info".to_owned(), normalized_filter)
    }
}

impl From<UnknownRuleSetConfig> for UnknownRuleSet {
    fn from(value: UnknownRuleSetConfig) -> Self {
        match value {
            UnknownRuleSetConfig::Allow => UnknownRuleSet::Allow,
            UnknownRuleSetConfig::Deny => UnknownRuleSet::Deny,
        }
    }
}

impl From<FailurePolicyConfig> for FailurePolicy {
    fn from(value: FailurePolicyConfig) -> Self {
        match value {
            FailurePolicyConfig::FailOpen => FailurePolicy::FailOpen,
            FailurePolicyConfig::FailClosed => FailurePolicy::FailClosed,
            FailurePolicyConfig::FallbackLocal => FailurePolicy::FallbackLocal,
        }
    }
}

impl Config {
    /// Reads a TOML file.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Io`], or [`ConfigError::Invalid`] naming the field and the line.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = read_config_file(path).map_err(|source| ConfigError::Io {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Invalid {
            path: path.to_owned(),
            message: toml_error(&text, &e),
        })
    }

    /// Reads the flags (`--config FILE` first, then `--listen`, `--rules`, `--redis`,
    /// `--admin-token`, which override the file).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Flag`] for an unknown flag or a missing value, or the errors of
    /// [`from_file`](Self::from_file).
    pub fn from_args(args: impl IntoIterator<Item = String>) -> Result<Self, ConfigError> {
        let args: Vec<String> = args.into_iter().collect();
        let value = |i: usize, flag: &str| {
            args.get(i + 1)
                .cloned()
                .ok_or_else(|| ConfigError::Flag(format!("{flag} needs a value (try --help)")))
        };
        let mut config = match args.iter().position(|a| a == "--config") {
            Some(i) => Self::from_file(Path::new(&value(i, "--config")?))?,
            None => Self::default(),
        };
        let mut i = 0;
        while i < args.len() {
            let flag = args[i].as_str();
            match flag {
                "--config" => {}
                "--listen" => {
                    let v = value(i, flag)?;
                    config.listen = Some(v.parse().map_err(|e| ConfigError::Flag(format!("--listen {v}: {e}")))?);
                }
                "--rules" => config.rules = Some(value(i, flag)?.into()),
                "--redis" => config.redis = Some(value(i, flag)?),
                "--admin-token" => config.admin.token = Some(value(i, flag)?),
                // `--flag=value` is quoted without its value: a token or a Redis password.
                other => {
                    return Err(ConfigError::Flag(match other.split_once('=') {
                        Some((name, _)) => format!("unknown argument `{name}=…`: write `{name} VALUE` (try --help)"),
                        None => format!("unknown argument `{other}` (try --help)"),
                    }))
                }
            }
            i += 2;
        }
        config.check()?;
        Ok(config)
    }

    /// Checks that the options fit together.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Inconsistent`] saying what is missing or contradictory.
    pub fn check(&self) -> Result<(), ConfigError> {
        let problem = if self.store.enabled && self.redis.is_none() {
            Some("`[store] enabled` needs `redis`")
        } else if self.redis.is_none() && self.limiter.is_set() {
            Some(
                "`[limiter]` configures the Redis limiter and needs `redis`: without it, buckets are kept in \
                 memory, each instance of the service counting on its own",
            )
        } else if self.store.enabled && self.rules.is_some() {
            Some("rules come either from `rules` (a file) or from `[store]`, not both")
        } else if !self.store.enabled && self.rules.is_none() {
            Some("no rules: give `--rules FILE` (or `rules` in the file), or enable `[store]` with `redis`")
        } else if self.admin.token.as_deref().is_some_and(|t| t.len() < 16) {
            Some("`[admin] token` must be at least 16 characters")
        } else if [
            self.http.header_timeout_ms,
            self.http.body_timeout_ms,
            self.http.write_timeout_ms,
        ]
        .contains(&Some(0))
        {
            Some("`[http] header_timeout_ms`, `body_timeout_ms` and `write_timeout_ms` must be at least 1")
        } else if self.limiter.timeout_ms == Some(0) {
            Some("`[limiter] timeout_ms` must be at least 1: with no time to answer, every decision would fail")
        } else if self.limiter.calls_in_flight_per_key == Some(0) {
            Some("`[limiter] calls_in_flight_per_key` must be at least 1: with none, no decision could be made")
        } else if self.engine.ipv6_prefix.is_some_and(|bits| bits == 0 || bits > 128) {
            Some("`[engine] ipv6_prefix` must be 1 to 128")
        } else if self
            .engine
            .nat64_prefix
            .is_some_and(|prefix| prefix.to_bits() as u32 != 0)
        {
            Some("`[engine] nat64_prefix` must be a /96, its last 32 bits zero (such as `2001:db8:64::`)")
        } else if self.engine.nat64_prefix.is_some_and(is_reserved_translation_prefix) {
            Some(
                "`[engine] nat64_prefix` must be a translator's own prefix, not `::`, one within `::/64`, \
                 `2001::/32` (Teredo), `2002::/16` (6to4) or `fe80::/10`, nor the well-known `64:ff9b::`, \
                 which is always read",
            )
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(ConfigError::Inconsistent(problem.to_owned()));
        }
        if let Some(level) = &self.log.level {
            check_log_level(level).map_err(ConfigError::Inconsistent)?;
        }
        Ok(())
    }

    /// The address to listen on.
    pub fn listen(&self) -> SocketAddr {
        self.listen
            .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("a valid default address"))
    }

    /// The largest request body: `[http] max_body_bytes`, but never below
    /// [`MAX_CHECK_BYTES`](fluxgate_core::api::MAX_CHECK_BYTES), the largest check a gateway
    /// sends (a gateway's check of a long path answered 413 would be a failure of the
    /// service, which `fail_open` admits uncounted and which opens the gateway's circuit).
    /// A lower bound, which an earlier release took as it was, is raised (and
    /// [`Service::start`](crate::Service::start) warns).
    pub fn max_body_bytes(&self) -> usize {
        self.http
            .max_body_bytes
            .unwrap_or(1024 * 1024)
            .max(fluxgate_core::api::MAX_CHECK_BYTES)
    }

    /// The most requests in one batch.
    pub fn max_batch(&self) -> usize {
        self.http.max_batch.unwrap_or(1_000)
    }

    /// The longest a connection may take to send a request head.
    pub fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.http.header_timeout_ms.unwrap_or(10_000))
    }

    /// The longest a request's body may take to arrive.
    pub fn body_timeout(&self) -> Duration {
        Duration::from_millis(self.http.body_timeout_ms.unwrap_or(10_000))
    }

    /// The longest the server waits for a client to read its answer.
    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.http.write_timeout_ms.unwrap_or(10_000))
    }

    /// The limiter's deadline.
    pub fn limiter_timeout(&self) -> Option<Duration> {
        self.limiter.timeout_ms.map(Duration::from_millis)
    }
}

/// Whether a /96 given as a NAT64 prefix is one no translator of a network has: the
/// unspecified, loopback, IPv4-compatible, IPv4-mapped and IPv4-translated addresses (all
/// within `::/64`), Teredo, 6to4 and link-local networks (whose addresses are read
/// otherwise, or are no client's), and the well-known prefix, always read.
fn is_reserved_translation_prefix(prefix: std::net::Ipv6Addr) -> bool {
    let bits = prefix.to_bits();
    bits >> 64 == 0
        || bits >> 96 == 0x2001_0000
        || bits >> 112 == 0x2002
        || bits >> 118 == 0xfe80 >> 6
        || bits == 0x0064_ff9b_u128 << 96
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A level, a list of levels and `target=level` directives pass; a bare word that is no
    /// level (a typo, which would turn every log line off) and a malformed filter are
    /// refused, naming the option and the word.
    #[test]
    fn log_levels_are_levels() {
        for good in [
            "info",
            "WARN",
            "info,fluxgate_core=debug",
            "off",
            "fluxgate=trace",
            " info",
            "info, hyper=warn",
            "3",
        ] {
            assert_eq!(check_log_level(good), Ok(()), "{good}");
        }
        for empty in ["", " , "] {
            assert!(check_log_level(empty).unwrap_err().contains("no level"), "{empty:?}");
        }
        // As the logs use it: directives trimmed, so that ` info` is the level, not a target.
        let config = Config {
            log: LogConfig {
                level: Some(" info, hyper=warn ".to_owned()),
                ..LogConfig::default()
            },
            ..Config::default()
        };
        assert_eq!(config.log_filter(), "info,hyper=warn");
        assert_eq!(normalized_filter(" fluxgate_core = debug ,"), "fluxgate_core=debug");
        let error = check_log_level("inof").unwrap_err();
        assert!(
            error.contains("`[log] level`") && error.contains("`inof` is not a level"),
            "{error}"
        );
        assert!(check_log_level("info,warn;").is_err());
        assert!(check_log_level("fluxgate=loud").is_err());
    }

    /// A zero Redis deadline would fail every decision (and each gateway's failure policy
    /// would then decide, `fail_open` admitting everything), and no call in flight per key
    /// would let none out: both refused, naming the option.
    #[test]
    fn a_zero_redis_deadline_is_refused() {
        let redis = "rules = \"rules.yaml\"\nredis = \"redis://127.0.0.1\"\n";
        let config: Config = toml::from_str(&format!("{redis}[limiter]\ntimeout_ms = 0")).unwrap();
        let error = config.check().unwrap_err().to_string();
        assert!(error.contains("`[limiter] timeout_ms` must be at least 1"), "{error}");
        let config: Config = toml::from_str(&format!("{redis}[limiter]\ncalls_in_flight_per_key = 0")).unwrap();
        let error = config.check().unwrap_err().to_string();
        assert!(
            error.contains("`[limiter] calls_in_flight_per_key` must be at least 1"),
            "{error}"
        );
        let config: Config = toml::from_str(&format!("{redis}[limiter]\ntimeout_ms = 1")).unwrap();
        assert!(config.check().is_ok());
    }

    /// A NAT64 prefix is a /96: an address with bits past it set (a mistaken host address)
    /// or that is no address is refused, naming the option, and so is a prefix no
    /// translator of a network has (`::`, whose use would key `::1` as `0.0.0.1`).
    #[test]
    fn a_nat64_prefix_is_a_96() {
        let base = "rules = \"rules.yaml\"\n[engine]\n";
        let config: Config = toml::from_str(&format!("{base}nat64_prefix = \"2001:db8:64::\"")).unwrap();
        assert!(config.check().is_ok());
        assert_eq!(config.engine.nat64_prefix, Some("2001:db8:64::".parse().unwrap()));
        let config: Config = toml::from_str(&format!("{base}nat64_prefix = \"2001:db8:64::1\"")).unwrap();
        let error = config.check().unwrap_err().to_string();
        assert!(error.contains("`[engine] nat64_prefix` must be a /96"), "{error}");
        for reserved in [
            "::",
            "::ffff:0:0",
            "2001:0:1::",
            "2002:c000:201::",
            "fe80::",
            "64:ff9b::",
        ] {
            let config: Config = toml::from_str(&format!("{base}nat64_prefix = \"{reserved}\"")).unwrap();
            let error = config.check().unwrap_err().to_string();
            assert!(error.contains("a translator's own prefix"), "{reserved}: {error}");
        }
        let config: Config = toml::from_str(&format!("{base}nat64_prefix = \"64:ff9b:1::\"")).unwrap();
        assert!(config.check().is_ok(), "the local-use prefix of RFC 8215");
        let error = toml::from_str::<Config>(&format!("{base}nat64_prefix = \"2001:db8:64::/96\""))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(error.contains("nat64_prefix"), "{error}");
    }

    /// A connection time limit of zero would close every connection at once: refused, each
    /// of the three, naming them.
    #[test]
    fn a_zero_connection_time_limit_is_refused() {
        for option in ["header_timeout_ms", "body_timeout_ms", "write_timeout_ms"] {
            let config: Config = toml::from_str(&format!("rules = \"rules.yaml\"\n[http]\n{option} = 0")).unwrap();
            let error = config.check().unwrap_err().to_string();
            assert!(
                error.contains(option) && error.contains("must be at least 1"),
                "{error}"
            );
            let config: Config = toml::from_str(&format!("rules = \"rules.yaml\"\n[http]\n{option} = 1")).unwrap();
            assert!(config.check().is_ok(), "{option} = 1");
        }
    }

    /// A misspelled option, or one at the wrong level, is refused naming it, never ignored
    /// for a default that protects less (resets open to any publisher, admin endpoints off or
    /// on with another token, fail-open decisions, no deadline), and so is a value of the
    /// wrong type (a string for a boolean, a negative or fractional number of ms).
    #[test]
    fn misspelled_or_misplaced_options_are_refused() {
        let base = "rules = \"rules.yaml\"\n";
        for (text, named) in [
            ("[store]\nrequire_reset_grant = true", "require_reset_grant"),
            ("[store]\nrequire-reset-grants = true", "require-reset-grants"),
            ("require_reset_grants = true", "require_reset_grants"),
            ("[admin]\ntokn = \"0123456789abcdefgh\"", "tokn"),
            ("admin_token = \"0123456789abcdefgh\"", "admin_token"),
            ("[engine]\non_backend_failures = \"fail_closed\"", "on_backend_failures"),
            ("[engine]\nunknown_rule_sets = \"deny\"", "unknown_rule_sets"),
            ("[limiter]\ntimeout = 10", "timeout"),
            ("[limiter]\non_backend_failure = \"fail_closed\"", "on_backend_failure"),
            ("[http]\nheader_timeout = 1000", "header_timeout"),
            ("[server]\nlisten = \"127.0.0.1:1\"", "server"),
            ("[engine]\nunknown_rule_set = \"Deny\"", "Deny"),
            ("[engine]\non_backend_failure = \"fail-closed\"", "fail-closed"),
            ("[store]\nrequire_reset_grants = \"true\"", "require_reset_grants"),
            ("[limiter]\ntimeout_ms = -1", "timeout_ms"),
            ("[limiter]\ntimeout_ms = 1.5", "timeout_ms"),
        ] {
            let error = toml::from_str::<Config>(&format!("{base}{text}"))
                .map(|_| ())
                .expect_err(text)
                .to_string();
            assert!(error.contains(named), "{text}: {error}");
        }
    }

    /// `[limiter]` without `redis` (a `--redis` flag left out of one deployment) would run
    /// the service on in-memory buckets, each instance admitting the whole limit: refused,
    /// naming the option. With `--redis`, or with no `[limiter]` option, it starts.
    #[test]
    fn limiter_options_without_redis_are_refused() {
        let config: Config = toml::from_str("rules = \"rules.yaml\"\n[limiter]\ntimeout_ms = 20").unwrap();
        let error = config.check().unwrap_err().to_string();
        assert!(
            error.contains("`[limiter]` configures the Redis limiter and needs `redis`"),
            "{error}"
        );
        let config: Config = toml::from_str("rules = \"rules.yaml\"\n[limiter.batching]").unwrap();
        assert!(config.check().is_err());
        let config: Config =
            toml::from_str("rules = \"rules.yaml\"\nredis = \"redis://127.0.0.1\"\n[limiter]\ntimeout_ms = 20")
                .unwrap();
        assert!(config.check().is_ok());
        let config: Config = toml::from_str("rules = \"rules.yaml\"\n[limiter]").unwrap();
        assert!(config.check().is_ok());
    }

    /// The configuration documented in `docs/service.md` is one this server reads, with
    /// every option it shows.
    #[test]
    fn the_documented_configuration_parses() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/service.md")).unwrap();
        let block = doc
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .unwrap();
        let config: Config = toml::from_str(block).unwrap();
        assert!(!config.store.require_reset_grants && !config.store.allow_empty);
        assert_eq!(config.store.poll_interval_ms, Some(60_000));
    }

    /// The configuration printed with `{:?}` shows neither the admin token nor the Redis
    /// password.
    #[test]
    fn debug_shows_no_secret() {
        let config: Config = toml::from_str(
            "rules = \"rules.yaml\"\nredis = \"redis://app:redis-secret@127.0.0.1:6379\"\n[admin]\ntoken = \"admin-secret-0123456789\"\n",
        )
        .unwrap();
        let shown = format!("{config:?}");
        assert!(
            !shown.contains("redis-secret") && !shown.contains("admin-secret"),
            "{shown}"
        );
        assert!(shown.contains("redis://app:***@127.0.0.1:6379"), "{shown}");
    }

    /// A config file refused for a misspelled option shows where, and what is wrong, but not
    /// the line itself: the line of a misspelled `token` holds the token, and the error is
    /// printed to the service's standard error, with its logs.
    #[test]
    fn a_refused_config_file_quotes_no_secret() {
        let file = std::env::temp_dir().join(format!("fluxgate-config-{}-quoted.toml", std::process::id()));
        for text in [
            "rules = \"rules.yaml\"\n[admin]\ntokn = \"admin-secret-0123456789\"\n",
            "rules = \"rules.yaml\"\nredis_url = \"redis://app:redis-secret@127.0.0.1\"\n",
            "rules = \"rules.yaml\"\n[admin]\ntoken = \"admin-secret-0123456789\n",
        ] {
            std::fs::write(&file, text).unwrap();
            let error = Config::from_file(&file).unwrap_err().to_string();
            assert!(!error.contains("secret"), "{error}");
            assert!(error.contains("line 3") || error.contains("line 2"), "{error}");
        }
        std::fs::remove_file(&file).unwrap();
    }

    /// A flag written `--admin-token=<token>` is not a flag this server reads: the error
    /// names it without its value, which would print the token to standard error.
    #[test]
    fn an_unknown_flag_is_quoted_without_its_value() {
        for flag in [
            "--admin-token=admin-secret-0123456789",
            "--redis=redis://app:redis-secret@127.0.0.1",
        ] {
            let args = ["--rules", "rules.yaml", flag].map(str::to_owned);
            let error = Config::from_args(args).unwrap_err().to_string();
            assert!(!error.contains("secret"), "{error}");
            assert!(error.contains(flag.split('=').next().unwrap()), "{error}");
        }
    }

    /// A config file that is no regular file, or too large, is refused before it is read
    /// whole.
    #[test]
    fn a_config_file_is_a_bounded_regular_file() {
        let error = Config::from_file(Path::new("/dev/zero")).unwrap_err();
        assert!(error.to_string().contains("not a regular file"), "{error}");
        let large = std::env::temp_dir().join(format!("fluxgate-config-{}-large.toml", std::process::id()));
        std::fs::write(&large, "#".repeat(2 * 1024 * 1024)).unwrap();
        let error = Config::from_file(&large).unwrap_err();
        assert!(error.to_string().contains("larger than"), "{error}");
        std::fs::remove_file(&large).unwrap();
    }
}
