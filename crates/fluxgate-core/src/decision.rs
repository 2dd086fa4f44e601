//! The decision for one request.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use crate::bands::Bands;

use crate::limiter::{AcquireOutcome, Wait};
use crate::name::Name;
use crate::num::ceil_secs;
use crate::rule::{Band, Mode, Rule};

/// Why a decision came out the way it did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Every band of every enforced rule admitted the request.
    Admitted,
    /// No enabled rule of the rule set applies to the request.
    NoMatchingRule,
    /// No rule set has the request's id, and the engine admits such requests.
    UnknownRuleSetAllowed,
    /// No rule set has the request's id, and the engine rejects such requests.
    UnknownRuleSetDenied,
    /// A band rejected the request.
    RateLimited,
    /// A rule with `on_missing_key: deny` found no key value.
    MissingKey {
        /// The rule.
        rule: Name,
    },
    /// The backend failed and a rule's failure policy is `fail_closed`.
    BackendUnavailable {
        /// The rule.
        rule: Name,
    },
}

impl Outcome {
    /// Whether the request may pass.
    pub fn allows(&self) -> bool {
        match self {
            Self::Admitted | Self::NoMatchingRule | Self::UnknownRuleSetAllowed => true,
            Self::UnknownRuleSetDenied
            | Self::RateLimited
            | Self::MissingKey { .. }
            | Self::BackendUnavailable { .. } => false,
        }
    }
}

/// One band's figures after a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BandReport {
    /// The rule.
    pub rule: Name,
    /// The band's name: its label, or `b<position>`.
    pub band: Name,
    /// Whether the band has a label of its own.
    pub labeled: bool,
    /// The capacity.
    pub limit: u64,
    /// Permits left.
    pub remaining: u64,
    /// The window.
    pub window: Duration,
    /// Time until the band is full again.
    pub reset_after: Duration,
    /// When the band is full again.
    pub reset_at: SystemTime,
    /// Whether this band alone admitted the request.
    pub allowed: bool,
    /// Whether the rule is in shadow mode.
    pub shadow: bool,
    /// When this band would admit the request.
    pub wait: Wait,
}

impl BandReport {
    /// When the band is full again, in whole Unix seconds (rounded up).
    pub fn reset_unix_secs(&self) -> u64 {
        ceil_secs(self.reset_at.duration_since(UNIX_EPOCH).unwrap_or_default())
    }

    /// The report of `band` of `rule` after a decision taken at `now_unix_nanos`.
    #[inline]
    pub(crate) fn new(
        rule: &Rule,
        band: &Band,
        now_unix_nanos: u64,
        remaining: u64,
        reset_after: Duration,
        wait: Wait,
    ) -> Self {
        Self {
            rule: rule.id().clone(),
            band: band.name().clone(),
            labeled: band.label().is_some(),
            limit: band.capacity(),
            remaining,
            window: band.window(),
            reset_after,
            reset_at: reset_at(now_unix_nanos, reset_after),
            allowed: wait == Wait::None,
            shadow: rule.mode() == Mode::Shadow,
            wait,
        }
    }
}

/// The one band of a rule set that admitted a request, as [`Engine::check_address`]
/// gives it: the band's figures after the decision, read from the rule set rather than
/// copied into a [`BandReport`] (its names are not cloned, and no instant is built). Its
/// [`report`](Self::report) is the report [`Engine::check`] gives for the same decision.
///
/// [`Engine::check_address`]: crate::Engine::check_address
/// [`Engine::check`]: crate::Engine::check
#[derive(Debug, Clone, Copy)]
pub struct AdmittedBand<'a> {
    rule: &'a Rule,
    band: &'a Band,
    remaining: u64,
    reset_after: Duration,
    now_unix_nanos: u64,
}

impl<'a> AdmittedBand<'a> {
    /// The band `band` of `rule`, admitted at `now_unix_nanos` with `remaining` permits left
    /// and full again after `reset_after`.
    pub(crate) fn new(
        rule: &'a Rule,
        band: &'a Band,
        now_unix_nanos: u64,
        remaining: u64,
        reset_after: Duration,
    ) -> Self {
        Self {
            rule,
            band,
            remaining,
            reset_after,
            now_unix_nanos,
        }
    }

    /// The rule.
    pub fn rule(&self) -> &'a Rule {
        self.rule
    }

    /// The band.
    pub fn band(&self) -> &'a Band {
        self.band
    }

    /// The capacity ([`BandReport::limit`]).
    pub fn limit(&self) -> u64 {
        self.band.capacity()
    }

    /// Permits left ([`BandReport::remaining`]).
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Time until the band is full again ([`BandReport::reset_after`]).
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// When the band is full again, in whole Unix seconds rounded up: the report's
    /// [`BandReport::reset_unix_secs`], worked out without building its instant.
    pub fn reset_unix_secs(&self) -> u64 {
        ceil_secs(Duration::from_nanos(reset_unix_nanos(
            self.now_unix_nanos,
            self.reset_after,
        )))
    }

    /// The band's report, as [`Engine::check`](crate::Engine::check) gives it.
    pub fn report(&self) -> BandReport {
        BandReport::new(
            self.rule,
            self.band,
            self.now_unix_nanos,
            self.remaining,
            self.reset_after,
            Wait::None,
        )
    }
}

