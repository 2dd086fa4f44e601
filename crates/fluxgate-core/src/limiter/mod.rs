//! Limiter backends: the [`RateLimiter`] trait and the in-memory limiter.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::decision::Bands;
use crate::error::{BoxError, RuleError};
use crate::future::MaybeReady;
use crate::rule::{Rule, RuleSet, WaitPolicy};

pub mod fixed_window;
pub mod leaky_bucket;
mod memory;
mod request;
pub mod sliding_window_counter;
pub mod sliding_window_log;
pub mod token_bucket;

pub use memory::{MemoryLimiter, MemoryLimiterBuilder};
pub use request::{AcquireRequest, Bucket};

/// Checks that `limiter` decides every rule of `set` as the rule asks: its bands
/// ([`RateLimiter::validate`]) and, for a rule that waits for the refill, the wait
/// ([`RateLimiter::check_wait`]): the rule's own `on_limit.wait`, or `default_wait` (an
/// engine's [`wait_on_limit`](crate::EngineBuilder::wait_on_limit)) for a rule without a
/// lease. An engine runs it on every rule set before swapping it in; rule stores run it
/// before storing one, so that what they store loads.
///
/// # Errors
///
/// The first [`RuleError`] of the limiter, naming the rule set, the rule and the band.
pub fn validate_rule_set(
    limiter: &dyn RateLimiter,
    set: &RuleSet,
    default_wait: Option<WaitPolicy>,
) -> Result<(), RuleError> {
    limiter.validate(set)?;
    for rule in set.rules() {
        let wait = match (rule.wait(), default_wait) {
            (Some(policy), _) => policy,
            (None, Some(policy)) if rule.lease().is_none() => policy,
            _ => continue,
        };
        limiter.check_wait(set, rule, wait.max_wait())?;
    }
    Ok(())
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

/// The evaluation of one band for one request by one algorithm, at one instant: what the
/// band says now, and what it says if the request is committed. Evaluating never changes
/// a band; the caller stores `next` only when the whole request is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Eval<S> {
    /// Whether the band admits the request.
    pub allowed: bool,
    /// The state to store when the request is committed.
    pub next: S,
    /// Remaining permits if the request is committed.
    pub remaining_after: u64,
    /// Remaining permits if it is not.
    pub remaining_now: u64,
    /// Nanoseconds until the band is back to its full capacity, if committed.
    pub reset_after: u64,
    /// Nanoseconds until the band is back to its full capacity, if not.
    pub reset_now: u64,
    /// When the band admits the request.
    pub wait: Wait,
}

impl<S> Eval<S> {
    /// A rejection: the band stays as it is (`state`), with these figures.
    pub fn rejected(state: S, remaining: u64, reset: u64, wait: Wait) -> Self {
        Self {
            allowed: false,
            next: state,
            remaining_after: remaining,
            remaining_now: remaining,
            reset_after: reset,
            reset_now: reset,
            wait,
        }
    }
}

/// The result of [`RateLimiter::acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireOutcome {
    /// Whether the enforced buckets admitted the request (and consumed).
    pub allowed: bool,
    /// Whether the shadow buckets admitted the request.
    pub shadow_allowed: bool,
    /// The backend's clock at the decision, in nanoseconds since the Unix epoch.
    pub now_unix_nanos: u64,
    /// Every band of every bucket, bucket by bucket, in the order of the request.
    pub bands: Bands,
    /// Whether the backend answered from local knowledge without asking its store (a
    /// deny-cache hit of the Redis backend): such an answer says nothing about the store's
    /// health, so a [`CircuitBreaker`](crate::CircuitBreaker) neither closes nor counts a success for it.
    pub local: bool,
    /// For an admitted request that waits for the refill ([`Bucket::max_wait`]): how long
    /// after [`now_unix_nanos`](Self::now_unix_nanos) it may proceed. The backend has
    /// taken its place for that instant; zero for a request admitted at once.
    pub admitted_after: Duration,
    /// For a request admitted for later, or one that asked for them
    /// ([`AcquireRequest::mark_places`]), from a backend that records them: per band of the
    /// request, in order, the state the backend left in that band, as the backend records
    /// it (a token or leaky bucket's instant in the high 64 bits and its remainder in the
    /// low ones; 0 for a band without one). A backend may record in a window band's mark
    /// the instant of its decision in that band, in µs since the Unix epoch, where it may
    /// differ from [`now_unix_nanos`](Self::now_unix_nanos) (a request decided in parts at
    /// several instants): a local lease's permits of that band go back into the window of
    /// that instant. [`RateLimiter::give_back_place`] reads them back. Empty otherwise.
    pub marks: Vec<u128>,
}

impl AcquireOutcome {
    /// An outcome decided by the backend's store at `now_unix_nanos`, with the report of
    /// every band of the request (see [`AcquireRequest::bands`]).
    #[inline]
    pub fn new(allowed: bool, shadow_allowed: bool, now_unix_nanos: u64, bands: impl Into<Bands>) -> Self {
        Self {
            allowed,
            shadow_allowed,
            now_unix_nanos,
            bands: bands.into(),
            local: false,
            admitted_after: Duration::ZERO,
            marks: Vec::new(),
        }
    }

