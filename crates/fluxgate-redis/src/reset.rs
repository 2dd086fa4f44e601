//! Bucket resets: the keys of a rule set's buckets, found with `SCAN` on every primary and
//! deleted with `UNLINK`.

use std::pin::pin;
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::KeysInterface;
use fred::types::scan::{ScanResult, Scanner};
use fred::types::Key;
use futures_util::{Stream, StreamExt};

use crate::connection::Connection;
use crate::error::RedisError;
use crate::key;
use crate::limiter::RedisLimiter;

/// How many keys each `SCAN` call looks at.
const SCAN_COUNT: u32 = 1_000;

/// The deadline of each page of a reset: one `SCAN` call, or the deletion of its keys.
const PAGE_TIMEOUT: Duration = Duration::from_secs(2);

/// Which buckets a reset reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResetScope<'a> {
    /// The buckets of one rule set.
    RuleSet(&'a str),
    /// Every bucket under the limiter's prefix.
    All,
}

impl RedisLimiter {
    /// Deletes the keys of the buckets in `scope` (with the deny cache's, and this
    /// instance's remembered denials): their next requests start with full buckets.
    /// Answers how many keys were deleted.
    ///
    /// The keys are found with `SCAN … MATCH <prefix>:{<rule set>:*` (for
    /// [`ResetScope::All`], `<prefix>:{*`), on every primary of a cluster, and deleted
    /// with `UNLINK`, a page at a time; never `KEYS`. Only bucket keys match: the rule
    /// store's keys begin with `{` and other rule sets' keys with their own id (ids hold
    /// no `:`). Buckets written while the reset runs may be kept.
    ///
    /// Every instance sharing the Redis sees the reset, so it should happen once per
    /// change, not once per instance: the rule-change listener
    /// ([`RuleChangeListener`](crate::RuleChangeListener)) makes sure of that.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] when a `SCAN` or `UNLINK` fails, [`RedisError::Timeout`]
    /// when a page takes more than 2 s; the keys deleted until then stay deleted.
    pub async fn reset_buckets(&self, scope: ResetScope<'_>) -> Result<u64, RedisError> {
        let start = key::buckets_start(self.prefix(), scope.id());
        self.forget_denials(&start);
        let pattern = key::scan_pattern(&start);
        let connection = self.connection().clone().with_timeout(PAGE_TIMEOUT);
        let client = connection.next();
        let deleted = if connection.is_cluster() {
            delete_pages(client.scan_cluster(pattern, Some(SCAN_COUNT), None), &connection).await
        } else {
            delete_pages(client.scan(pattern, Some(SCAN_COUNT), None), &connection).await
        };
        // Denials remembered while the keys were being deleted.
        self.forget_denials(&start);
        let deleted = deleted?;
        tracing::info!(prefix = self.prefix(), ?scope, deleted, "buckets reset");
        Ok(deleted)
    }
}

impl<'a> ResetScope<'a> {
    /// The rule set's id, `None` for every rule set.
    pub fn id(self) -> Option<&'a str> {
        match self {
            ResetScope::RuleSet(id) => Some(id),
            ResetScope::All => None,
        }
    }
}

/// Deletes the keys of every page of a scan, each page within the connection's deadline;
/// answers how many were deleted.
async fn delete_pages(
    pages: impl Stream<Item = Result<ScanResult, fred::error::Error>>,
    connection: &Connection,
) -> Result<u64, RedisError> {
    let mut pages = pin!(pages);
    let mut deleted = 0;
    loop {
        let keys = match tokio::time::timeout(PAGE_TIMEOUT, pages.next()).await {
            Err(_) => return Err(RedisError::Timeout(PAGE_TIMEOUT)),
            Ok(None) => return Ok(deleted),
            // Dropping the page asks for the next one.
            Ok(Some(page)) => page.map_err(RedisError::Command)?.take_results().unwrap_or_default(),
        };
        if keys.is_empty() {
            continue;
        }
        let unlinked = unlink(connection.next(), keys, connection.is_cluster());
        deleted += connection.within_deadline(unlinked).await?;
    }
}

/// `UNLINK`s `keys`: in one command on a single server, one per hash slot on a cluster.
async fn unlink(client: &Client, keys: Vec<Key>, cluster: bool) -> Result<u64, fred::error::Error> {
    if !cluster {
        return client.unlink(keys).await;
    }
    let slots = fred::util::group_by_hash_slot(keys)?;
    let calls = slots.into_values().map(|keys| client.unlink::<u64, _>(Vec::from(keys)));
    let counts = futures_util::future::try_join_all(calls).await?;
    Ok(counts.into_iter().sum())
}
