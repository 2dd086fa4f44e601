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
    /// Redis refused a write for want of memory (`OOM`: `maxmemory` reached under
    /// `maxmemory-policy noeviction`). It still decides, refusing what it would refuse;
    /// the requests it would admit fail with this error, a
    /// [`StoreFull`](fluxgate_core::limiter::StoreFull) among its sources, and go to their
    /// rules' failure policies (see `docs/redis.md`, "Memory").
    #[error("redis is out of memory (maxmemory reached): {0}")]
    OutOfMemory(#[source] fluxgate_core::limiter::StoreFull),
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

impl RedisError {
    /// The error of a failed command: [`RedisError::OutOfMemory`] when Redis refused it for
    /// want of memory (its error, or a script's that it raised, starts with `OOM`),
    /// [`RedisError::Command`] otherwise.
    pub(crate) fn command(error: fred::error::Error) -> Self {
        if error.details().starts_with("OOM ") {
            Self::OutOfMemory(fluxgate_core::limiter::StoreFull(Box::new(error)))
        } else {
            Self::Command(error)
        }
    }
}
