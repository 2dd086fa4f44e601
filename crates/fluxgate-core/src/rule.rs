//! The rule model: rule sets, rules, bands and scopes, with their file format.
//!
//! Rules are written as YAML, TOML or JSON (see `docs/configuration.md`):
//!
//! ```
//! use fluxgate_core::RuleSets;
//!
//! let sets = RuleSets::from_yaml_str(r#"
//! rule_sets:
//!   - id: api
//!     rules:
//!       - id: per-ip
//!         match: { paths: ["/api/**"] }
//!         scope: ip
//!         bands:
//!           - { capacity: 10, window: 1s, label: burst }
//!           - { capacity: 100, window: 1m, label: sustained }
//! "#).unwrap();
//! let api = sets.get("api").unwrap();
//! assert_eq!(api.rules()[0].bands()[1].capacity(), 100);
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use serde::{Deserialize, Serialize};

use crate::error::RuleError;
use crate::failure::FailurePolicy;
use crate::path::PathPattern;

/// The largest capacity a band may have.
pub const MAX_CAPACITY: u64 = 1 << 40;
/// The longest window a band may have (ten years).
pub const MAX_WINDOW: Duration = Duration::from_secs(10 * 366 * 24 * 3600);
/// The longest id (rule set, rule, band label, attribute name).
pub const MAX_ID_LEN: usize = 64;

// ---------------------------------------------------------------------------------------
// Specs: the serde shape of the file format.
// ---------------------------------------------------------------------------------------

/// A rule file: `{ rule_sets: [...] }`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesFileSpec {
    /// The rule sets of the file.
    pub rule_sets: Vec<RuleSetSpec>,
}

/// A rule set as written in a file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSetSpec {
    /// The rule set's id, unique in its source.
    pub id: String,
    /// Its rules.
    #[serde(default)]
    pub rules: Vec<RuleSpec>,
}

/// A rule as written in a file. See [`Rule`] for the meaning of each field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
}

/// The `match` block of a rule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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

/// The kind of scope, as named in files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeKind {
    /// One counter for everybody.
    Global,
    /// Per client IP.
    #[default]
    Ip,
    /// Per user id.
    User,
    /// Per API key.
    ApiKey,
    /// Per value of one attribute (`attribute: <name>`).
    Attribute,
    /// Per combination of fields (`fields: [...]`).
    Composite,
}

/// What a rule does when its scope's value is missing from the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMissingKey {
    /// Count the request per client IP instead.
    #[default]
    FallbackIp,
    /// The rule does not apply to the request.
    Skip,
    /// Reject the request.
    Deny,
}

/// The limiting algorithm of a rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Continuous refill at `capacity / window`, bursts up to `capacity`.
    #[default]
    TokenBucket,
    /// A queue of `capacity` that leaks at `capacity / window`.
    LeakyBucket,
    /// A counter per aligned window.
    FixedWindow,
    /// A timestamp per admitted request; exact.
    SlidingWindowLog,
    /// The weighted previous and current window.
    SlidingWindowCounter,
}

impl Algorithm {
    /// The name used in files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenBucket => "token_bucket",
            Self::LeakyBucket => "leaky_bucket",
            Self::FixedWindow => "fixed_window",
            Self::SlidingWindowLog => "sliding_window_log",
            Self::SlidingWindowCounter => "sliding_window_counter",
        }
    }

    /// Every algorithm, in the order of the selection guide.
    pub const ALL: [Algorithm; 5] = [
        Self::TokenBucket,
        Self::LeakyBucket,
        Self::FixedWindow,
        Self::SlidingWindowLog,
        Self::SlidingWindowCounter,
    ];

    /// The algorithm's default band (the original design's defaults): a token bucket of
    /// 10 refilled at 1 per second and a leaky bucket of 10 leaking 1 per second (both
    /// `capacity: 10, window: 10s`); 10 per 60 seconds for the three window algorithms.
    pub fn preset_band(self) -> BandSpec {
        match self {
            Self::TokenBucket | Self::LeakyBucket => BandSpec::new(10, Duration::from_secs(10)),
            Self::FixedWindow | Self::SlidingWindowLog | Self::SlidingWindowCounter => {
                BandSpec::new(10, Duration::from_secs(60))
            }
        }
    }
}

