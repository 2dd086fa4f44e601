//! The error type of the Redis backend.

use std::time::Duration;

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
    /// An option of the builder cannot be used.
    #[error("redis limiter option `{option}`: {reason}")]
    Option {
        /// The option.
        option: &'static str,
        /// What is wrong with its value.
        reason: &'static str,
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
    /// The script's reply does not have the expected shape (see the protocol in
    /// `lua/README.md`).
    #[error("unexpected reply from the rate-limit script: {0}")]
    Reply(String),
    /// The task deciding a request across hash slots ended without an answer (the runtime
    /// shut down).
    #[error("the rate-limit decision was interrupted")]
    Interrupted,
}
