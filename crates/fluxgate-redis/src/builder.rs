//! [`RedisLimiterBuilder`]: a [`RedisLimiter`] from a URL.

use std::time::Duration;

use fred::interfaces::ClientLike;
use futures_util::future::join_all;

use crate::batch::Batching;
use crate::connection::{self, Connection, DEFAULT_TIMEOUT};
use crate::error::RedisError;
use crate::in_flight::DEFAULT_CALLS_PER_KEY;
use crate::limiter::RedisLimiter;
use crate::script::Scripts;

/// Builds a [`RedisLimiter`] from a URL. Its `Debug` shows the URL without its passwords.
#[derive(Clone)]
pub struct RedisLimiterBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
    pool_size: usize,
    deny_cache: bool,
    calls_per_key: u64,
    reconnect_delay: Duration,
    batching: Option<Batching>,
}

impl std::fmt::Debug for RedisLimiterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Every field named, so that a new one is shown (or hidden) on purpose.
        let Self {
            url,
            prefix,
            timeout,
            pool_size,
            deny_cache,
            calls_per_key,
            reconnect_delay,
            batching,
        } = self;
        f.debug_struct("RedisLimiterBuilder")
            .field("url", &crate::url::redact(url))
            .field("prefix", prefix)
            .field("timeout", timeout)
            .field("pool_size", pool_size)
            .field("deny_cache", deny_cache)
            .field("calls_per_key", calls_per_key)
            .field("reconnect_delay", reconnect_delay)
            .field("batching", batching)
            .finish()
    }
}

impl RedisLimiter {
    /// A builder for `url`: `redis://[user:password@]host:port[/db]`, or several
    /// comma-separated `host:port` nodes of a cluster; `rediss://…` (TLS) only when fred is
    /// built with a TLS client (a TLS feature of fred in the application's dependencies):
    /// [`connect`](RedisLimiterBuilder::connect) refuses it otherwise, rather than connect in plain text.
    pub fn builder(url: impl Into<String>) -> RedisLimiterBuilder {
        RedisLimiterBuilder {
            url: url.into(),
            prefix: "fluxgate".to_owned(),
            timeout: DEFAULT_TIMEOUT,
            pool_size: 3,
            deny_cache: true,
            calls_per_key: DEFAULT_CALLS_PER_KEY,
            reconnect_delay: Duration::from_millis(100),
            batching: None,
        }
    }
}

impl RedisLimiterBuilder {
    /// The key prefix. Default `fluxgate`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The deadline of one script call (including a reload after `NOSCRIPT`). Default 50 ms.
    /// Zero is refused by [`connect`](Self::connect): no call would ever be answered in
    /// time, and every decision would be left to the failure policy (which admits by
    /// default). What [`connect`](Self::connect) itself asks of Redis (connecting, loading
    /// the scripts, reading its memory policy) has this deadline or a second, whichever is
    /// longer: a busy Redis may take longer than a decision's deadline to compile a script.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The number of connections, used in turn. Default 3: with more, each connection
    /// carries fewer calls at once, and Redis reads and answers them in more, smaller
    /// pieces (`docs/benchmarks.md`, "Connections").
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The local deny cache (on by default): after a band rejects a request with a
    /// retry-after of T, requests of the same cost that need that band are rejected
    /// locally, without a Redis call, until T has passed. It never admits a request. On a
    /// standalone server only time adds tokens, so it never rejects one Redis would admit
    /// either (local leases and waiters aside, which give permits back); on a cluster, the
    /// refunds that follow a refusal in one hash slot give permits back in the others,
    /// and a denial remembered meanwhile of a band such a refund frees rejects what Redis
    /// would admit, until it ends (see `docs/security.md`, "The deny cache").
    pub fn deny_cache(mut self, on: bool) -> Self {
        self.deny_cache = on;
        self
    }

    /// The most calls for one key (one rule's bucket of one key value) in flight at once.
    /// Default 64; at least 1.
    ///
    /// No more calls of a bucket go out at once than its rule admits (`capacity /
    /// permits` of its smallest band), nor than this: a request beyond waits in the
    /// process until a call returns, asks the deny cache again, and then makes its call
    /// with a deadline of its own. Without the bound, a burst of one client sent at once
    /// was a call per request, thousands queued for the connections past the deadline,
    /// and the failure policy answered them (`fail_open` admitted them uncounted; see
    /// `docs/security.md`, "The deny cache"). Raise it for a key busier than this many
    /// calls per round trip to Redis (a global rule of more than 64,000 decisions a second
    /// on one instance at 1 ms), knowing that a burst of that key can then hold more calls
    /// out than the connections answer within the deadline.
    pub fn calls_in_flight_per_key(mut self, most: u32) -> Self {
        self.calls_per_key = u64::from(most.max(1));
        self
    }