/// Whether a rule blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Rejections block the request.
    #[default]
    Enforce,
    /// Decide and report, never block.
    Shadow,
}

// ---------------------------------------------------------------------------------------
// The validated model.
// ---------------------------------------------------------------------------------------

/// A validated rule set. Its rules are ordered by priority, highest first (ties keep the
/// order of the file).
#[derive(Debug, Clone)]
pub struct RuleSet {
    id: Arc<str>,
    rules: Arc<[Rule]>,
}

/// A validated rule.
#[derive(Debug, Clone)]
pub struct Rule {
    id: Arc<str>,
    enabled: bool,
    paths: Vec<PathPattern>,
    methods: Vec<Method>,
    priority: i32,
    scope: Scope,
    on_missing_key: OnMissingKey,
    algorithm: Algorithm,
    permits: u64,
    bands: Arc<[Band]>,
    mode: Mode,
    on_backend_failure: Option<FailurePolicy>,
}

/// What a rule's limit is counted per.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scope {
    /// One counter for everybody.
    Global,
    /// Per client IP.
    Ip,
    /// Per user id.
    User,
    /// Per API key.
    ApiKey,
    /// Per value of the named attribute.
    Attribute(Arc<str>),
    /// Per combination of the fields.
    Composite(Vec<KeyField>),
}

/// One part of a composite key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyField {
    /// The client IP.
    Ip,
    /// The user id.
    User,
    /// The API key.
    ApiKey,
    /// The named attribute.
    Attribute(Arc<str>),
}

/// A validated band: `capacity` per `window`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Band {
    capacity: u64,
    window: Duration,
    label: Option<Arc<str>>,
    name: Arc<str>,
    ident: u64,
}

/// A stable digest of what identifies a band's counters: rule set, rule, band name,
/// algorithm, capacity and window. A changed algorithm, capacity or window starts new
/// counters.
fn band_ident(rule_set: &str, rule: &str, name: &str, algorithm: Algorithm, capacity: u64, window: Duration) -> u64 {
    use std::hash::{Hash, Hasher};
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    (rule_set, rule, name, algorithm, capacity, window).hash(&mut h);
    h.finish()
}

impl Band {
    /// A band of `capacity` per `window`.
    ///
    /// # Errors
    ///
    /// When capacity or window is zero or beyond [`MAX_CAPACITY`] / [`MAX_WINDOW`].
    pub fn new(capacity: u64, window: Duration) -> Result<Self, &'static str> {
        validate_band(capacity, window)?;
        Ok(Self {
            capacity,
            window,
            label: None,
            name: Arc::from(""),
            ident: band_ident("", "", "", Algorithm::TokenBucket, capacity, window),
        })
    }

    /// A stable digest of the rule set, rule, name, algorithm, capacity and window: limiters key a
    /// band's counters by it (with the key value).
    pub fn ident(&self) -> u64 {
        self.ident
    }

    /// The capacity: tokens, or requests per window.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The label, if one was given.
    pub fn label(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// The label, or `b<position>` for unlabeled bands: the band's name in keys.
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }
}

fn validate_band(capacity: u64, window: Duration) -> Result<(), &'static str> {
    if capacity == 0 {
        return Err("capacity is 0; capacity must be at least 1");
    }
    if capacity > MAX_CAPACITY {
        return Err("capacity is larger than 2^40");
    }
    if window.is_zero() {
        return Err("window is 0; a window must be at least 1ms");
    }
    if window < Duration::from_millis(1) {
        return Err("window is shorter than 1ms; a window must be at least 1ms");
    }
    if window > MAX_WINDOW {
        return Err("window is longer than ten years");
    }
    Ok(())
}

