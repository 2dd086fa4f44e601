//! The scripts, joined from the files of `lua/`, and the one way to run them: `EVALSHA`
//! within the deadline, loaded again and retried after `NOSCRIPT`.

use fred::types::scripts::Script;
use fred::types::Value;

use crate::connection::Connection;
use crate::error::RedisError;
use crate::protocol::{DecideArgs, RefundArgs, RefundReply, Reply, Shape};

/// The general decision script (see `lua/README.md`): every band of every rule of a
/// request, of any algorithm, all or nothing. The build script joins it from the files of
/// `lua/`.
pub const DECIDE_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/decide.lua"));

/// The decision script of a request of one token-bucket rule of one band
/// (`lua/one_token_bucket.lua`): the common case, decided as [`DECIDE_LUA`] would, with
/// fewer arguments and at less cost.
pub const ONE_TOKEN_BUCKET_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/one_token_bucket.lua"));

/// The decision script of a request whose rules are all token buckets
/// (`lua/token_buckets.lua`, after `lua/layout.lua`): decided as [`DECIDE_LUA`] would, at
/// less cost.
pub const TOKEN_BUCKETS_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/token_buckets.lua"));

/// The refund script, for requests that a cluster's hash slots decided differently: the
/// general script's parts, with `refund.lua` last.
pub const REFUND_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/refund.lua"));

/// The scripts and the connections they run on.
pub(crate) struct Scripts {
    connection: Connection,
    decide: Script,
    one_token_bucket: Script,
    token_buckets: Script,
    refund: Script,
}

impl Scripts {
    /// The scripts over `connection`, not loaded yet.
    pub(crate) fn new(connection: Connection) -> Self {
        Self {
            connection,
            decide: Script::from_lua(DECIDE_LUA),
            one_token_bucket: Script::from_lua(ONE_TOKEN_BUCKET_LUA),
            token_buckets: Script::from_lua(TOKEN_BUCKETS_LUA),
            refund: Script::from_lua(REFUND_LUA),
        }
    }

    /// Loads the scripts (on every primary of a cluster).
    ///
    /// # Errors
    ///
    /// [`RedisError::Connect`] when Redis does not take them.
    pub(crate) async fn load(&self) -> Result<(), RedisError> {
        for script in [&self.decide, &self.one_token_bucket, &self.token_buckets, &self.refund] {
            script.load(self.connection.next()).await.map_err(RedisError::Connect)?;
        }
        Ok(())
    }

    /// The connections the scripts run on.
    pub(crate) fn connection(&self) -> &Connection {
        &self.connection
    }

    /// The SHA-1 of the general decision script.
    pub(crate) fn decide_sha1(&self) -> &str {
        self.decide.sha1()
    }

    /// One decision call: `keys` (one per token-bucket rule, one per band of the other
    /// algorithms) and their arguments, sent to the script of their [`Shape`].
    ///
    /// # Errors
    ///
    /// As [`Scripts::run`], and [`RedisError::Reply`] for a reply of the wrong shape.
    pub(crate) async fn decide(&self, keys: Vec<String>, args: &DecideArgs) -> Result<Reply, RedisError> {
        match args.shape() {
            Shape::OneTokenBucket | Shape::TokenBuckets => {
                let (script, argv) = match args.one_token_bucket_argv() {
                    Some(argv) => (&self.one_token_bucket, argv),
                    None => (&self.token_buckets, args.token_buckets_argv()),
                };
                let reply = self.run(script, keys, argv).await?;
                args.token_reply(&reply)
            }
            Shape::General => {
                let reply = self.run(&self.decide, keys, args.general_argv()).await?;
                Reply::decode(&reply, args.band_count())
            }
        }
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
    async fn run(&self, script: &Script, keys: Vec<String>, args: Vec<Value>) -> Result<Vec<i64>, RedisError> {
        // fred's future is large: boxed once here, the futures around it (the deadline, the
        // decision, the limiter's) stay small, and moving them copies a pointer instead of
        // kilobytes.
        let call = Box::pin(script.evalsha_with_reload(self.connection.next(), keys, args));
        self.connection.within_deadline(call).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The future of a decision stays small, whatever fred's futures weigh: the limiter
    /// boxes it once per request, and a large one costs a copy of all of it.
    #[test]
    fn a_decision_future_is_small() {
        let scripts = Scripts::new(Connection::client(fred::clients::Client::default()));
        let args = DecideArgs::new();
        let future = scripts.decide(Vec::new(), &args);
        let size = std::mem::size_of_val(&future);
        assert!(size <= 512, "{size} bytes");
    }
}
