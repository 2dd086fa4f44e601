//! The engine: rule lookup, matching, key resolution and the limiter call.

use std::fmt;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Method;
use smallvec::SmallVec;
use tracing::Instrument;

use crate::context::RequestContext;
use crate::decision::{AdmittedBand, Decision, Outcome};
use crate::error::{BoxError, Error, RuleError};
use crate::failure::{FailurePolicy, Fallback};
use crate::future::{MaybeReady, Settled};
use crate::handler::{RateLimitHandler, RateLimitMetricsRecorder};
use crate::key::{KeyResolver, Resolved, TypedKey};
use crate::lease::Leases;
use crate::limiter::{
    is_rule_error, validate_rule_set, AcquireOutcome, AcquireRequest, Bucket, MemoryLimiter, RateLimiter,
};
use crate::name::Name;
use crate::path::{is_too_long, with_paths, RequestPaths, LONGEST_MATCHED_PATH};
use crate::provider::{RuleCheck, RuleSetLookup, RuleSetProvider};
use crate::rule::{Mode, Rule, RuleSet, RuleSets, WaitPolicy};
use crate::text::Text;
use crate::wait::{may_wait, wait_for, Places, Waiters};

/// What the engine does with a request whose rule set id is unknown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnknownRuleSet {
    /// Admit it (no headers).
    #[default]
    Allow,
    /// Reject it.
    Deny,
}

/// The rate-limit engine. Cheap to clone.
///
/// For each request it looks up the rule set, keeps every enabled rule that matches the
/// path and method (highest priority first), resolves each rule's key, and asks the
/// limiter to consume from every band of every one of them, all or nothing.
///
/// ```
/// use fluxgate_core::{Engine, RequestContext, RuleSets};
/// let rules = RuleSets::from_yaml_str(r#"
/// rule_sets:
///   - id: default
///     rules:
///       - id: per-ip
///         bands: [{ capacity: 2, window: 1m }]
/// "#).unwrap();
/// let engine = Engine::in_memory(rules);
/// let ctx = RequestContext::builder().client_ip("10.0.0.1".parse().unwrap()).build();
/// let check = |ctx| engine.check(ctx).into_ready().unwrap().unwrap();
/// assert_eq!(check(&ctx).remaining(), Some(1));
/// assert_eq!(check(&ctx).remaining(), Some(0));
/// assert!(!check(&ctx).allowed());
/// ```
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    provider: Arc<dyn RuleSetProvider>,
    limiter: Arc<dyn RateLimiter>,
    /// The limiter itself when it is the in-memory limiter and nothing is recorded nor
    /// waits by default: a rule set of one enforced rule of one band is then decided by it
    /// directly ([`Engine::decide_one`]).
    direct: Option<MemoryLimiter>,
    fallback: Fallback,
    resolver: KeyResolver,
    /// Whether the keys are written as text: for a limiter that reads them, or leases.
    key_text: bool,
    unknown_rule_set: UnknownRuleSet,
    recorder: Option<Arc<dyn RateLimitMetricsRecorder>>,
    /// The local leases of rules with a `lease`, with a limiter that gives back and is not
    /// local.
    leases: Option<Leases>,
    /// The requests waiting for the refill, per rule.
    waiters: Waiters,
    /// The wait for the refill of rules without their own (`wait_on_limit`).
    default_wait: Option<WaitPolicy>,
    /// Whether a request admitted for an unknown rule set id was logged as a warning.
    warned_unknown: AtomicBool,
    /// The limiter's validation, handed to the provider, which holds it weakly: it
    /// applies while the engine lives.
    _check: HeldCheck,
}

/// The engine's rule check, kept alive for the provider's weak reference.
struct HeldCheck(Option<RuleCheck>);

impl fmt::Debug for HeldCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "HeldCheck(Some(..))"
        } else {
            "HeldCheck(None)"
        })
    }
}

/// Builds an [`Engine`].
#[derive(Debug)]
pub struct EngineBuilder {
    provider: Arc<dyn RuleSetProvider>,
    limiter: Option<Arc<dyn RateLimiter>>,
    /// The limiter when it is the in-memory limiter.
    memory: Option<MemoryLimiter>,
    fallback: Option<MemoryLimiter>,
    on_failure: Option<FailurePolicy>,
    resolver: KeyResolver,
    unknown_rule_set: UnknownRuleSet,
    recorder: Option<Arc<dyn RateLimitMetricsRecorder>>,
    wait: Option<WaitPolicy>,
}

