//! The health check: `PING`, and on a cluster the cluster's state.

use std::time::{Duration, Instant};

use fred::interfaces::{ClientLike, ClusterInterface};

use crate::connection::Connection;
use crate::error::RedisError;

/// The result of [`RedisLimiter::health`](crate::RedisLimiter::health).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// How long a `PING` took.
    pub latency: Duration,
    /// On a cluster, `cluster_state` from `CLUSTER INFO` (`ok` or `fail`).
    pub cluster_state: Option<String>,
}

/// Sends `PING`, and on a cluster `CLUSTER INFO`, each within the deadline.
///
/// # Errors
///
/// [`RedisError::Command`] or [`RedisError::Timeout`] when Redis does not answer.
pub(crate) async fn check(connection: &Connection) -> Result<Health, RedisError> {
    let client = connection.next();
    let start = Instant::now();
    connection.within_deadline(client.ping::<String>(None)).await?;
    let latency = start.elapsed();
    let cluster_state = if connection.is_cluster() {
        let info: String = connection.within_deadline(client.cluster_info()).await?;
        info.lines()
            .find_map(|l| l.strip_prefix("cluster_state:"))
            .map(|s| s.trim().to_owned())
    } else {
        None
    };
    Ok(Health { latency, cluster_state })
}