    /// Sets the bands' [`marks`](Self::marks) of a request admitted for later.
    #[must_use]
    pub fn with_marks(mut self, marks: Vec<u128>) -> Self {
        self.marks = marks;
        self
    }

    /// Marks the outcome as admitted for `after` past its decision (a waiting request;
    /// see [`admitted_after`](Self::admitted_after)).
    #[must_use]
    pub fn admitted_later(mut self, after: Duration) -> Self {
        self.admitted_after = after;
        self
    }

    /// Marks the outcome as answered from local knowledge (see [`local`](Self::local)).
    #[must_use]
    pub fn answered_locally(mut self) -> Self {
        self.local = true;
        self
    }
}

/// A limiter backend: applies an [`AcquireRequest`] atomically.
///
/// The trait is object safe; the engine holds an `Arc<dyn RateLimiter>`. Backends that
/// answer synchronously return [`MaybeReady::ready`], so that no future is allocated.
pub trait RateLimiter: Send + Sync + fmt::Debug + 'static {
    /// Checks every band of every bucket and consumes all or nothing.
    ///
    /// The returned future must not borrow the request: a backend that needs it after
    /// returning clones it (cheap: an [`Arc`] of the rule set and the keys).
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>>;

    /// Checks that this backend decides every rule of `set` exactly: the numbers each
    /// band needs stay within the backend's exact range. Called when rules are loaded or
    /// swapped in (the engine calls it for its provider's rule sets when it is built), so
    /// that a rule the backend cannot decide is refused as a configuration error instead
    /// of failing on every request.
    ///
    /// A backend that meets such a rule in [`acquire`](Self::acquire) anyway fails with
    /// the [`RuleError`] itself, which the engine reports as [`crate::Error::Rule`], never
    /// as a backend failure. The default accepts every rule.
    ///
    /// # Errors
    ///
    /// A [`RuleError::Unsupported`] naming the rule set, the rule, the band and the limit.
    fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        let _ = set;
        Ok(())
    }

    /// Whether this backend can [give back](Self::give_back) what it consumed: local
    /// leases (a rule's `lease`) need it. The default is `false`, and then leased rules
    /// are decided one request at a time, as without a lease.
    fn gives_back(&self) -> bool {
        false
    }

    /// Whether this backend decides in this process, with no call to make: the in-memory
    /// limiter. Local leases would save nothing there, and are not taken.
    fn is_local(&self) -> bool {
        false
    }

    /// Whether this backend reads each bucket's key value as text ([`Bucket::key`]). The
    /// default is `true`. The in-memory limiter answers `false`: it tells the engine's
    /// address and global keys apart by their typed value, and the engine then leaves
    /// their text empty. A wrapper that hands the requests to another backend answers as
    /// that backend does.
    fn reads_key_text(&self) -> bool {
        true
    }

    /// Checks that this backend lets the requests of `rule` (of `set`) wait for the refill
    /// up to `max_wait` ([`Bucket::max_wait`]): it then takes a request's place at the
    /// instant it will be admitted, in the same step as the decision, and says so in
    /// [`AcquireOutcome::admitted_after`]. The engine calls it, when rules load, for each
    /// rule that waits (its `on_limit.wait`, or the engine's default).
    ///
    /// # Errors
    ///
    /// A [`RuleError::Unsupported`] saying why the backend cannot; the default refuses every
    /// rule.
    fn check_wait(&self, set: &RuleSet, rule: &Rule, max_wait: Duration) -> Result<(), RuleError> {
        let _ = max_wait;
        Err(RuleError::Unsupported {
            backend: self.backend_name(),
            rule_set: set.id().to_string(),
            rule: rule.id().to_string(),
            band: rule.bands().first().map(|b| b.name().to_string()).unwrap_or_default(),
            message: "waiting for the refill (the rule's on_limit.wait, or the engine's \
                      wait_on_limit): this backend does not take a waiting request's place; \
                      decide the rule in memory, or let it refuse at once"
                .to_owned(),
        })
    }

    /// Gives back what `request` consumed when the backend decided it at
    /// `decided_unix_nanos` (its [`AcquireOutcome::now_unix_nanos`]), each bucket its
    /// [`permits`](Bucket::permits), as far as the bucket can still take them back: a
    /// token bucket more than full is full, a window that has ended keeps its count.
    /// Local leases give their unspent permits back through it.
    ///
    /// # Errors
    ///
    /// The backend's failure; the default, for a backend that does not
    /// [give back](Self::gives_back), says so.
    fn give_back(&self, request: &AcquireRequest, decided_unix_nanos: u64) -> MaybeReady<Result<(), BoxError>> {
        let _ = (request, decided_unix_nanos);
        MaybeReady::ready(Err(format!(
            "the {} backend cannot give permits back",
            self.backend_name()
        )
        .into()))
    }

    /// Gives back the place a request admitted for later (waiting for the refill) took for
    /// `at_unix_nanos`, the request having gone before that instant: `marks` are the
    /// outcome's [`AcquireOutcome::marks`]. As [`give_back`](Self::give_back), except that
    /// a token or leaky bucket gives it back only while its state is still the one its
    /// mark records. A place taken after it was counted behind it, and giving this one
    /// back would let a new request share that later place; so then the place stays
    /// taken, and its permits pass unused. A backend that lets requests wait
    /// ([`check_wait`](Self::check_wait)) implements it.
    ///
    /// # Errors
    ///
    /// The backend's failure; the default says the backend cannot.
    fn give_back_place(
        &self,
        request: &AcquireRequest,
        at_unix_nanos: u64,
        marks: &[u128],
    ) -> MaybeReady<Result<(), BoxError>> {
        let _ = (request, at_unix_nanos, marks);
        MaybeReady::ready(Err(format!(
            "the {} backend cannot give a waiting request's place back",
            self.backend_name()
        )
        .into()))
    }

    /// A short, fixed name of the backend (`memory`, `redis`): the `backend` label of the
    /// backend metrics. A wrapper such as [`CircuitBreaker`](crate::CircuitBreaker) gives
    /// the name of the backend it wraps. The default is `custom`.
    fn backend_name(&self) -> &'static str {
        "custom"
    }

    /// Counts in this backend a request that another handler admitted, without deciding
    /// it: each band of each enforced bucket takes the bucket's
    /// [`permits`](Bucket::permits), or what it has left, so that it is empty, never in
    /// debt. [`FallbackHandler`](crate::FallbackHandler) charges its local engine's limiter
    /// so with every request the handler it wraps admits: when that handler fails, the
    /// local limits start from what this process was admitted, not from full buckets.
    ///
    /// The in-memory limiter counts; the default counts nothing. A wrapper passes it on to
    /// the backend it wraps, whatever its own state (a [`CircuitBreaker`](crate::CircuitBreaker)
    /// does, open or not): a wrapper that does not leaves its local engine's buckets full
    /// for every client when the other handler fails.
    fn charge(&self, request: &AcquireRequest) {
        let _ = request;
    }

    /// A refusal of `request` this backend knows without asking its store, when it knows
    /// one (a Redis limiter's deny cache): the answer of a wrapper that decides without
    /// asking the backend (an open [`CircuitBreaker`](crate::CircuitBreaker)), before it
    /// fails, so that a client whose limit is known to be spent is refused rather than
    /// left to the failure policy. Never an admission. `None` by default; a wrapper passes
    /// it on.
    fn refused_locally(&self, request: &AcquireRequest) -> Option<AcquireOutcome> {
        let _ = request;
        None
    }
}

