//! Metrics through the [`metrics`] facade (feature `metrics`).
//!
//! [`MetricsRecorder`] is a [`RateLimitMetricsRecorder`] that counts an engine's
//! decisions, errors and backend calls; a [`ReloadingRuleSetProvider`](crate::ReloadingRuleSetProvider)
//! counts its reloads, and the Redis backend and the tower layer count what they decide on
//! their own when their `metrics` features are on. Nothing is exported here: the
//! application installs a recorder of the `metrics` crate (a Prometheus exporter, say), and
//! may call [`describe`] once to give every metric its help text.
//!
//! | metric | type | labels | counts |
//! | --- | --- | --- | --- |
//! | `fluxgate_decisions_total` | counter | `rule_set`, `rule`, `outcome` | decisions of an engine |
//! | `fluxgate_shadow_rejections_total` | counter | `rule_set`, `rule` | requests a shadow rule would have rejected (and, from the layer in shadow mode, rejections it let through) |
//! | `fluxgate_errors_total` | counter | `rule_set`, `kind` | checks that ended without a decision |
//! | `fluxgate_fail_open_total` | counter | `rule_set` | requests admitted because the backend failed and the failure policy is `fail_open` |
//! | `fluxgate_degraded_decisions_total` | counter | `rule_set` | decisions taken by the failure policies because the backend failed |
//! | `fluxgate_backend_seconds` | histogram | `backend` | the duration of each call of the limiter backend |
//! | `fluxgate_backend_errors_total` | counter | `backend` | calls of the limiter backend that failed |
//! | `fluxgate_reloads_total` | counter | `result` | rule reloads of a `ReloadingRuleSetProvider` (`ok` or `failed`) |
//! | `fluxgate_deny_cache_hits_total` | counter | | requests the Redis backend's deny cache rejected without a Redis call |
//!
//! Label values are ids of validated rule sets and rules, and fixed names, never paths,
//! addresses, keys or header values:
//!
//! - `rule_set`: the rule set's id; [`UNKNOWN`] when no rule set has the id the request
//!   asked for (that id comes from the request, so it is never a label), or when the rule
//!   provider failed.
//! - `rule`: the binding rule's id ([`Decision::rule`]); [`NONE`] when no rule decided
//!   (no rule applies, unknown rule set).
//! - `outcome`: [`Decision::outcome_name`].
//! - `kind`: `backend`, `provider`, `rule` (a rule the backend cannot decide), `refused` (a
//!   request that cannot be rate-limited) or `overloaded` (its rule set not looked up in time).
//! - `backend`: [`RateLimiter::backend_name`](crate::RateLimiter::backend_name) (`memory`,
//!   `redis`, …).
//!
//! Rule set and rule ids have only the characters `A-Z a-z 0-9 _ - .`, so [`UNKNOWN`] and
//! [`NONE`] cannot be taken for an id.
//!
//! ```
//! use fluxgate_core::metrics::MetricsRecorder;
//! use fluxgate_core::{Engine, RuleSets};
//!
//! let rules = RuleSets::from_yaml_str(
//!     "rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 10, window: 1s}]}]}]",
//! )?;
//! // With the application's `metrics` recorder installed (a Prometheus exporter, say):
//! fluxgate_core::metrics::describe();
//! let engine = Engine::builder(rules).recorder(MetricsRecorder::new()).build()?;
//! # drop(engine);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::Duration;

use ::metrics::{counter, describe_counter, describe_histogram, histogram, SharedString, Unit};

use crate::decision::Decision;
use crate::error::{BoxError, Error};
use crate::handler::RateLimitMetricsRecorder;
use crate::name::Name;

/// `fluxgate_decisions_total{rule_set, rule, outcome}`: decisions of an engine.
pub const DECISIONS_TOTAL: &str = "fluxgate_decisions_total";
/// `fluxgate_shadow_rejections_total{rule_set, rule}`: requests a shadow rule would have
/// rejected.
pub const SHADOW_REJECTIONS_TOTAL: &str = "fluxgate_shadow_rejections_total";
/// `fluxgate_errors_total{rule_set, kind}`: checks that ended without a decision.
pub const ERRORS_TOTAL: &str = "fluxgate_errors_total";
/// `fluxgate_fail_open_total{rule_set}`: requests admitted because the backend failed and
/// the failure policy is `fail_open`.
pub const FAIL_OPEN_TOTAL: &str = "fluxgate_fail_open_total";
/// `fluxgate_degraded_decisions_total{rule_set}`: decisions taken by the failure policies
/// (the in-memory fallback, `fail_open`, `fail_closed`) because the backend failed.
pub const DEGRADED_DECISIONS_TOTAL: &str = "fluxgate_degraded_decisions_total";
/// `fluxgate_backend_seconds{backend}`: the duration of each call of the limiter backend.
pub const BACKEND_SECONDS: &str = "fluxgate_backend_seconds";
/// `fluxgate_backend_errors_total{backend}`: calls of the limiter backend that failed.
pub const BACKEND_ERRORS_TOTAL: &str = "fluxgate_backend_errors_total";
/// `fluxgate_reloads_total{result}`: rule reloads, `ok` or `failed`.
pub const RELOADS_TOTAL: &str = "fluxgate_reloads_total";
/// `fluxgate_deny_cache_hits_total`: requests the Redis backend's deny cache rejected
/// without a Redis call.
pub const DENY_CACHE_HITS_TOTAL: &str = "fluxgate_deny_cache_hits_total";

/// The `rule_set` label of a rule set id that is not known: no rule set has it, or the
/// provider failed to look it up.
pub const UNKNOWN: &str = "(unknown)";
/// The `rule` label of a decision no rule took part in.
pub const NONE: &str = "(none)";