    /// The delay between reconnection attempts after a connection is lost; attempts never
    /// stop. Default 100 ms.
    pub fn reconnect_delay(mut self, delay: Duration) -> Self {
        self.reconnect_delay = delay;
        self
    }

    /// Batched decisions ([`Batching`]): the requests decided at the same time go to Redis
    /// together, one script call per batch, each still decided all or nothing in the
    /// order it arrived. Off by default (`None`): one call per request.
    pub fn batching(mut self, batching: impl Into<Option<Batching>>) -> Self {
        self.batching = batching.into();
        self
    }

    /// Checks the URL, connects and loads the script, then reads Redis's memory policy
    /// (`CONFIG GET maxmemory*`) and logs a warning when Redis may evict the limiter's keys
    /// ([`MemoryPolicy::evicts_counters`](crate::MemoryPolicy::evicts_counters)); a policy
    /// that cannot be read (`CONFIG` refused or renamed) is noted at info level, and the
    /// limiter connects all the same.
    ///
    /// # Errors
    ///
    /// [`RedisError::Option`] for a zero [`timeout`](Self::timeout), [`RedisError::Url`]
    /// for a URL that cannot be used, [`RedisError::Connect`] when Redis cannot be reached
    /// or the script not loaded.
    pub async fn connect(self) -> Result<RedisLimiter, RedisError> {
        if self.timeout.is_zero() {
            return Err(RedisError::Option {
                option: "timeout",
                reason: "the deadline is zero, so every decision would time out and be left to the \
                         failure policy (no deadline is not an option: give one of at least 1ms)",
            });
        }
        // A connection with a command unanswered for the deadline (a second at least)
        // counts as dead. Every command of the limiter is timed out by fred at the deadline
        // first, so none in flight is written again on the new connection.
        let unanswered = self.timeout.max(Duration::from_secs(1));
        let (mut builder, cluster) = connection::builder(&self.url, self.reconnect_delay, unanswered)?;
        builder.with_performance_config(|p| p.default_command_timeout = self.timeout);
        builder.with_connection_config(|c| c.connection_timeout = unanswered);
        let pool = builder.build_pool(self.pool_size).map_err(RedisError::Connect)?;
        // Each client's connection task is kept, to be started again if it ends
        // ([`Connection::revive`]).
        let tasks = join_all(pool.clients().iter().map(ClientLike::init)).await;
        let tasks = match tasks.into_iter().collect::<Result<Vec<_>, _>>() {
            Ok(tasks) => tasks,
            Err(e) => {
                // The clients connected are of no use without the others.
                for client in pool.clients() {
                    let _ = client.quit().await;
                }
                return Err(RedisError::Connect(e));
            }
        };
        let connection = Connection::pool(pool.clone(), self.timeout, cluster)
            .with_tasks(tasks)
            .with_liveness(unanswered);
        let scripts = Scripts::new(connection);
        if let Err(e) = scripts.load(unanswered).await {
            // No limiter: its clients would otherwise keep reconnecting for good.
            for client in pool.clients() {
                let _ = client.quit().await;
            }
            return Err(e);
        }
        // A Redis that evicts keys would let a client renew its limit by making keys:
        // warned of here, once (see `docs/redis.md`, "Memory").
        crate::memory::warn_of_eviction(scripts.connection(), unanswered).await;
        Ok(RedisLimiter::new(
            scripts,
            self.prefix,
            (self.deny_cache, self.calls_per_key),
            self.batching,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A builder printed with `{:?}` (a log line, an `expect` message, a test's output)
    /// shows its URL without the password.
    #[test]
    fn a_builder_shows_no_password() {
        let builder = RedisLimiter::builder("redis://app:builder-secret@127.0.0.1:6379/0");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("builder-secret"), "{shown}");
        assert!(shown.contains("redis://app:***@127.0.0.1:6379/0"), "{shown}");
    }

    /// A zero deadline times every decision out, and the default failure policy admits
    /// them all: the builder refuses it, naming the option, before it reaches for Redis
    /// (nothing listens on the port).
    #[tokio::test]
    async fn a_zero_deadline_is_refused() {
        let error = RedisLimiter::builder("redis://127.0.0.1:1")
            .timeout(Duration::ZERO)
            .connect()
            .await
            .unwrap_err();
        assert!(matches!(error, RedisError::Option { option: "timeout", .. }), "{error}");
        assert!(
            error.to_string().starts_with("redis limiter option `timeout`"),
            "{error}"
        );
    }
}