impl<L: RateLimiter + ?Sized> RateLimiter for Arc<L> {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        (**self).acquire(request)
    }

    fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        (**self).validate(set)
    }

    fn backend_name(&self) -> &'static str {
        (**self).backend_name()
    }

    fn gives_back(&self) -> bool {
        (**self).gives_back()
    }

    fn is_local(&self) -> bool {
        (**self).is_local()
    }

    fn reads_key_text(&self) -> bool {
        (**self).reads_key_text()
    }

    fn check_wait(&self, set: &RuleSet, rule: &Rule, max_wait: Duration) -> Result<(), RuleError> {
        (**self).check_wait(set, rule, max_wait)
    }

    fn give_back(&self, request: &AcquireRequest, decided_unix_nanos: u64) -> MaybeReady<Result<(), BoxError>> {
        (**self).give_back(request, decided_unix_nanos)
    }

    fn give_back_place(
        &self,
        request: &AcquireRequest,
        at_unix_nanos: u64,
        marks: &[u128],
    ) -> MaybeReady<Result<(), BoxError>> {
        (**self).give_back_place(request, at_unix_nanos, marks)
    }

    fn charge(&self, request: &AcquireRequest) {
        (**self).charge(request)
    }

    fn refused_locally(&self, request: &AcquireRequest) -> Option<AcquireOutcome> {
        (**self).refused_locally(request)
    }
}

/// Whether a limiter's error is a configuration error (a rule the backend cannot decide)
/// rather than a failure of the backend.
pub fn is_rule_error(error: &BoxError) -> bool {
    error.is::<RuleError>()
}

/// The failure of a backend that answers but cannot record what it admits: its store is
/// full (Redis at `maxmemory` under `maxmemory-policy noeviction` refuses every write). It
/// still decides, and refuses what it would refuse; only the requests it would admit fail,
/// and their rules' failure policies answer them. A backend's error carries it among its
/// sources ([`is_store_full`]).
///
/// A [`CircuitBreaker`](crate::CircuitBreaker) counts such an answer as the backend's
/// answer, not as a failure: open, it would leave every request to the failure policies,
/// those the backend still refuses included (`fail_open` then admitted a client whose limit
/// was spent).
#[derive(Debug, thiserror::Error)]
#[error("the rate-limit store is full and records no admission: {0}")]
pub struct StoreFull(#[source] pub BoxError);

/// Whether `error`, or one of its sources, is a [`StoreFull`].
pub fn is_store_full(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<StoreFull>() {
            return true;
        }
        next = e.source();
    }
    false
}
