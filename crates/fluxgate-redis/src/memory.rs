//! What Redis does when its memory is full, read with `CONFIG GET maxmemory*`, and the
//! warning the limiter logs when it connects to a Redis that may evict its counters.

use std::collections::HashMap;
use std::time::Duration;

use fred::interfaces::{ClientLike, ClusterInterface};
use fred::types::{ClusterHash, CustomCommand, Value};
use futures_util::future::join_all;

use crate::connection::{on_node, Connection};
use crate::error::RedisError;

/// How a Redis server bounds its memory (`maxmemory`, `maxmemory-policy`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryPolicy {
    /// The server, as `host:port`.
    pub server: String,
    /// `maxmemory`, in bytes; 0 when the memory is not bounded.
    pub maxmemory: u64,
    /// `maxmemory-policy`: `noeviction`, `allkeys-lru`, `volatile-lru`…
    pub policy: String,
}

impl MemoryPolicy {
    /// Whether the server may evict the limiter's keys: it bounds its memory and its
    /// policy is not `noeviction`. Every key the limiter writes has an expiry, so the
    /// `volatile-*` policies evict them as readily as the `allkeys-*` ones. An evicted
    /// counter starts over full.
    pub fn evicts_counters(&self) -> bool {
        self.maxmemory > 0 && self.policy != "noeviction"
    }

    /// Whether the server refuses writes once its memory is full (`maxmemory` with
    /// `noeviction`): every request it would admit then fails, to its rules' failure
    /// policies.
    pub fn refuses_writes_when_full(&self) -> bool {
        self.maxmemory > 0 && self.policy == "noeviction"
    }
}

/// The memory policy of each server the limiter's keys live on (each primary of a
/// cluster), each read within `bound`.
pub(crate) async fn read(connection: &Connection, bound: Duration) -> Result<Vec<MemoryPolicy>, RedisError> {
    let client = connection.next();
    let primaries = match client.cached_cluster_state() {
        Some(state) if client.is_clustered() => state.unique_primary_nodes(),
        _ => Vec::new(),
    };
    // fred times each command out after the decision deadline unless told otherwise.
    let within = |node| on_node(client, node, Some(bound));
    if primaries.is_empty() {
        let server = client
            .active_connections()
            .first()
            .map_or_else(|| "redis".to_owned(), ToString::to_string);
        return Ok(vec![config_get(connection, &within(None), server, bound).await?]);
    }
    let reads = primaries.into_iter().map(|server| {
        let node = within(Some(server.clone()));
        async move { config_get(connection, &node, server.to_string(), bound).await }
    });
    join_all(reads).await.into_iter().collect()
}

/// `CONFIG GET maxmemory*` sent through `client` (a node of a cluster, or the server),
/// within `bound`: the policy of `server`.
async fn config_get<C: ClientLike>(
    connection: &Connection,
    client: &C,
    server: String,
    bound: Duration,
) -> Result<MemoryPolicy, RedisError> {
    let args = vec![Value::from_static_str("GET"), Value::from_static_str("maxmemory*")];
    let command = CustomCommand::new_static("CONFIG", ClusterHash::Random, false);
    let reply = connection
        .within(bound, client.custom::<Value, _>(command, args))
        .await?;
    parse(server, reply)
}

/// The policy in a reply of `CONFIG GET maxmemory*` (pairs of names and values, as an
/// array or a map).
fn parse(server: String, reply: Value) -> Result<MemoryPolicy, RedisError> {
    let fields: HashMap<String, String> = reply
        .convert()
        .map_err(|e| RedisError::Reply(format!("CONFIG GET maxmemory*: {e}")))?;
    let maxmemory = fields
        .get("maxmemory")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| RedisError::Reply("CONFIG GET maxmemory*: no maxmemory".to_owned()))?;
    let policy = fields
        .get("maxmemory-policy")
        .cloned()
        .ok_or_else(|| RedisError::Reply("CONFIG GET maxmemory*: no maxmemory-policy".to_owned()))?;
    Ok(MemoryPolicy {
        server,
        maxmemory,
        policy,
    })
}

/// Reads the memory policy of the limiter's servers and logs what it means for the
/// limits: a warning for a server that may evict counters, a note for one that refuses
/// writes when full, a note when it cannot be read (`CONFIG` refused by an ACL, or renamed
/// as managed services do). Never fails: the limiter works either way.
pub(crate) async fn warn_of_eviction(connection: &Connection, bound: Duration) {
    let policies = match read(connection, bound).await {
        Ok(policies) => policies,
        Err(error) => {
            tracing::info!(
                %error,
                "cannot read Redis's maxmemory-policy (CONFIG GET maxmemory*): check that the limiter's Redis \
                 does not evict keys (noeviction, or no maxmemory; see docs/redis.md, \"Memory\")"
            );
            return;
        }
    };
    for p in policies {
        if p.evicts_counters() {
            tracing::warn!(
                server = %p.server,
                "Redis at {} evicts keys when its memory is full (maxmemory {} bytes, maxmemory-policy {}): an evicted \
                 rate-limit counter starts over full, and a client that makes many keys (IPv6 addresses, user ids) \
                 can have spent counters evicted and its limit renewed; every rate-limit key has an expiry, so \
                 volatile-* policies evict them too. Give the limiter a Redis with maxmemory-policy noeviction, or \
                 without maxmemory (see docs/redis.md, \"Memory\")",
                p.server,
                p.maxmemory,
                p.policy
            );
        } else if p.refuses_writes_when_full() {
            tracing::info!(
                server = %p.server,
                "Redis at {} refuses writes once it holds maxmemory {} bytes (noeviction): the requests it would \
                 then admit go to their rules' failure policies (fail_open admits them uncounted); alert on its \
                 used memory (see docs/redis.md, \"Memory\")",
                p.server,
                p.maxmemory
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(maxmemory: u64, policy: &str) -> MemoryPolicy {
        MemoryPolicy {
            server: "127.0.0.1:6379".to_owned(),
            maxmemory,
            policy: policy.to_owned(),
        }
    }

    #[test]
    fn only_a_bounded_memory_with_an_eviction_policy_evicts_counters() {
        for p in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-ttl",
            "volatile-random",
        ] {
            assert!(policy(1 << 20, p).evicts_counters(), "{p}");
            assert!(!policy(0, p).evicts_counters(), "{p} without maxmemory");
        }
        assert!(!policy(1 << 20, "noeviction").evicts_counters());
        assert!(policy(1 << 20, "noeviction").refuses_writes_when_full());
        assert!(!policy(0, "noeviction").refuses_writes_when_full());
    }
}
