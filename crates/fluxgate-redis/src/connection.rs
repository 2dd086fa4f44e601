//! The connections to Redis and the deadline of every command sent through them.

use std::future::Future;
use std::time::Duration;

use fred::clients::{Client, Pool};
use fred::interfaces::ClientLike;

use crate::error::RedisError;

/// The default deadline of one script call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// The client or pool the limiter sends its commands through, and their deadline.
pub(crate) struct Connection {
    clients: Clients,
    timeout: Duration,
    cluster: bool,
}

enum Clients {
    One(Client),
    Pool(Pool),
}

impl Connection {
    /// Connections of a pool, used in turn.
    pub(crate) fn pool(pool: Pool, timeout: Duration, cluster: bool) -> Self {
        Self {
            clients: Clients::Pool(pool),
            timeout,
            cluster,
        }
    }

    /// A client the application already connected, with the default deadline.
    pub(crate) fn client(client: Client) -> Self {
        let cluster = client.is_clustered();
        Self {
            clients: Clients::One(client),
            timeout: DEFAULT_TIMEOUT,
            cluster,
        }
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
        match tokio::time::timeout(self.timeout, command).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(RedisError::Command(e)),
            Err(_) => Err(RedisError::Timeout(self.timeout)),
        }
    }
}