impl EngineBuilder {
    /// The limiter backend. Default: a [`MemoryLimiter`] with its defaults.
    pub fn limiter(mut self, limiter: impl RateLimiter) -> Self {
        self.memory = (&limiter as &dyn std::any::Any)
            .downcast_ref::<MemoryLimiter>()
            .cloned();
        self.limiter = Some(Arc::new(limiter));
        self
    }

    /// The limiter backend, shared.
    pub fn shared_limiter(mut self, limiter: Arc<dyn RateLimiter>) -> Self {
        self.memory = None;
        self.limiter = Some(limiter);
        self
    }

    /// Decides with this in-memory limiter, and the same rules, whenever the limiter
    /// fails (an error, a deadline, an open [`CircuitBreaker`](crate::CircuitBreaker)):
    /// the `fallback_local` failure policy, for every rule that does not name another.
    /// Such decisions have [`Decision::degraded`] set.
    pub fn fallback(mut self, limiter: MemoryLimiter) -> Self {
        self.fallback = Some(limiter);
        self.on_failure.get_or_insert(FailurePolicy::FallbackLocal);
        self
    }

    /// The failure policy of rules that do not name one (`on_backend_failure`). Default:
    /// none, so that a failure reaches the handler's caller (the layer's `on_error`
    /// policy), unless [`fallback`](Self::fallback) was given.
    ///
    /// When the backend fails: a `fail_closed` rule refuses the request
    /// ([`Outcome::BackendUnavailable`]); otherwise a rule without a policy passes the
    /// failure on; otherwise the `fallback_local` rules are decided in memory and the
    /// `fail_open` ones skipped.
    pub fn on_backend_failure(mut self, policy: FailurePolicy) -> Self {
        self.on_failure = Some(policy);
        self
    }

    /// Keys IPv6 clients by their first `bits` bits. Default 64.
    ///
    /// # Panics
    ///
    /// When `bits` is 0 or larger than 128.
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.resolver = self.resolver.with_ipv6_prefix(bits);
        self
    }

    /// Keys the clients under the /96 network-specific NAT64 prefix `prefix` as the IPv4
    /// addresses in their last 32 bits, as those under the well-known `64:ff9b::/96` are
    /// (see [`KeyResolver::with_nat64_prefix`]). Set it behind a stateless translator
    /// (SIIT) or a NAT64 with a prefix of its own network: its IPv4 clients would otherwise
    /// share one counter per /64.
    pub fn nat64_prefix(mut self, prefix: std::net::Ipv6Addr) -> Self {
        self.resolver = self.resolver.with_nat64_prefix(prefix);
        self
    }

    /// What to do with unknown rule set ids. Default [`UnknownRuleSet::Allow`]: such a
    /// request is admitted and no rule counts it, so a rule set removed while a layer still
    /// names it, or an id a customizer takes from the request, goes unlimited. The engine's
    /// first such admission is logged as a warning (later ones at trace level).
    pub fn unknown_rule_set(mut self, policy: UnknownRuleSet) -> Self {
        self.unknown_rule_set = policy;
        self
    }

    /// Lets the requests of every rule that names no `on_limit.wait` (and has no lease) wait
    /// for the refill by `policy`, instead of a refusal: the setting for everything a layer
    /// decides with this engine. Default: none, a refusal at once. See [`WaitPolicy`].
    pub fn wait_on_limit(mut self, policy: WaitPolicy) -> Self {
        self.wait = Some(policy);
        self
    }

    /// Sends every decision, and every error that leaves the engine, to `recorder`.
    /// Default: none.
    pub fn recorder(mut self, recorder: impl RateLimitMetricsRecorder) -> Self {
        self.recorder = Some(Arc::new(recorder));
        self
    }

    /// Builds the engine, after checking that the limiter decides every rule of the
    /// provider exactly ([`RateLimiter::validate`]). The provider keeps that check for
    /// the rule sets it loads later ([`RuleSetProvider::validate`]).
    ///
    /// # Errors
    ///
    /// A [`RuleError::Unsupported`] naming the rule set, the rule, the band and the limit
    /// of the backend that it exceeds.
    pub fn build(mut self) -> Result<Engine, RuleError> {
        let limiter = self.limiter_or_default();
        let leases = (limiter.gives_back() && !limiter.is_local()).then(|| Leases::new(limiter.clone()));
        let watch = leases.as_ref().map(Leases::watch);
        let default_wait = self.wait;
        let check: RuleCheck = Arc::new(move |set: &RuleSet| {
            validate_rule_set(&*limiter, set, default_wait)?;
            // The rule set is about to be swapped in: leases of rules it changes go back.
            if let Some(watch) = &watch {
                watch.rules_changed(set);
            }
            Ok(())
        });
        self.provider.validate(check.clone())?;
        Ok(self.assemble(Some(check), leases))
    }

    /// The limiter given, else the in-memory limiter with its defaults, which the engine
    /// then knows as such (for the direct path).
    fn limiter_or_default(&mut self) -> Arc<dyn RateLimiter> {
        let memory = &mut self.memory;
        self.limiter
            .get_or_insert_with(|| {
                let limiter = MemoryLimiter::default();
                *memory = Some(limiter.clone());
                Arc::new(limiter)
            })
            .clone()
    }

    fn assemble(mut self, check: Option<RuleCheck>, leases: Option<Leases>) -> Engine {
        let limiter = self.limiter_or_default();
        let charges = !limiter.is_local();
        let direct = self
            .memory
            .filter(|_| self.recorder.is_none() && self.wait.is_none() && leases.is_none());
        Engine {
            inner: Arc::new(Inner {
                provider: self.provider,
                direct,
                key_text: limiter.reads_key_text() || leases.is_some(),
                leases,
                waiters: Waiters::new(self.wait),
                default_wait: self.wait,
                warned_unknown: AtomicBool::new(false),
                limiter,
                fallback: Fallback {
                    default: self.on_failure,
                    limiter: self.fallback.unwrap_or_default(),
                    charges,
                    ..Fallback::default()
                },
                resolver: self.resolver,
                unknown_rule_set: self.unknown_rule_set,
                recorder: self.recorder,
                _check: HeldCheck(check),
            }),
        }
    }
}