impl RuleSet {
    /// Validates a rule set spec.
    ///
    /// # Errors
    ///
    /// A [`RuleError::Invalid`] naming the rule set, the rule and the field.
    pub fn from_spec(spec: RuleSetSpec) -> Result<Self, RuleError> {
        check_id(&spec.id).map_err(|m| RuleError::invalid(&spec.id, "-", "id", m))?;
        let mut seen = HashSet::new();
        let mut rules = Vec::with_capacity(spec.rules.len());
        for (j, rule) in spec.rules.into_iter().enumerate() {
            if !seen.insert(rule.id.clone()) {
                return Err(
                    RuleError::invalid(&spec.id, &rule.id, "id", "duplicate rule id in this rule set")
                        .at_position(None, Some(j)),
                );
            }
            rules.push(Rule::from_spec(&spec.id, rule).map_err(|e| e.at_position(None, Some(j)))?);
        }
        // Stable: ties keep file order.
        rules.sort_by_key(|r| std::cmp::Reverse(r.priority));
        Ok(Self {
            id: Arc::from(spec.id),
            rules: rules.into(),
        })
    }

    /// A rule set from already validated rules.
    pub fn new(id: impl Into<Arc<str>>, rules: impl IntoIterator<Item = Rule>) -> Result<Self, RuleError> {
        let id = id.into();
        check_id(&id).map_err(|m| RuleError::invalid(&id, "-", "id", m))?;
        let mut rules: Vec<Rule> = rules.into_iter().collect();
        let mut seen = HashSet::new();
        for rule in &rules {
            if !seen.insert(rule.id.clone()) {
                return Err(RuleError::invalid(
                    &id,
                    &rule.id,
                    "id",
                    "duplicate rule id in this rule set",
                ));
            }
        }
        // Rules validated for another rule set get counters of this one.
        for rule in &mut rules {
            rule.bind_to(&id);
        }
        rules.sort_by_key(|r| std::cmp::Reverse(r.priority));
        Ok(Self {
            id,
            rules: rules.into(),
        })
    }

    /// The id.
    pub fn id(&self) -> &Arc<str> {
        &self.id
    }

    /// The rules, highest priority first.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }
}

