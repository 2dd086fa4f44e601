//! The connections to Redis and the deadline of every command sent through them.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fred::clients::{Client, Pool};
use fred::interfaces::ClientLike;
use fred::types::config::{ReconnectPolicy, ServerConfig, UnresponsiveConfig};
use fred::types::{Builder, ConnectHandle};

use crate::error::RedisError;
use crate::url::{parse_url, redact};

/// The default deadline of one script call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// A client builder for `url` (standalone, Cluster or Sentinel) that reconnects every
/// `reconnect_delay` and counts a connection dead once a command of it has gone
/// `unanswered` that long (see [`unresponsive`]), and whether `url` names a cluster.
///
/// # Errors
///
/// [`RedisError::Url`] for a URL that cannot be used (shown without its password).
pub(crate) fn builder(
    url: &str,
    reconnect_delay: Duration,
    unanswered: Duration,
) -> Result<(Builder, bool), RedisError> {
    let config = parse_url(url).map_err(|reason| RedisError::Url {
        url: redact(url),
        reason,
    })?;
    let cluster = matches!(config.server, ServerConfig::Clustered { .. });
    let mut builder = Builder::from_config(config);
    let delay = u32::try_from(reconnect_delay.as_millis()).unwrap_or(u32::MAX).max(1);
    builder.set_policy(ReconnectPolicy::new_constant(0, delay));
    builder.with_connection_config(|c| {
        // 2 s at most for a new connection's own commands (`HELLO`, `CLUSTER SLOTS`…), not
        // fred's 10 s: after a failover, a reconnection that reaches the old primary, which
        // still accepts connections without answering, asks the sentinels again that soon.
        c.internal_command_timeout = unanswered.min(Duration::from_secs(2));
        c.unresponsive = unresponsive(unanswered);
    });
    Ok((builder, cluster))
}

/// When a connection counts as dead although it is still open: a command of it unanswered
/// for `max_timeout`, checked four times as often. fred then closes it and connects again,
/// asking the sentinels for the primary or the cluster for its slots again. Without it, a
/// primary that stops answering without closing its connections (a frozen process, a host
/// gone, a network partition) keeps every connection to it after a failover has promoted
/// another one, until TCP gives up, minutes later.
pub(crate) fn unresponsive(max_timeout: Duration) -> UnresponsiveConfig {
    UnresponsiveConfig {
        max_timeout: Some(max_timeout),
        interval: (max_timeout / 4).max(Duration::from_millis(10)),
    }
}

/// The client or pool the limiter sends its commands through, and their deadline.
#[derive(Clone)]
pub(crate) struct Connection {
    clients: Clients,
    timeout: Duration,
    /// The timeout fred applies to every command of these clients, when the crate set it.
    fred_timeout: Option<Duration>,
    cluster: bool,
    /// The connection task of each client of a pool the crate connected, in the pool's
    /// order (see [`Connection::revive`]).
    tasks: Option<Arc<Mutex<Vec<ConnectHandle>>>>,
}

#[derive(Clone)]
enum Clients {
    One(Client),
    Pool(Pool),
}

impl Connection {
    /// Connections of a pool, used in turn, whose every command fred times out after
    /// `timeout` (its `default_command_timeout`; fred reads zero as no timeout at all).
    pub(crate) fn pool(pool: Pool, timeout: Duration, cluster: bool) -> Self {
        Self {
            clients: Clients::Pool(pool),
            timeout,
            fred_timeout: (!timeout.is_zero()).then_some(timeout),
            cluster,
            tasks: None,
        }
    }

    /// The same connections, whose clients' connection tasks (in the pool's order) the
    /// crate started: [`Connection::revive`] starts one again when it ends.
    pub(crate) fn with_tasks(mut self, tasks: Vec<ConnectHandle>) -> Self {
        self.tasks = Some(Arc::new(Mutex::new(tasks)));
        self
    }

    /// Starts again the connection task of any client of the pool whose task ended. fred
    /// ends a client's task on some errors of its own (on a cluster, when it gives up
    /// following `ASK`, see `docs/redis.md`), and does not start it again: every later
    /// command of that client would wait in vain for its deadline, and the failure policy
    /// would answer a share of the decisions for as long as the process runs. Called after
    /// a failed call; a client the application connected is its own.
    pub(crate) fn revive(&self) {
        let (Some(tasks), Clients::Pool(pool)) = (&self.tasks, &self.clients) else {
            return;
        };
        let mut tasks = tasks.lock().unwrap_or_else(PoisonError::into_inner);
        for (task, client) in tasks.iter_mut().zip(pool.clients()) {
            if task.is_finished() {
                tracing::warn!(
                    client = %client.id(),
                    "a Redis client's connection task ended; connecting it again"
                );
                *task = client.connect();
            }
        }
    }

    /// A client the application already connected, with the default deadline.
    pub(crate) fn client(client: Client) -> Self {
        let cluster = client.is_clustered();
        Self {
            clients: Clients::One(client),
            timeout: DEFAULT_TIMEOUT,
            fred_timeout: None,
            cluster,
            tasks: None,
        }
    }

    /// Whether fred already times out every command after the deadline, so that a command
    /// needs no timeout of its own.
    pub(crate) fn fred_keeps_the_deadline(&self) -> bool {
        self.fred_timeout == Some(self.timeout)
    }

    /// The same connections with another deadline.
    pub(crate) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The client for the next command.
    pub(crate) fn next(&self) -> &Client {
        match &self.clients {
            Clients::One(c) => c,
            Clients::Pool(p) => p.next(),
        }
    }

    /// The deadline of one call.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the connections go to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// Awaits `command` within the deadline.
    pub(crate) async fn within_deadline<T>(
        &self,
        command: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        self.within(self.timeout, command).await
    }

    /// Awaits `command` within `bound` (what is left of the deadline); a command that
    /// outlasts it is a [`RedisError::Timeout`] of the deadline.
    pub(crate) async fn within<T>(
        &self,
        bound: Duration,
        command: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        let result = match tokio::time::timeout(bound, command).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => RedisError::command(e),
            Err(_) => RedisError::Timeout(self.timeout),
        };
        self.revive();
        Err(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fred reads a zero command timeout as none: a zero deadline is then kept by the
    /// limiter's own timer, never left to fred.
    #[test]
    fn fred_keeps_only_a_deadline_it_applies() {
        let pool = || fred::types::Builder::default_centralized().build_pool(1).unwrap();
        assert!(Connection::pool(pool(), Duration::from_millis(50), false).fred_keeps_the_deadline());
        assert!(!Connection::pool(pool(), Duration::ZERO, false).fred_keeps_the_deadline());
        let other = Connection::pool(pool(), Duration::from_millis(50), false).with_timeout(Duration::from_secs(1));
        assert!(!other.fred_keeps_the_deadline());
        assert!(!Connection::client(fred::clients::Client::default()).fred_keeps_the_deadline());
    }
}