impl Engine {
    /// A builder around a rule provider: fixed [`RuleSets`], or any [`RuleSetProvider`].
    pub fn builder(provider: impl RuleSetProvider) -> EngineBuilder {
        EngineBuilder {
            provider: Arc::new(provider),
            limiter: None,
            memory: None,
            fallback: None,
            on_failure: None,
            resolver: KeyResolver::default(),
            unknown_rule_set: UnknownRuleSet::default(),
            recorder: None,
            wait: None,
        }
    }

    /// An engine with fixed rules and the in-memory limiter, which decides every valid
    /// rule exactly.
    pub fn in_memory(rules: RuleSets) -> Self {
        Self::builder(rules).assemble(None, None)
    }

    /// Gives back every permit this engine holds in local leases (rules with a `lease`):
    /// call it at shutdown, after the last request, so that no permits stay consumed
    /// until the leases would have expired. Returns the permits given back.
    ///
    /// # Errors
    ///
    /// The first failure of the backend; the other leases are given back all the same.
    pub async fn release_leases(&self) -> Result<u64, BoxError> {
        match &self.inner.leases {
            Some(leases) => leases.release_all().await,
            None => Ok(0),
        }
    }

    /// Checks that the engine's limiter decides every rule of `set` as the rule asks, as
    /// the engine itself checks every rule set its provider loads: the bands and the waits
    /// for the refill, the engine's default wait included (see [`validate_rule_set`]). Run
    /// it before storing rules that this engine will load.
    ///
    /// # Errors
    ///
    /// See [`validate_rule_set`].
    pub fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        validate_rule_set(&*self.inner.limiter, set, self.inner.default_wait)
    }

    /// Decides one request.
    ///
    /// The decision runs in a `fluxgate.decision` span at debug level, with the fields
    /// `rule_set` (the id asked for) and `outcome` (the decision's
    /// [`outcome_name`](Decision::outcome_name), or `error`). With a
    /// [recorder](EngineBuilder::recorder), the decision or the error goes to it, and so
    /// does each call of the limiter backend with its duration.
    pub fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        // Nothing to record and no subscriber for the span: no span at all, which also
        // spares the `log` records a disabled span emits when `tracing`'s `log` feature
        // is on (as axum's default features turn it on).
        if self.inner.recorder.is_none() && !tracing::enabled!(tracing::Level::DEBUG) {
            return self.check_unrecorded(ctx);
        }
        let span = tracing::debug_span!(
            "fluxgate.decision",
            // The id as asked for, which may come from the request: cut and escaped.
            rule_set = %crate::error::Shown(ctx.rule_set_id()),
            outcome = tracing::field::Empty,
        );
        let check = span.in_scope(|| self.check_unrecorded(ctx));
        let recorder = &self.inner.recorder;
        match check.into_ready() {
            Ok(result) => {
                finish(&span, recorder.as_deref(), ctx.rule_set_id(), &result);
                MaybeReady::ready(result)
            }
            // Nothing to record: the future as it is, not boxed again.
            Err(pending) if recorder.is_none() && span.is_disabled() => pending,
            Err(pending) => {
                let recorder = recorder.clone();
                let rule_set = ctx.shared_rule_set_id().clone();
                let inner_span = span.clone();
                MaybeReady::boxed(
                    async move {
                        let result = pending.await;
                        finish(&inner_span, recorder.as_deref(), &rule_set, &result);
                        result
                    }
                    .instrument(span),
                )
            }
        }
    }

    /// Decides a request by its method and client address alone, when its rule set needs
    /// nothing else: the decision [`check`](Self::check) makes for a context of this rule
    /// set, method and address, whatever the context's path, user, API key and attributes,
    /// without building one, handed to `then`. The rule set must be one enforced rule of
    /// one band, keyed by the client address or global, without path patterns, a lease or
    /// a wait for the refill, and read from the engine's in-memory limiter, with no
    /// recorder and no subscriber of the `fluxgate.decision` span; otherwise (an unknown
    /// rule set, or a provider whose lookup does not complete at once, too) this returns
    /// `None` with nothing counted and `then` not called, and the caller builds the
    /// context for `check`. The layer of `fluxgate-tower` decides by it when nothing else
    /// would read the context (no customizer, include or exclude patterns, or shadow mode).
    ///
    /// An admission comes as the band's figures, borrowed from the rule set for the time
    /// of `then` ([`AdmittedBand`]); any other decision as `check` makes it.
    ///
    /// ```
    /// use fluxgate_core::{AddressDecision, Engine, RuleSets};
    /// use http::Method;
    ///
    /// let rules = RuleSets::from_yaml_str(r#"
    /// rule_sets:
    ///   - id: default
    ///     rules:
    ///       - id: per-ip
    ///         bands: [{ capacity: 1, window: 1m }]
    /// "#).unwrap();
    /// let engine = Engine::in_memory(rules);
    /// let ip = Some("192.0.2.1".parse().unwrap());
    /// let remaining = |decision: AddressDecision<'_>| match decision {
    ///     AddressDecision::Admitted(band) => Some(band.remaining()),
    ///     AddressDecision::Decided(decision) => decision.allowed().then(|| decision.remaining()).flatten(),
    /// };
    /// assert_eq!(engine.check_address("default", &Method::GET, ip, remaining), Some(Some(0)));
    /// assert_eq!(engine.check_address("default", &Method::GET, ip, remaining), Some(None));
    /// assert_eq!(engine.check_address("other", &Method::GET, ip, remaining), None);
    /// ```
    pub fn check_address<R>(
        &self,
        rule_set: &str,
        method: &Method,
        client_ip: Option<IpAddr>,
        then: impl FnOnce(AddressDecision<'_>) -> R,
    ) -> Option<R> {
        let memory = self.inner.direct.as_ref()?;
        // What `check` records or shows in its span, it decides itself.
        if self.inner.recorder.is_some() || self.inner.key_text || tracing::enabled!(tracing::Level::DEBUG) {
            return None;
        }
        // Lent in place where the provider can (no reference count written), else the
        // snapshot it hands out; either is the one rule set the decision reads.
        let handed_out;
        let set: &RuleSet = match self.inner.provider.rule_set_in_place(rule_set) {
            Some(lent) => lent?,
            None => {
                let Ok(Ok(Some(set))) = self.inner.provider.rule_set(rule_set).into_ready() else {
                    return None;
                };
                handed_out = set;
                &handed_out
            }
        };
        let rule = one_band_rule(set).filter(|rule| !rule.has_path_patterns())?;
        let typed = self.inner.resolver.typed_by_address(rule, client_ip)?;
        if !rule.applies_to_paths(None, method) {
            let decision = Decision::without_bands(set.id().clone(), Outcome::NoMatchingRule);
            return Some(then(AddressDecision::Decided(decision)));
        }
        /// The text of a key known by its typed value: none.
        static NO_TEXT: Text = Text::new();
        let bucket = Bucket::of(set, rule, &NO_TEXT, typed);
        let band = &rule.bands()[0];
        Some(match memory.acquire_one_admitted(&bucket, band) {
            Ok(admitted) => then(AddressDecision::Admitted(AdmittedBand::new(
                rule,
                band,
                admitted.now_unix_nanos,
                admitted.remaining,
                admitted.reset_after,
            ))),
            Err(outcome) => then(AddressDecision::Decided(Decision::from_enforced_outcome(
                set.id().clone(),
                outcome,
            ))),
        })
    }

    fn check_unrecorded(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        match self.inner.provider.rule_set(ctx.rule_set_id()).into_ready() {
            Ok(lookup) => self.decide(lookup, ctx),
            Err(pending) => {
                let this = self.clone();
                let ctx = ctx.clone();
                MaybeReady::boxed(async move {
                    let lookup = pending.await;
                    this.decide(lookup, &ctx).await
                })
            }
        }
    }

    /// The acquire request of `ctx` under `set`: every rule that applies, with its key;
    /// or, when there is nothing to ask the limiter, the rule set's id and the outcome (no
    /// rule applies, or a rule refuses a request without its key), or the error that
    /// refuses the request (an enforced rule's key reads an ambiguous identity).
    #[inline(always)]
    fn request_for(&self, set: Arc<RuleSet>, ctx: &RequestContext) -> Result<AcquireRequest, Unasked> {
        let with_patterns = set.rules().iter().any(Rule::has_path_patterns);
        let mut request = AcquireRequest::new(set);
        let mut denied_by = None;
        let mut ambiguous_for = None;
        let method = ctx.method();
        // `paths` is `None` when no rule has path patterns.
        let mut select = |paths: Option<&RequestPaths<'_>>| {
            for i in 0..request.rule_set().rules().len() {
                let rule = &request.rule_set().rules()[i];
                if !rule.applies_to_paths(paths, method) {
                    continue;
                }
                // The key value is written where the request keeps it.
                let mut resolved = Resolved::Skip;
                request.push_keyed(i, |rule, key, typed| {
                    resolved = self
                        .inner
                        .resolver
                        .resolve_into(rule, ctx, key, typed, self.inner.key_text);
                    matches!(resolved, Resolved::Key | Resolved::Ambiguous)
                });
                let rule = &request.rule_set().rules()[i];
                if rule.mode() != Mode::Shadow {
                    match resolved {
                        Resolved::Deny => {
                            denied_by = Some(rule.id().clone());
                            break;
                        }
                        Resolved::Ambiguous => {
                            ambiguous_for = Some(rule.id().clone());
                            break;
                        }
                        Resolved::Key | Resolved::Skip => {}
                    }
                }
            }
        };
        // A rule applies when its pattern matches the normalized path or the path as the
        // router sees it: normalization adds rules, never removes one. The paths are split
        // only when a rule has patterns.
        if with_patterns {
            with_paths(ctx, |paths| select(Some(paths)));
        } else {
            select(None);
        }
        if let Some(rule) = ambiguous_for {
            return Err(Unasked::Refused(ambiguous_identity(&rule)));
        }
        if let Some(rule) = denied_by {
            let outcome = Outcome::MissingKey { rule };
            let id = request.rule_set().id().clone();
            return Err(Unasked::Decided(id, outcome));
        }
        if request.is_empty() {
            let id = request.rule_set().id().clone();
            return Err(Unasked::Decided(id, Outcome::NoMatchingRule));
        }
        Ok(request)
    }

    /// Charges this engine's limiter with a request that another handler admitted
    /// ([`RateLimiter::charge`]), for every rule of `ctx` that applies: what
    /// [`FallbackHandler`](crate::FallbackHandler) does with its local engine, so that
    /// when the other handler fails the local engine starts from what it admitted. Nothing
    /// when the engine's limiter is not local, or its rule set is not at hand.
    pub(crate) fn charge(&self, ctx: &RequestContext) {
        let limiter = &self.inner.limiter;
        if !limiter.is_local() {
            return;
        }
        let Ok(Ok(Some(set))) = self.inner.provider.rule_set(ctx.rule_set_id()).into_ready() else {
            return;
        };
        if let Ok(request) = self.request_for(set, ctx) {
            limiter.charge(&request);
        }
    }

    /// An identity of each bucket `ctx` counts in, for every rule of it that applies,
    /// hashed with `keys`: the rule set, the rule and the key. What
    /// [`FallbackHandler`](crate::FallbackHandler) finds the requests it owes the handler it
    /// wraps by. None when the rule set is not at hand.
    pub(crate) fn bucket_ids(&self, ctx: &RequestContext, keys: &impl BuildHasher) -> SmallVec<[u64; 4]> {
        let mut ids = SmallVec::new();
        let Ok(Ok(Some(set))) = self.inner.provider.rule_set(ctx.rule_set_id()).into_ready() else {
            return ids;
        };
        if let Ok(request) = self.request_for(set, ctx) {
            for b in request.buckets() {
                ids.push(keys.hash_one((b.rule_set.id(), b.rule.id(), b.key, b.typed)));
            }
        }
        ids
    }

    fn decide(&self, lookup: RuleSetLookup, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        let set = match lookup {
            Ok(Some(set)) => set,
            Ok(None) => {
                let outcome = match self.inner.unknown_rule_set {
                    UnknownRuleSet::Allow => Outcome::UnknownRuleSetAllowed,
                    UnknownRuleSet::Deny => Outcome::UnknownRuleSetDenied,
                };
                if outcome == Outcome::UnknownRuleSetAllowed && !self.inner.warned_unknown.swap(true, Ordering::Relaxed)
                {
                    // Once per engine: the id may come from the request, one per request.
                    tracing::warn!(
                        rule_set = %crate::error::Shown(ctx.rule_set_id()),
                        "a request names a rule set no rule set has: admitted, and no rule counts it \
                         (UnknownRuleSet::Allow); logged once, later ones at trace level"
                    );
                } else {
                    tracing::trace!(rule_set = %crate::error::Shown(ctx.rule_set_id()), ?outcome, "unknown rule set");
                }
                // Not interned: the id may come from the request (see `Name`).
                let id = ctx.shared_rule_set_id().clone();
                return MaybeReady::ready(Ok(Decision::without_bands(id, outcome)));
            }
            Err(source) => {
                return MaybeReady::ready(Err(match source.downcast::<RuleError>() {
                    // A rule set refused by the limiter's validation when it was loaded.
                    Ok(rule) => Error::Rule(*rule),
                    Err(source) if source.is::<crate::LookupsBusy>() => Error::Overloaded(source.to_string()),
                    Err(source) => Error::Provider {
                        rule_set: ctx.rule_set_id().to_owned(),
                        source,
                    },
                }));
            }
        };

        if is_too_long(ctx) && set.rules().iter().any(Rule::has_path_patterns) {
            // Refused rather than matched by every pattern: a rule pulled in so could bring
            // a looser failure policy than the request's own rules (see
            // `LONGEST_MATCHED_PATH`).
            return MaybeReady::ready(Err(Error::Refused(format!(
                "the request's path is {} bytes long: rules are matched against paths of up to {LONGEST_MATCHED_PATH} bytes",
                ctx.longest_path_len()
            ))));
        }
        if let Some(memory) = &self.inner.direct {
            if let Some(rule) = one_band_rule(&set) {
                return MaybeReady::ready(self.decide_one(memory, &set, rule, ctx));
            }
        }
        // The request holds the one reference to the rule set taken by the lookup.
        let mut request = match self.request_for(set, ctx) {
            Ok(request) => request,
            Err(Unasked::Decided(id, outcome)) => return MaybeReady::ready(Ok(Decision::without_bands(id, outcome))),
            Err(Unasked::Refused(error)) => return MaybeReady::ready(Err(error)),
        };
        // Rules that wait for the refill, while they have waiters' places free.
        let places = self.inner.waiters.admit(&mut request, ctx.max_wait());
        // The clock is read only for a recorder.
        let start = self.inner.recorder.as_ref().map(|_| Instant::now());
        // What memory admitted for the request's `fallback_local` buckets while the backend
        // failed, the request takes with its own permits, however it is decided: by the
        // backend, from a lease (or the call adding to it), or for later (a waiting
        // request's place keeps it when given back, see `wait_for`).
        let owes = self.inner.fallback.owe_into(&mut request);
        // Leases decide the requests of leased rules; one that may wait for the refill is
        // decided by the backend as without leases (its place taken at one instant for all
        // its rules).
        let acquired = match &self.inner.leases {
            Some(leases) if request.buckets().any(|b| b.rule.lease().is_some()) && !request.may_wait() => {
                leases.acquire(&request)
            }
            _ => self.inner.limiter.acquire(&request),
        };
        match acquired.into_ready() {
            Ok(result) => {
                if owes {
                    self.inner.fallback.settle(&request, &result);
                }
                self.inner.record_backend_call(start, &result);
                match &result {
                    Ok(outcome) if may_wait(&places) && outcome.admitted_after > Duration::ZERO => {
                        Inner::wait(self.inner.clone(), request, result, places)
                    }
                    _ => MaybeReady::ready(self.inner.decided(&request, result)),
                }
            }
            Err(pending) if owes || may_wait(&places) => {
                // What the call takes for others (owed permits, a waiting place) is settled
                // by its answer even if the request is dropped before it (`Abandoned`).
                let abandoned = Abandoned {
                    inner: self.inner.clone(),
                    request,
                    places,
                    owes,
                };
                let call = Settled::new(pending, abandoned, Abandoned::settle);
                MaybeReady::boxed(async move {
                    let (
                        Abandoned {
                            inner,
                            request,
                            places,
                            owes,
                        },
                        result,
                    ) = call.await;
                    if owes {
                        inner.fallback.settle(&request, &result);
                    }
                    inner.record_backend_call(start, &result);
                    match &result {
                        Ok(outcome) if may_wait(&places) && outcome.admitted_after > Duration::ZERO => {
                            Inner::wait(inner, request, result, places).await
                        }
                        _ => inner.decided(&request, result),
                    }
                })
            }
            Err(pending) => {
                let this = self.inner.clone();
                MaybeReady::boxed(async move {
                    let result = pending.await;
                    this.record_backend_call(start, &result);
                    // The wait, if any, is a future of its own: what it needs is not kept
                    // in this one, which every request that goes to the backend allocates.
                    let waiting = match &result {
                        Ok(outcome) if may_wait(&places) && outcome.admitted_after > Duration::ZERO => {
                            Inner::wait(this, request, result, places)
                        }
                        _ => return this.decided(&request, result),
                    };
                    waiting.await
                })
            }
        }
    }
}