impl BandReport {
    /// Sets the figures of a band that was evaluated but not committed: `remaining` and the
    /// time until it is full, from `now_unix_nanos`.
    pub(crate) fn refigure(&mut self, now_unix_nanos: u64, remaining: u64, reset_after: Duration) {
        self.remaining = remaining;
        self.reset_after = reset_after;
        self.reset_at = reset_at(now_unix_nanos, reset_after);
    }
}

/// When a band is full again: `reset_after` after `now_unix_nanos` (at the latest the last
/// instant of 64-bit nanoseconds since the epoch, in the year 2554).
#[inline]
fn reset_at(now_unix_nanos: u64, reset_after: Duration) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(reset_unix_nanos(now_unix_nanos, reset_after))
}

/// When a band is full again, in Unix nanoseconds.
fn reset_unix_nanos(now_unix_nanos: u64, reset_after: Duration) -> u64 {
    let after = u64::try_from(reset_after.as_nanos()).unwrap_or(u64::MAX);
    now_unix_nanos.saturating_add(after)
}

/// The binding band of a decision's enforced `bands`, and the retry-after: on rejection
/// the rejecting band with the longest wait (`Never` the longest of all; the first in
/// priority order on ties) and its wait; otherwise the band with the least remaining, of
/// those the one full again last (the first in priority order on ties), and no wait.
///
/// Of two bands with nothing left, the one full again later is the one a client must wait
/// for: naming the other, the headers would send the client back when that one is full,
/// to be refused by the later one.
#[inline]
pub(crate) fn binding(bands: &[BandReport], allowed: bool) -> (Option<usize>, Option<Duration>) {
    // One band, the common case: it binds when it admits, and when it refuses.
    if let [only] = bands {
        return match only.wait {
            _ if allowed => (Some(0), None),
            Wait::None => (None, None),
            Wait::After(wait) => (Some(0), Some(wait)),
            Wait::Never => (Some(0), None),
        };
    }
    binding_of_several(bands, allowed)
}

/// [`binding`] of no band or of several.
fn binding_of_several(bands: &[BandReport], allowed: bool) -> (Option<usize>, Option<Duration>) {
    use std::cmp::Reverse;
    if allowed {
        let least = bands
            .iter()
            .enumerate()
            .min_by_key(|(i, b)| (b.remaining, Reverse(b.reset_after), *i))
            .map(|(i, _)| i);
        return (least, None);
    }
    let rank = |w: &Wait| match w {
        Wait::None => None,
        Wait::After(d) => Some((0, *d)),
        Wait::Never => Some((1, Duration::ZERO)),
    };
    let worst = bands
        .iter()
        .enumerate()
        .filter_map(|(i, b)| rank(&b.wait).map(|r| (r, Reverse(i))))
        .max()
        .map(|(_, Reverse(i))| i);
    let retry = worst.and_then(|i| match bands[i].wait {
        Wait::None | Wait::Never => None,
        Wait::After(d) => Some(d),
    });
    (worst, retry)
}

/// The decision for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Decision {
    /// Whether the request may pass, and why: see [`Decision::allowed`].
    pub outcome: Outcome,
    /// The rule set that decided.
    pub rule_set: Name,
    /// On rejection by a band: how long until the request could be admitted. `None`
    /// when it never can (more permits than a band's capacity) or for other rejections.
    pub retry_after: Option<Duration>,
    /// Every band of the enforced rules, in rule priority order.
    pub bands: Bands,
    /// Every band of the rules in shadow mode.
    pub shadow_bands: Bands,
    /// The first shadow rule that would have rejected the request.
    pub shadow_rejected_by: Option<Name>,
    /// Index of the binding band in `bands`.
    pub binding_index: Option<usize>,
    /// Whether the fallback limiter decided, because the backend failed.
    pub degraded: bool,
    /// Whether rules were left out of the decision because the backend failed and their
    /// failure policy is `fail_open` (such decisions are [`degraded`](Self::degraded)
    /// too).
    pub failed_open: bool,
}

impl Decision {
    /// A decision that involves no band.
    pub fn without_bands(rule_set: Name, outcome: Outcome) -> Self {
        Self {
            outcome,
            rule_set,
            binding_index: None,
            degraded: false,
            failed_open: false,
            retry_after: None,
            bands: Bands::new(),
            shadow_bands: Bands::new(),
            shadow_rejected_by: None,
        }
    }