impl Rule {
    /// Validates a rule spec; `rule_set` names the set in errors.
    ///
    /// # Errors
    ///
    /// A [`RuleError::Invalid`] naming the rule set, the rule and the field.
    pub fn from_spec(rule_set: &str, spec: RuleSpec) -> Result<Self, RuleError> {
        let rule_id = spec.id.as_str();
        let invalid = |field: &str, message: String| RuleError::invalid(rule_set, rule_id, field, message);
        check_id(rule_id).map_err(|m| invalid("id", m))?;

        let mut paths = Vec::with_capacity(spec.matcher.paths.len());
        for (i, p) in spec.matcher.paths.iter().enumerate() {
            let pattern = p
                .parse::<PathPattern>()
                .map_err(|e| invalid(&format!("match.paths[{i}]"), e.to_string()))?;
            paths.push(pattern);
        }
        let mut methods = Vec::with_capacity(spec.matcher.methods.len());
        for (i, m) in spec.matcher.methods.iter().enumerate() {
            let upper = m.to_ascii_uppercase();
            let method = Method::from_str(&upper)
                .ok()
                .filter(|_| !upper.is_empty())
                .ok_or_else(|| invalid(&format!("match.methods[{i}]"), format!("`{m}` is not an HTTP method")))?;
            methods.push(method);
        }

        let scope = match spec.scope {
            ScopeKind::Global => Scope::Global,
            ScopeKind::Ip => Scope::Ip,
            ScopeKind::User => Scope::User,
            ScopeKind::ApiKey => Scope::ApiKey,
            ScopeKind::Attribute => {
                let name = spec
                    .attribute
                    .as_deref()
                    .ok_or_else(|| invalid("attribute", "scope `attribute` needs `attribute: <name>`".into()))?;
                check_id(name).map_err(|m| invalid("attribute", m))?;
                Scope::Attribute(Arc::from(name))
            }
            ScopeKind::Composite => {
                if spec.fields.is_empty() {
                    return Err(invalid(
                        "fields",
                        "scope `composite` needs `fields: [...]` (ip, user, api_key or attribute names)".into(),
                    ));
                }
                let mut fields = Vec::with_capacity(spec.fields.len());
                for (i, f) in spec.fields.iter().enumerate() {
                    let field = match f.as_str() {
                        "ip" => KeyField::Ip,
                        "user" => KeyField::User,
                        "api_key" => KeyField::ApiKey,
                        name => {
                            check_id(name).map_err(|m| invalid(&format!("fields[{i}]"), m))?;
                            KeyField::Attribute(Arc::from(name))
                        }
                    };
                    if fields.contains(&field) {
                        return Err(invalid(&format!("fields[{i}]"), format!("`{f}` is listed twice")));
                    }
                    fields.push(field);
                }
                Scope::Composite(fields)
            }
        };
        if spec.attribute.is_some() && spec.scope != ScopeKind::Attribute {
            return Err(invalid(
                "attribute",
                "`attribute` is only allowed with `scope: attribute`".into(),
            ));
        }
        if !spec.fields.is_empty() && spec.scope != ScopeKind::Composite {
            return Err(invalid(
                "fields",
                "`fields` is only allowed with `scope: composite`".into(),
            ));
        }
        let mut bands_spec = std::borrow::Cow::Borrowed(&spec.bands);
        let mut algorithm = spec.algorithm;
        if let Some(preset) = spec.preset {
            if !spec.bands.is_empty() {
                return Err(invalid(
                    "preset",
                    "`preset` brings its own band; give either `preset` or `bands`".into(),
                ));
            }
            if spec.algorithm != Algorithm::default() && spec.algorithm != preset {
                return Err(invalid(
                    "preset",
                    format!(
                        "`preset: {}` contradicts `algorithm: {}`",
                        preset.as_str(),
                        spec.algorithm.as_str()
                    ),
                ));
            }
            algorithm = preset;
            bands_spec = std::borrow::Cow::Owned(vec![preset.preset_band()]);
        }
        if spec.permits == 0 {
            return Err(invalid("permits", "permits is 0; a request costs at least 1".into()));
        }
        if spec.permits > MAX_CAPACITY {
            return Err(invalid(
                "permits",
                format!(
                    "permits is {}; a request costs at most 2^40 ({MAX_CAPACITY}), the largest capacity",
                    spec.permits
                ),
            ));
        }
        if bands_spec.is_empty() {
            return Err(invalid(
                "bands",
                "a rule needs at least one band (or a `preset`)".into(),
            ));
        }
        let mut bands = Vec::with_capacity(bands_spec.len());
        let mut names = HashSet::new();
        for (i, b) in bands_spec.iter().enumerate() {
            let field = |f: &str| format!("bands[{i}].{f}");
            validate_band(b.capacity, b.window).map_err(|m| {
                let f = if m.starts_with("capacity") {
                    "capacity"
                } else {
                    "window"
                };
                invalid(&field(f), format!("band {}: {m}", i + 1))
            })?;
            if let Some(label) = &b.label {
                check_id(label).map_err(|m| invalid(&field("label"), m))?;
            }
            let name: Arc<str> = match &b.label {
                Some(l) => Arc::from(l.as_str()),
                None => Arc::from(format!("b{i}")),
            };
            if !names.insert(name.clone()) {
                return Err(invalid(&field("label"), format!("band name `{name}` is used twice")));
            }
            bands.push(Band {
                capacity: b.capacity,
                window: b.window,
                label: b.label.as_deref().map(Arc::from),
                ident: band_ident(rule_set, rule_id, &name, algorithm, b.capacity, b.window),
                name,
            });
        }

        Ok(Self {
            id: Arc::from(rule_id),
            enabled: spec.enabled,
            paths,
            methods,
            priority: spec.priority,
            scope,
            on_missing_key: spec.on_missing_key,
            algorithm,
            permits: spec.permits,
            bands: bands.into(),
            mode: spec.mode,
            on_backend_failure: spec.on_backend_failure,
        })
    }

    /// The id, unique in its rule set.
    pub fn id(&self) -> &Arc<str> {
        &self.id
    }

    /// Recomputes the bands' identities for the rule set `rule_set`.
    fn bind_to(&mut self, rule_set: &str) {
        let bands: Vec<Band> = self
            .bands
            .iter()
            .map(|b| Band {
                ident: band_ident(rule_set, &self.id, &b.name, self.algorithm, b.capacity, b.window),
                ..b.clone()
            })
            .collect();
        self.bands = bands.into();
    }