/// What a request whose call is out took for others, settled by the backend's answer if the
/// request is dropped before it (its client gone, an HTTP/2 reset, an outer timeout): the
/// call then runs to its end on the runtime ([`Settled`]). Permits owed by memory's
/// admissions during an outage ([`Fallback::owe_into`]) are paid if the backend admitted the
/// request and stay owed otherwise; the place the backend gave a waiting request goes back,
/// and its waiter's place is held until then. Dropped with the request, a place was kept
/// for nobody and the waiter's place was free while the call still ran.
struct Abandoned {
    inner: Arc<Inner>,
    request: AcquireRequest,
    places: Option<Places>,
    owes: bool,
}

impl Abandoned {
    /// Settles what the request took by `result`, its answer (`None`: the call never went
    /// out, or how it ended is unknown).
    fn settle(self, result: Option<Result<AcquireOutcome, BoxError>>) {
        let Self {
            inner,
            request,
            places,
            owes,
        } = self;
        let Some(result) = result else {
            return;
        };
        if owes {
            inner.fallback.settle(&request, &result);
        }
        if let Ok(outcome) = &result {
            if may_wait(&places) && outcome.allowed && outcome.admitted_after > Duration::ZERO {
                crate::wait::give_back(inner.limiter.clone(), &request, outcome);
            }
        }
        drop(places);
    }
}