    /// The decision from a limiter's outcome: the enforced and shadow bands apart, the
    /// binding band and the retry-after.
    pub(crate) fn from_outcome(rule_set: Name, mut outcome: AcquireOutcome) -> Self {
        if !outcome.bands.iter().any(|b| b.shadow) {
            return Self::from_enforced_outcome(rule_set, outcome);
        }
        let mut shadow = Bands::with_capacity(outcome.bands.len());
        let mut enforced = Bands::with_capacity(outcome.bands.len());
        for band in outcome.bands.drain(..) {
            if band.shadow {
                shadow.push(band);
            } else {
                enforced.push(band);
            }
        }
        outcome.bands = enforced;
        let shadow_rejected_by = shadow.iter().find(|b| !b.allowed).map(|b| b.rule.clone());
        Decision {
            shadow_bands: shadow,
            shadow_rejected_by,
            ..Self::from_enforced_outcome(rule_set, outcome)
        }
    }

    /// [`from_outcome`](Self::from_outcome) for an outcome of enforced bands only, which
    /// has no shadow band to set apart.
    #[inline]
    pub(crate) fn from_enforced_outcome(rule_set: Name, outcome: AcquireOutcome) -> Self {
        let (binding_index, retry_after) = binding(&outcome.bands, outcome.allowed);
        Decision {
            outcome: if outcome.allowed {
                Outcome::Admitted
            } else {
                Outcome::RateLimited
            },
            rule_set,
            binding_index,
            degraded: false,
            failed_open: false,
            retry_after,
            bands: outcome.bands,
            shadow_bands: Bands::new(),
            shadow_rejected_by: None,
        }
    }

    /// Whether the request may pass (what its [`Outcome`] says).
    pub fn allowed(&self) -> bool {
        self.outcome.allows()
    }

    /// A short, fixed name of the decision's outcome, in lowercase: the `outcome` label of
    /// the decision metrics and the `outcome` field of the decision's span.
    ///
    /// | name | outcome |
    /// | --- | --- |
    /// | `allowed` | [`Outcome::Admitted`], and no shadow rule would have rejected |
    /// | `shadow_rejected` | [`Outcome::Admitted`], but a shadow rule would have rejected ([`shadow_rejected_by`](Self::shadow_rejected_by)) |
    /// | `rejected` | [`Outcome::RateLimited`] |
    /// | `no_matching_rule` | [`Outcome::NoMatchingRule`] |
    /// | `unknown_rule_set_allowed` | [`Outcome::UnknownRuleSetAllowed`] |
    /// | `unknown_rule_set_denied` | [`Outcome::UnknownRuleSetDenied`] |
    /// | `missing_key` | [`Outcome::MissingKey`] |
    /// | `unavailable` | [`Outcome::BackendUnavailable`] |
    ///
    /// An outcome added in a later version may have a name of its own.
    pub fn outcome_name(&self) -> &'static str {
        match self.outcome {
            Outcome::Admitted if self.shadow_rejected_by.is_some() => "shadow_rejected",
            Outcome::Admitted => "allowed",
            Outcome::RateLimited => "rejected",
            Outcome::NoMatchingRule => "no_matching_rule",
            Outcome::UnknownRuleSetAllowed => "unknown_rule_set_allowed",
            Outcome::UnknownRuleSetDenied => "unknown_rule_set_denied",
            Outcome::MissingKey { .. } => "missing_key",
            Outcome::BackendUnavailable { .. } => "unavailable",
        }
    }

    /// The binding band of the enforced rules: on rejection, the rejecting band with the
    /// longest wait; otherwise the band with the least remaining (of those, the one full
    /// again last; the first in priority order on ties).
    pub fn binding(&self) -> Option<&BandReport> {
        self.binding_index.and_then(|i| self.bands.get(i))
    }

    /// The binding rule's id.
    pub fn rule(&self) -> Option<&Name> {
        match &self.outcome {
            Outcome::MissingKey { rule } | Outcome::BackendUnavailable { rule } => Some(rule),
            _ => self.binding().map(|b| &b.rule),
        }
    }

    /// The binding band's capacity.
    pub fn limit(&self) -> Option<u64> {
        self.binding().map(|b| b.limit)
    }

    /// The least remaining over the enforced bands.
    pub fn remaining(&self) -> Option<u64> {
        self.bands.iter().map(|b| b.remaining).min()
    }

    /// When the binding band is full again, in whole Unix seconds (rounded up).
    pub fn reset_unix_secs(&self) -> Option<u64> {
        self.binding().map(BandReport::reset_unix_secs)
    }

    /// `Retry-After` in whole seconds: rounded up, at least 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|d| ceil_secs(d).max(1))
    }
}