    /// Whether the rule takes part in decisions.
    pub fn enabled(&self) -> bool {
        self.enabled
    }
    /// The path patterns; empty means all paths.
    pub fn paths(&self) -> &[PathPattern] {
        &self.paths
    }
    /// The methods; empty means all methods.
    pub fn methods(&self) -> &[Method] {
        &self.methods
    }
    /// The priority: higher first.
    pub fn priority(&self) -> i32 {
        self.priority
    }
    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }
    /// What happens when the scope's value is missing.
    pub fn on_missing_key(&self) -> OnMissingKey {
        self.on_missing_key
    }
    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
    /// The cost of one request.
    pub fn permits(&self) -> u64 {
        self.permits
    }
    /// The bands; all must admit.
    pub fn bands(&self) -> &Arc<[Band]> {
        &self.bands
    }
    /// Enforce or shadow.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// What the rule does when the backend fails; `None` follows the engine.
    pub fn on_backend_failure(&self) -> Option<FailurePolicy> {
        self.on_backend_failure
    }

    /// Whether the rule applies to a request with this path (split in segments, see
    /// [`PathPattern::matches_segments`]) and method.
    pub fn applies_to(&self, path_segments: &[&str], method: &Method) -> bool {
        self.enabled && self.matches_method(method) && self.matches_path(path_segments)
    }

    /// Whether the rule applies to a request: enabled, its method matches, and its path,
    /// normalized or as routed, matches (see [`crate::path`]).
    ///
    /// ```
    /// use fluxgate_core::{RequestContext, RuleSets};
    /// let sets = RuleSets::from_yaml_str(r#"
    /// rule_sets:
    ///   - id: api
    ///     rules:
    ///       - id: login
    ///         match: { paths: ["/api/*/login"], methods: [GET] }
    ///         bands: [{ capacity: 5, window: 1m }]
    /// "#).unwrap();
    /// let rule = &sets.get("api").unwrap().rules()[0];
    /// let at = |method: &str, path: &str| {
    ///     RequestContext::builder().method(method.parse().unwrap()).path(path).build()
    /// };
    /// assert!(rule.applies(&at("GET", "/api/v1/login")));
    /// // HEAD runs GET handlers; `/api/../login` reaches a `/api/{version}/login` route.
    /// assert!(rule.applies(&at("HEAD", "/api/../login")));
    /// assert!(!rule.applies(&at("POST", "/api/v1/login")));
    /// ```
    pub fn applies(&self, ctx: &crate::RequestContext) -> bool {
        crate::path::with_paths(ctx, |normalized, routed| {
            self.applies_to_paths(normalized, routed, ctx.method())
        })
    }

    /// Whether the rule applies to a request with these segments of its normalized path
    /// and, when they differ, of its routed path.
    pub(crate) fn applies_to_paths(&self, normalized: &[&str], routed: Option<&[&str]>, method: &Method) -> bool {
        self.enabled
            && self.matches_method(method)
            && (self.matches_path(normalized) || routed.is_some_and(|r| self.matches_path(r)))
    }

    /// Whether the rule's methods include `method`. `HEAD` is matched as `GET` too,
    /// because routers (axum among them) run `GET` handlers for `HEAD` requests.
    pub fn matches_method(&self, method: &Method) -> bool {
        self.methods.is_empty()
            || self.methods.contains(method)
            || (*method == Method::HEAD && self.methods.contains(&Method::GET))
    }

    /// Whether one of the rule's patterns matches a path split in segments.
    pub fn matches_path(&self, path_segments: &[&str]) -> bool {
        self.paths.is_empty() || self.paths.iter().any(|p| p.matches_segments(path_segments))
    }
}

/// Ids, labels and attribute names: 1 to 64 of `A-Z a-z 0-9 _ - .`.
fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("must not be empty".into());
    }
    if id.len() > MAX_ID_LEN {
        return Err(format!("`{id}` is longer than {MAX_ID_LEN} characters"));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(format!(
            "`{id}` contains {c:?}; use only letters, digits, `_`, `-` and `.`"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Loading.
// ---------------------------------------------------------------------------------------

/// The rule formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// YAML (`.yaml`, `.yml`).
    Yaml,
    /// TOML (`.toml`).
    Toml,
    /// JSON (`.json`).
    Json,
}

impl Format {
    /// The format for a file name's extension.
    pub fn from_path(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "yaml" | "yml" => Some(Self::Yaml),
            "toml" => Some(Self::Toml),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Yaml => "YAML",
            Self::Toml => "TOML",
            Self::Json => "JSON",
        })
    }
}

