//! Limiter backends: the [`RateLimiter`] trait and the in-memory limiter.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::BoxError;
use crate::future::MaybeReady;
use crate::rule::{Algorithm, Band};

mod memory;
pub mod token_bucket;

pub use memory::{MemoryLimiter, MemoryLimiterBuilder};

/// One rule's counter for one request: the rule, its key value, its bands and the cost.
#[derive(Debug, Clone)]
pub struct BucketRequest {
    /// The rule set's id.
    pub rule_set: Arc<str>,
    /// The rule's id.
    pub rule: Arc<str>,
    /// The encoded key value (see [`crate::key`]).
    pub key: String,
    /// The rule's algorithm.
    pub algorithm: Algorithm,
    /// The rule's bands.
    pub bands: Arc<[Band]>,
    /// The cost of the request.
    pub permits: u64,
    /// Whether the rule is in shadow mode.
    pub shadow: bool,
}

/// Everything one request consumes, checked and applied as one atomic step.
///
/// The enforced buckets are all or nothing: either every band of every enforced bucket
/// admits the request and all of them consume, or none consumes. The shadow buckets
/// consume only when the enforced buckets admitted and every shadow band admits too, as
/// they would if they were enforced.
#[derive(Debug, Clone, Default)]
pub struct AcquireRequest {
    /// The buckets, in rule priority order.
    pub buckets: Vec<BucketRequest>,
}

/// When a band that rejects would admit the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// The band admits the request now.
    None,
    /// After this long, without other traffic.
    After(Duration),
    /// Never: the request costs more than the band's capacity.
    Never,
}

/// The state of one band after the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BandState {
    /// Index into [`AcquireRequest::buckets`].
    pub bucket: usize,
    /// Index into that bucket's bands.
    pub band: usize,
    /// Whether this band alone admits the request.
    pub allowed: bool,
    /// Permits left in the band after the decision (nothing is consumed on rejection).
    pub remaining: u64,
    /// Time until the band is full again.
    pub reset_after: Duration,
    /// When the band would admit the request.
    pub wait: Wait,
}

/// The result of [`RateLimiter::acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireOutcome {
    /// Whether the enforced buckets admitted the request (and consumed).
    pub allowed: bool,
    /// Whether the shadow buckets admitted the request.
    pub shadow_allowed: bool,
    /// The backend's clock at the decision, in nanoseconds since the Unix epoch.
    pub now_unix_nanos: u64,
    /// Every band of every bucket, bucket by bucket.
    pub bands: Vec<BandState>,
}

/// A limiter backend: applies an [`AcquireRequest`] atomically.
///
/// The trait is object safe; the engine holds an `Arc<dyn RateLimiter>`. Backends that
/// answer synchronously return [`MaybeReady::ready`], so that no future is allocated.
pub trait RateLimiter: Send + Sync + fmt::Debug + 'static {
    /// Checks every band of every bucket and consumes all or nothing.
    ///
    /// The returned future must not borrow the request: backends that go over the network
    /// encode what they send before returning.
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>>;
}

impl<L: RateLimiter + ?Sized> RateLimiter for Arc<L> {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        (**self).acquire(request)
    }
}
