//! The serde shape of the file format: what a rule file holds, before validation.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration::duration_str;
use super::{Algorithm, Mode, OnMissingKey, ScopeKind};
use crate::failure::FailurePolicy;

/// A rule file: `{ rule_sets: [...] }`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RulesFileSpec {
    /// The rule sets of the file.
    pub rule_sets: Vec<RuleSetSpec>,
}

/// A rule set as written in a file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RuleSetSpec {
    /// The rule set's id, unique in its source.
    pub id: String,
    /// Its rules.
    #[serde(default)]
    pub rules: Vec<RuleSpec>,
}

/// A rule as written in a file. See [`Rule`](super::Rule) for the meaning of each field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RuleSpec {
    /// Unique within the rule set.
    pub id: String,
    /// Disabled rules are ignored. Default `true`.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Which requests the rule applies to. Default: all.
    #[serde(default, rename = "match")]
    pub matcher: MatchSpec,
    /// Higher first. Default `0`.
    #[serde(default)]
    pub priority: i32,
    /// What the limit is counted per. Default `ip`.
    #[serde(default)]
    pub scope: ScopeKind,
    /// The attribute name, for `scope: attribute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attribute: Option<String>,
    /// The fields, for `scope: composite`: `ip`, `user`, `api_key` or attribute names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
    /// What happens when the scope's value is absent. Default `fallback_ip`.
    #[serde(default)]
    pub on_missing_key: OnMissingKey,
    /// The algorithm. Default `token_bucket`.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// An algorithm with its default band ([`Algorithm::preset_band`]), in place of
    /// `algorithm` and `bands`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<Algorithm>,
    /// The cost of one request. Default `1`.
    #[serde(default = "default_permits")]
    pub permits: u64,
    /// One or more bands; all must admit. Required unless `preset` is given.
    #[serde(default)]
    pub bands: Vec<BandSpec>,
    /// `enforce` or `shadow`. Default `enforce`.
    #[serde(default)]
    pub mode: Mode,
    /// What happens to this rule when the backend fails; default: the engine's policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_backend_failure: Option<FailurePolicy>,
    /// Local leases: an instance takes up to `max` permits of a key in one backend call
    /// and spends them without further calls. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseSpec>,
    /// What happens to a request the rule would refuse: `{ wait: { max_wait, max_waiters } }`
    /// lets it wait for the refill instead. Default: refused at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_limit: Option<OnLimitSpec>,
}

/// A rule's `on_limit` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OnLimitSpec {
    /// Wait for the refill instead of a refusal.
    pub wait: WaitSpec,
}

/// `on_limit: { wait: { max_wait: 500ms, max_waiters: 100 } }`. See
/// [`WaitPolicy`](super::WaitPolicy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct WaitSpec {
    /// The longest a request waits: one that would be admitted later is refused at once.
    #[serde(with = "duration_str")]
    pub max_wait: Duration,
    /// The most requests of the rule waiting at once on one instance; the next is refused
    /// at once.
    pub max_waiters: u32,
}

impl OnLimitSpec {
    /// Waiting at most `max_wait`, at most `max_waiters` requests at once.
    pub fn wait(max_wait: Duration, max_waiters: u32) -> Self {
        Self {
            wait: WaitSpec { max_wait, max_waiters },
        }
    }
}

/// A rule's `lease` block: `{ max: 100, ttl: 1s }`. See [`Lease`](super::Lease).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LeaseSpec {
    /// The most permits one call takes: at least the rule's `permits`, at most its smallest
    /// band's capacity.
    pub max: u64,
    /// How long an instance keeps permits it has not spent before it gives them back.
    #[serde(with = "duration_str")]
    pub ttl: Duration,
}

impl LeaseSpec {
    /// A lease of at most `max` permits, kept for `ttl`.
    pub fn new(max: u64, ttl: Duration) -> Self {
        Self { max, ttl }
    }
}

/// The `match` block of a rule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct MatchSpec {
    /// Ant-style path patterns; empty means every path.
    #[serde(default)]
    pub paths: Vec<String>,
    /// HTTP methods; empty means every method.
    #[serde(default)]
    pub methods: Vec<String>,
}

/// A band as written in a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct BandSpec {
    /// Tokens (or requests) per window.
    pub capacity: u64,
    /// The window: `500ms`, `1s`, `1m`, `1h`, `1d`.
    #[serde(with = "duration_str")]
    pub window: Duration,
    /// A name for headers and keys; defaults to the band's position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

fn default_true() -> bool {
    true
}

fn default_permits() -> u64 {
    1
}

impl RuleSetSpec {
    /// A rule set spec with these rules.
    pub fn new(id: impl Into<String>, rules: Vec<RuleSpec>) -> Self {
        Self { id: id.into(), rules }
    }
}

impl RuleSpec {
    /// A rule spec with the defaults of the file format and the given bands.
    pub fn new(id: impl Into<String>, bands: Vec<BandSpec>) -> Self {
        Self {
            id: id.into(),
            enabled: true,
            matcher: MatchSpec::default(),
            priority: 0,
            scope: ScopeKind::default(),
            attribute: None,
            fields: Vec::new(),
            on_missing_key: OnMissingKey::default(),
            algorithm: Algorithm::default(),
            preset: None,
            permits: 1,
            bands,
            mode: Mode::default(),
            on_backend_failure: None,
            lease: None,
            on_limit: None,
        }
    }
}

impl RuleSpec {
    /// A rule spec with the defaults of the file format and the preset band of `algorithm`
    /// (see [`Algorithm::preset_band`]).
    ///
    /// ```
    /// use fluxgate_core::{Algorithm, Rule, RuleSpec};
    /// let rule = Rule::from_spec("api", RuleSpec::preset("r", Algorithm::SlidingWindowCounter)).unwrap();
    /// assert_eq!(rule.bands()[0].capacity(), 10);
    /// assert_eq!(rule.bands()[0].window().as_secs(), 60);
    /// ```
    pub fn preset(id: impl Into<String>, algorithm: Algorithm) -> Self {
        Self {
            algorithm,
            ..Self::new(id, vec![algorithm.preset_band()])
        }
    }
}

impl BandSpec {
    /// A band of `capacity` per `window`, unlabeled.
    pub fn new(capacity: u64, window: Duration) -> Self {
        Self {
            capacity,
            window,
            label: None,
        }
    }

    /// Sets the label.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
}