/// Validated rule sets by id, as loaded from one source.
#[derive(Debug, Clone, Default)]
pub struct RuleSets {
    sets: HashMap<Arc<str>, Arc<RuleSet>>,
}

impl RuleSets {
    /// Validates rule set specs.
    ///
    /// # Errors
    ///
    /// The first invalid rule, or a duplicate rule set id.
    pub fn from_specs(specs: impl IntoIterator<Item = RuleSetSpec>) -> Result<Self, RuleError> {
        let mut sets = HashMap::new();
        for (i, spec) in specs.into_iter().enumerate() {
            let set = RuleSet::from_spec(spec).map_err(|e| e.at_position(Some(i), None))?;
            let id = set.id.clone();
            if sets.insert(id.clone(), Arc::new(set)).is_some() {
                return Err(RuleError::invalid(&id, "-", "id", "duplicate rule set id"));
            }
        }
        Ok(Self { sets })
    }

    /// Parses and validates rules in the given format.
    ///
    /// # Errors
    ///
    /// [`RuleError::Syntax`] for text that is not valid in the format, and
    /// [`RuleError::Invalid`] naming the rule set, the rule and the field otherwise.
    pub fn parse(text: &str, format: Format) -> Result<Self, RuleError> {
        let syntax = |message: String| RuleError::Syntax { format, message };
        let value: serde_json::Value = match format {
            Format::Yaml => serde_yaml::from_str(text).map_err(|e| syntax(yaml_error(&e)))?,
            Format::Toml => toml::from_str(text).map_err(|e| syntax(e.to_string()))?,
            Format::Json => serde_json::from_str(text).map_err(|e| syntax(e.to_string()))?,
        };
        Self::from_specs(specs_from_value(value)?)
    }

    /// Parses YAML rules.
    ///
    /// # Errors
    ///
    /// See [`RuleSets::parse`].
    pub fn from_yaml_str(text: &str) -> Result<Self, RuleError> {
        Self::parse(text, Format::Yaml)
    }

    /// Parses TOML rules.
    ///
    /// # Errors
    ///
    /// See [`RuleSets::parse`].
    pub fn from_toml_str(text: &str) -> Result<Self, RuleError> {
        Self::parse(text, Format::Toml)
    }

    /// Parses JSON rules.
    ///
    /// # Errors
    ///
    /// See [`RuleSets::parse`].
    pub fn from_json_str(text: &str) -> Result<Self, RuleError> {
        Self::parse(text, Format::Json)
    }

    /// Reads a rule file; the extension (`.yaml`, `.yml`, `.toml`, `.json`) picks the format.
    ///
    /// # Errors
    ///
    /// [`RuleError::File`] naming the file and what is wrong in it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, RuleError> {
        let path = path.as_ref();
        let wrap = |source: RuleError| RuleError::File {
            path: path.to_owned(),
            source: Box::new(source),
        };
        let format = Format::from_path(path).ok_or_else(|| wrap(RuleError::UnknownFormat))?;
        let text = std::fs::read_to_string(path).map_err(|e| wrap(RuleError::Io(e)))?;
        Self::parse(&text, format).map_err(wrap)
    }

    /// A rule set by id.
    pub fn get(&self, id: &str) -> Option<&Arc<RuleSet>> {
        // A handful of rule sets is the common case: comparing ids is cheaper than hashing.
        if self.sets.len() <= 8 {
            return self.sets.iter().find(|(k, _)| ***k == *id).map(|(_, v)| v);
        }
        self.sets.get(id)
    }

    /// Adds or replaces a rule set.
    pub fn insert(&mut self, set: RuleSet) {
        self.sets.insert(set.id.clone(), Arc::new(set));
    }

    /// The rule sets.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<RuleSet>> {
        self.sets.values()
    }

    /// The number of rule sets.
    pub fn len(&self) -> usize {
        self.sets.len()
    }

    /// Whether there are no rule sets.
    pub fn is_empty(&self) -> bool {
        self.sets.is_empty()
    }
}