/// Gives every FluxGate metric its description and unit, in the recorder of the `metrics`
/// crate installed now (the help text of a Prometheus exporter). Optional; call it once,
/// after installing the recorder.
pub fn describe() {
    describe_counter!(
        DECISIONS_TOTAL,
        "Rate-limit decisions, by rule set, binding rule and outcome."
    );
    describe_counter!(
        SHADOW_REJECTIONS_TOTAL,
        "Requests a rule in shadow mode would have rejected (not enforced)."
    );
    describe_counter!(
        ERRORS_TOTAL,
        "Rate-limit checks that ended without a decision, by kind."
    );
    describe_counter!(
        FAIL_OPEN_TOTAL,
        "Requests admitted because the rate-limit backend failed and the failure policy is fail_open."
    );
    describe_counter!(
        DEGRADED_DECISIONS_TOTAL,
        "Decisions taken by the failure policies because the rate-limit backend failed."
    );
    describe_histogram!(
        BACKEND_SECONDS,
        Unit::Seconds,
        "Duration of each call of the rate-limit backend."
    );
    describe_counter!(BACKEND_ERRORS_TOTAL, "Calls of the rate-limit backend that failed.");
    describe_counter!(RELOADS_TOTAL, "Rule reloads, by result (ok, failed).");
    describe_counter!(
        DENY_CACHE_HITS_TOTAL,
        "Requests rejected by the Redis backend's local deny cache, without a Redis call."
    );
}

/// A [`RateLimitMetricsRecorder`] that sends an engine's decisions, errors and backend
/// calls to the [`metrics`] facade, as the metrics of the
/// [module](self) (every one but the reloads and the deny-cache hits). Set it with
/// [`EngineBuilder::recorder`](crate::EngineBuilder::recorder).
///
/// Per decision: `fluxgate_decisions_total`; `fluxgate_shadow_rejections_total` when a
/// shadow rule would have rejected the request (whatever the enforced rules said);
/// `fluxgate_degraded_decisions_total` when the failure policies decided, and
/// `fluxgate_fail_open_total` when the request was admitted with rules left out by
/// `fail_open`. Per error: `fluxgate_errors_total`. Per backend call:
/// `fluxgate_backend_seconds`, and `fluxgate_backend_errors_total` when it failed.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct MetricsRecorder {}

impl MetricsRecorder {
    /// A recorder.
    pub fn new() -> Self {
        Self {}
    }
}

impl RateLimitMetricsRecorder for MetricsRecorder {
    fn record_decision(&self, decision: &Decision) {
        let rule_set = rule_set_label(decision);
        counter!(
            DECISIONS_TOTAL,
            "rule_set" => rule_set.clone(),
            "rule" => rule_label(decision),
            "outcome" => decision.outcome_name(),
        )
        .increment(1);
        if let Some(shadow) = &decision.shadow_rejected_by {
            counter!(SHADOW_REJECTIONS_TOTAL, "rule_set" => rule_set.clone(), "rule" => label(shadow)).increment(1);
        }
        if decision.degraded {
            counter!(DEGRADED_DECISIONS_TOTAL, "rule_set" => rule_set.clone()).increment(1);
            if decision.failed_open && decision.allowed() {
                counter!(FAIL_OPEN_TOTAL, "rule_set" => rule_set).increment(1);
            }
        }
    }

    fn record_error(&self, rule_set: &str, error: &Error) {
        let (rule_set, kind) = match error {
            // The rule set was found: its id is valid.
            Error::Backend(_) => (SharedString::from(rule_set.to_owned()), "backend"),
            Error::Rule(_) => (SharedString::from(rule_set.to_owned()), "rule"),
            Error::Refused(_) => (SharedString::const_str(UNKNOWN), "refused"),
            // The id the request asked for, not known to be a rule set's.
            Error::Provider { .. } => (SharedString::const_str(UNKNOWN), "provider"),
            Error::Overloaded(_) => (SharedString::const_str(UNKNOWN), "overloaded"),
        };
        counter!(ERRORS_TOTAL, "rule_set" => rule_set, "kind" => kind).increment(1);
    }

    fn record_backend_call(&self, backend: &'static str, elapsed: Duration, error: Option<&BoxError>) {
        histogram!(BACKEND_SECONDS, "backend" => backend).record(elapsed.as_secs_f64());
        if error.is_some() {
            counter!(BACKEND_ERRORS_TOTAL, "backend" => backend).increment(1);
        }
    }
}

/// The `rule_set` label of a decision: its rule set's id, or [`UNKNOWN`] when no rule set
/// has the id the request asked for.
pub fn rule_set_label(decision: &Decision) -> SharedString {
    match decision.outcome {
        crate::Outcome::UnknownRuleSetAllowed | crate::Outcome::UnknownRuleSetDenied => {
            SharedString::const_str(UNKNOWN)
        }
        _ => label(&decision.rule_set),
    }
}

/// The `rule` label of a decision: its binding rule's id, or [`NONE`].
pub fn rule_label(decision: &Decision) -> SharedString {
    decision.rule().map_or(SharedString::const_str(NONE), label)
}

/// An id as a label value, without copying it.
fn label(id: &Name) -> SharedString {
    match id.parts() {
        Ok(interned) => SharedString::const_str(interned),
        Err(shared) => SharedString::from(shared.clone()),
    }
}

/// Counts a reload of a `ReloadingRuleSetProvider`.
pub(crate) fn reloaded(ok: bool) {
    counter!(RELOADS_TOTAL, "result" => if ok { "ok" } else { "failed" }).increment(1);
}