impl Inner {
    /// A request the backend admits after a wait, its waiters' places taken before the
    /// call: it waits until then, and is decided by `result`.
    fn wait(
        this: Arc<Self>,
        request: AcquireRequest,
        result: Result<AcquireOutcome, BoxError>,
        places: Option<Places>,
    ) -> MaybeReady<Result<Decision, Error>> {
        let Ok(outcome) = &result else {
            return MaybeReady::ready(this.decided(&request, result));
        };
        let (limiter, outcome, waited) = (this.limiter.clone(), outcome.clone(), request.clone());
        wait_for(limiter, &waited, &outcome, places, move || {
            this.decided(&request, result)
        })
    }
}

/// The rule of a rule set of one enforced rule of one band, that neither waits nor leases:
/// such a rule set is decided by the in-memory limiter without an acquire request.
#[inline]
fn one_band_rule(set: &RuleSet) -> Option<&Rule> {
    match set.rules() {
        [rule]
            if rule.bands().len() == 1 && rule.mode() == Mode::Enforce && !rule.waits() && rule.lease().is_none() =>
        {
            Some(rule)
        }
        _ => None,
    }
}

impl Engine {
    /// Decides a request of a rule set of one enforced rule of one band ([`one_band_rule`])
    /// with the in-memory limiter: what the general path does for it, the rule matched, its
    /// key resolved and the limiter asked for its one bucket, without building an
    /// [`AcquireRequest`].
    fn decide_one(
        &self,
        memory: &MemoryLimiter,
        set: &RuleSet,
        rule: &Rule,
        ctx: &RequestContext,
    ) -> Result<Decision, Error> {
        if !rule.applies(ctx) {
            return Ok(Decision::without_bands(set.id().clone(), Outcome::NoMatchingRule));
        }
        /// The text of a key known by its typed value: none.
        static NO_TEXT: Text = Text::new();
        let resolver = &self.inner.resolver;
        let outcome = match resolver.typed(rule, ctx).filter(|_| !self.inner.key_text) {
            Some(typed) => memory.acquire_one(&Bucket::of(set, rule, &NO_TEXT, typed), &rule.bands()[0]),
            None => {
                let (mut key, mut typed) = (Text::new(), TypedKey::Text);
                match resolver.resolve_into(rule, ctx, &mut key, &mut typed, self.inner.key_text) {
                    Resolved::Key => {}
                    Resolved::Ambiguous => return Err(ambiguous_identity(rule.id())),
                    Resolved::Skip => return Ok(Decision::without_bands(set.id().clone(), Outcome::NoMatchingRule)),
                    Resolved::Deny => {
                        let outcome = Outcome::MissingKey {
                            rule: rule.id().clone(),
                        };
                        return Ok(Decision::without_bands(set.id().clone(), outcome));
                    }
                }
                memory.acquire_one(&Bucket::of(set, rule, &key, typed), &rule.bands()[0])
            }
        };
        Ok(Decision::from_enforced_outcome(set.id().clone(), outcome))
    }
}