impl FromIterator<RuleSet> for RuleSets {
    fn from_iter<I: IntoIterator<Item = RuleSet>>(iter: I) -> Self {
        let mut sets = Self::default();
        for set in iter {
            sets.insert(set);
        }
        sets
    }
}

/// serde_yaml's message, with the place it names: it leaves out `line 1 column 1`, and a
/// few errors have no position at all.
fn yaml_error(e: &serde_yaml::Error) -> String {
    let message = e.to_string();
    match e.location() {
        Some(at) if !message.contains(" at line ") => {
            format!("{message} at line {} column {}", at.line(), at.column())
        }
        Some(_) => message,
        None => format!("{message} (in the text as a whole)"),
    }
}

/// Deserializes the specs one rule at a time, so errors name the rule set, the rule and
/// the field whatever the format.
fn specs_from_value(value: serde_json::Value) -> Result<Vec<RuleSetSpec>, RuleError> {
    use serde_json::Value;
    let top = |m: &str| RuleError::invalid("-", "-", "rule_sets", m);
    let mut obj = match value {
        Value::Object(obj) => obj,
        Value::Null => return Err(top("the rules are empty; expected `rule_sets: [...]`")),
        _ => return Err(top("expected a map with `rule_sets: [...]` at the top level")),
    };
    if let Some(key) = obj.keys().find(|k| *k != "rule_sets") {
        return Err(RuleError::invalid("-", "-", key, "unknown field; expected `rule_sets`"));
    }
    let sets = match obj.remove("rule_sets") {
        Some(Value::Array(sets)) => sets,
        Some(_) => return Err(top("expected a list of rule sets")),
        None => return Err(top("missing `rule_sets`")),
    };
    let mut specs = Vec::with_capacity(sets.len());
    for (i, set) in sets.into_iter().enumerate() {
        let Value::Object(mut set) = set else {
            return Err(RuleError::invalid(
                &format!("#{}", i + 1),
                "-",
                "-",
                "expected a map with `id` and `rules`",
            ));
        };
        let set_name = match set.get("id") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            _ => format!("#{}", i + 1),
        };
        let rules = match set.remove("rules") {
            Some(Value::Array(rules)) => rules,
            Some(Value::Null) | None => Vec::new(),
            Some(_) => return Err(RuleError::invalid(&set_name, "-", "rules", "expected a list of rules")),
        };
        let mut spec: RuleSetSpec =
            deserialize_at(Value::Object(set)).map_err(|(field, m)| RuleError::invalid(&set_name, "-", &field, m))?;
        for (j, rule) in rules.into_iter().enumerate() {
            let rule_name = match rule.get("id") {
                Some(Value::String(id)) if !id.is_empty() => id.clone(),
                _ => format!("#{}", j + 1),
            };
            let rule: RuleSpec =
                deserialize_at(rule).map_err(|(field, m)| RuleError::invalid(&set_name, &rule_name, &field, m))?;
            spec.rules.push(rule);
        }
        specs.push(spec);
    }
    Ok(specs)
}

fn deserialize_at<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // A missing field is reported at its parent: name the field itself.
        let missing = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
            .map(str::to_owned);
        let field = match (path.as_str(), missing) {
            (".", Some(name)) => name,
            (".", None) => "-".to_owned(),
            (parent, Some(name)) => format!("{parent}.{name}"),
            (parent, None) => parent.to_owned(),
        };
        (field, message)
    })
}

/// Parses a duration written as `<integer><unit>`, unit one of `ms`, `s`, `m`, `h`, `d`.
///
/// ```
/// use std::time::Duration;
/// use fluxgate_core::rule::parse_duration;
/// assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
/// assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
/// assert!(parse_duration("1x").is_err());
/// ```
///
/// # Errors
///
/// A message saying what is wrong.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad =
        || format!("invalid duration `{s}`: expected a whole number followed by ms, s, m, h or d (e.g. `500ms`, `1m`)");
    let n: u64 = num.parse().map_err(|_| bad())?;
    let ms = match unit.trim() {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => return Err(bad()),
    };
    ms.map(Duration::from_millis).ok_or_else(bad)
}

/// Writes a duration in the shortest exact unit of the file format.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if ms != 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

mod duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        super::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}
