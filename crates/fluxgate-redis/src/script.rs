//! The two scripts, joined from the files of `lua/`, and the one way to run them: `EVALSHA`
//! within the deadline, loaded again and retried after `NOSCRIPT`.

use fred::types::scripts::Script;

use crate::connection::Connection;
use crate::error::RedisError;
use crate::protocol::{DecideArgs, RefundArgs, RefundReply, Reply};

/// The decision script (see `lua/README.md`): every band of every rule of a request, of
/// any algorithm, all or nothing. The build script joins it from the files of `lua/`; the
/// single-band token bucket returns from `fast_path.lua`, before the other algorithms'
/// functions are created.
pub const DECIDE_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/decide.lua"));

/// The refund script, for requests that a cluster's hash slots decided differently: the
/// same parts without the fast path, with `refund.lua` last.
pub const REFUND_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/refund.lua"));

/// The scripts and the connections they run on.
pub(crate) struct Scripts {
    connection: Connection,
    decide: Script,
    refund: Script,
}

impl Scripts {
    /// The scripts over `connection`, not loaded yet.
    pub(crate) fn new(connection: Connection) -> Self {
        Self {
            connection,
            decide: Script::from_lua(DECIDE_LUA),
            refund: Script::from_lua(REFUND_LUA),
        }
    }

    /// Loads both scripts (on every primary of a cluster).
    ///
    /// # Errors
    ///
    /// [`RedisError::Connect`] when Redis does not take them.
    pub(crate) async fn load(&self) -> Result<(), RedisError> {
        for script in [&self.decide, &self.refund] {
            script.load(self.connection.next()).await.map_err(RedisError::Connect)?;
        }
        Ok(())
    }

    /// The connections the scripts run on.
    pub(crate) fn connection(&self) -> &Connection {
        &self.connection
    }

    /// The SHA-1 of the decision script.
    pub(crate) fn decide_sha1(&self) -> &str {
        self.decide.sha1()
    }

    /// One decision call: `keys`, one per band, and their arguments.
    ///
    /// # Errors
    ///
    /// As [`Scripts::run`], and [`RedisError::Reply`] for a reply of the wrong shape.
    pub(crate) async fn decide(&self, keys: Vec<String>, args: DecideArgs) -> Result<Reply, RedisError> {
        let bands = keys.len();
        let reply = self.run(&self.decide, keys, args.into_argv()).await?;
        Reply::decode(reply, bands)
    }

    /// One refund call: `keys`, one per band to refund, and their arguments.
    ///
    /// # Errors
    ///
    /// As [`Scripts::run`], and [`RedisError::Reply`] for a reply of the wrong shape.
    pub(crate) async fn refund(&self, keys: Vec<String>, args: RefundArgs) -> Result<RefundReply, RedisError> {
        let bands = keys.len();
        let reply = self.run(&self.refund, keys, args.into_argv()).await?;
        RefundReply::decode(reply, bands)
    }

    /// Runs `script` with `EVALSHA` within the deadline; after `NOSCRIPT` (a restart, a
    /// failover, `SCRIPT FLUSH`) loads it and tries again, within the same deadline.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] when Redis fails the call, [`RedisError::Timeout`] when it
    /// does not answer in time.
    async fn run(&self, script: &Script, keys: Vec<String>, args: Vec<i64>) -> Result<Vec<i64>, RedisError> {
        let call = script.evalsha_with_reload(self.connection.next(), keys, args);
        self.connection.within_deadline(call).await
    }
}