/// Why [`Engine::request_for`] asks the limiter nothing.
enum Unasked {
    /// The decision is known: the rule set's id and the outcome.
    Decided(Name, Outcome),
    /// The request cannot be counted.
    Refused(Error),
}

/// The refusal of a request whose user id or API key, read by `rule`'s key, is
/// [`AMBIGUOUS_IDENTITY`](crate::AMBIGUOUS_IDENTITY).
fn ambiguous_identity(rule: &Name) -> Error {
    Error::Refused(format!(
        "rule `{}` counts by the user id or API key, and the request names several different ones \
         (a header sent more than once with different values)",
        rule
    ))
}

impl Inner {
    /// The decision from the limiter's answer, or from the failure policies when it failed.
    fn decided(&self, request: &AcquireRequest, result: Result<AcquireOutcome, BoxError>) -> Result<Decision, Error> {
        match result {
            Ok(outcome) => {
                self.fallback.record(request, &outcome);
                Ok(Decision::from_outcome(request.rule_set().id().clone(), outcome))
            }
            Err(error) => self.fallback.decide(request, error),
        }
    }

    /// Reports a limiter call that started at `start` (read only with a recorder), unless
    /// it ended with a configuration error.
    fn record_backend_call(&self, start: Option<Instant>, result: &Result<AcquireOutcome, BoxError>) {
        let (Some(recorder), Some(start)) = (&self.recorder, start) else {
            return;
        };
        let error = match result {
            Ok(_) => None,
            Err(error) if is_rule_error(error) => return,
            Err(error) => Some(error),
        };
        recorder.record_backend_call(self.limiter.backend_name(), start.elapsed(), error);
    }
}

/// What [`Engine::check_address`] decided.
#[derive(Debug, Clone)]
pub enum AddressDecision<'a> {
    /// Admitted, the permit taken from the rule set's one band: that band's figures, the
    /// only band of the decision [`Engine::check`] makes (its report is
    /// [`AdmittedBand::report`]).
    Admitted(AdmittedBand<'a>),
    /// Any other decision, as [`Engine::check`] makes it.
    Decided(Decision),
}

impl RateLimitHandler for Engine {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        Engine::check(self, ctx)
    }
}

/// Records the decision's outcome in its span, and sends it to the recorder.
fn finish(
    span: &tracing::Span,
    recorder: Option<&dyn RateLimitMetricsRecorder>,
    rule_set: &str,
    result: &Result<Decision, Error>,
) {
    match result {
        Ok(decision) => {
            span.record("outcome", decision.outcome_name());
            if let Some(recorder) = recorder {
                recorder.record_decision(decision);
            }
        }
        Err(error) => {
            span.record("outcome", "error");
            if let Some(recorder) = recorder {
                recorder.record_error(rule_set, error);
            }
        }
    }
}
