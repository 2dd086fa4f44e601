//! Validation: from the specs of a file to the validated model.
//!
//! [`Rule::from_spec`] runs one step per concern (identifier, `match`, scope, preset,
//! permits, bands, lease), each returning its own typed error; the error is then placed in the
//! rule set and rule as a [`RuleError::Invalid`]. The checks run in that order, so the
//! first problem of a rule is the one reported.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::Method;

use super::model::{band_ident, interval_class, weight_shift};
use super::{
    Algorithm, Band, BandError, BandRangeError, BandSpec, IdError, KeyField, Lease, LeaseError, LeaseSpec, MatchError,
    MatchSpec, Problem, Rule, RuleSet, RuleSetSpec, RuleSets, RuleSpec, Scope, ScopeError, ScopeKind, WaitError,
    WaitPolicy, WaitSpec, MAX_CAPACITY, MAX_ID_LEN, MAX_WINDOW,
};
use crate::error::RuleError;
use crate::name::Name;
use crate::path::PathPattern;

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
                return Err(RuleError::at(&id, "-", Problem::DuplicateRuleSetId));
            }
        }
        Ok(Self { sets })
    }
}

impl RuleSet {
    /// Validates a rule set spec.
    ///
    /// # Errors
    ///
    /// A [`RuleError::Invalid`] naming the rule set, the rule and the field.
    pub fn from_spec(spec: RuleSetSpec) -> Result<Self, RuleError> {
        let id = Self::checked_id(&spec.id)?;
        Self::assemble(
            id.clone(),
            spec.rules,
            |rule| &rule.id,
            |rule| Rule::from_spec(&id, rule),
        )
    }

    /// A rule set from already validated rules.
    ///
    /// # Errors
    ///
    /// A [`RuleError::Invalid`] for an invalid id or a duplicate rule id.
    pub fn new(id: impl Into<Arc<str>>, rules: impl IntoIterator<Item = Rule>) -> Result<Self, RuleError> {
        let id = Self::checked_id(&id.into())?;
        Self::assemble(
            id.clone(),
            rules,
            |rule| &rule.id,
            |mut rule| {
                // Rules validated for another rule set get counters of this one.
                rule.bind_to(&id);
                Ok(rule)
            },
        )
    }

    /// A rule set's id, checked before it is interned (see [`Name`]), so that an invalid
    /// id is never kept.
    fn checked_id(id: &str) -> Result<Name, RuleError> {
        check_id(id).map_err(|e| RuleError::at(id, "-", e))?;
        Ok(Name::new(id))
    }

    /// The one place where a rule set is put together, from its id (checked by
    /// [`checked_id`](Self::checked_id)): checks each rule in order, its id unique before the
    /// rule itself (`into_rule`), and orders the rules by priority, highest first; ties
    /// keep their order. Errors name a rule with an empty id by its position.
    fn assemble<T>(
        id: Name,
        items: impl IntoIterator<Item = T>,
        rule_id: impl Fn(&T) -> &str,
        mut into_rule: impl FnMut(T) -> Result<Rule, RuleError>,
    ) -> Result<Self, RuleError> {
        let items = items.into_iter();
        let mut seen = HashSet::new();
        let mut rules = Vec::with_capacity(items.size_hint().0);
        for (j, item) in items.enumerate() {
            let at_position = |e: RuleError| e.at_position(None, Some(j));
            if !seen.insert(rule_id(&item).to_owned()) {
                return Err(at_position(RuleError::at(
                    &id,
                    rule_id(&item),
                    Problem::DuplicateRuleId,
                )));
            }
            rules.push(into_rule(item).map_err(at_position)?);
        }
        // Stable: ties keep their order.
        rules.sort_by_key(|r| std::cmp::Reverse(r.priority));
        Ok(Self {
            id,
            rules: rules.into(),
            generation: 0,
        })
    }
}

impl Rule {
    /// Validates a rule spec; `rule_set` names the set in errors.
    ///
    /// # Errors
    ///
    /// A [`RuleError::Invalid`] naming the rule set, the rule and the field.
    pub fn from_spec(rule_set: &str, spec: RuleSpec) -> Result<Self, RuleError> {
        Self::validate(rule_set, &spec).map_err(|problem| RuleError::at(rule_set, &spec.id, problem))
    }

    fn validate(rule_set: &str, spec: &RuleSpec) -> Result<Self, Problem> {
        check_id(&spec.id)?;
        let (paths, methods) = matcher(&spec.matcher)?;
        let scope = scope(spec)?;
        let (algorithm, band_specs) = preset(spec)?;
        let permits = permits(spec.permits)?;
        let bands = bands(rule_set, &spec.id, algorithm, &band_specs, permits)?;
        let lease = spec.lease.map(|l| lease(l, permits, &bands)).transpose()?;
        let wait = spec.on_limit.map(|o| wait(o.wait, lease.is_some())).transpose()?;
        Ok(Self {
            id: Name::new(&spec.id),
            enabled: spec.enabled,
            paths,
            methods,
            priority: spec.priority,
            scope,
            on_missing_key: spec.on_missing_key,
            algorithm,
            permits,
            bands: bands.into(),
            mode: spec.mode,
            on_backend_failure: spec.on_backend_failure,
            lease,
            wait,
        })
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
}

/// Checks an id, a band label or an attribute name: 1 to 64 of `A-Z a-z 0-9 _ - .`.
///
/// # Errors
///
/// An [`IdError`] saying what is wrong.
pub fn check_id(id: &str) -> Result<(), IdError> {
    if id.is_empty() {
        return Err(IdError::Empty);
    }
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            id: crate::error::shown(id),
        });
    }
    if let Some(character) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(IdError::InvalidCharacter {
            id: crate::error::shown(id),
            character,
        });
    }
    Ok(())
}

/// The longest method a rule names, in bytes (as the service's check API bounds it).
const MAX_METHOD: usize = 32;

/// The `match` block: the path patterns, then the methods.
fn matcher(spec: &MatchSpec) -> Result<(Vec<PathPattern>, Vec<Method>), MatchError> {
    let paths = spec
        .paths
        .iter()
        .enumerate()
        .map(|(index, p)| p.parse().map_err(|error| MatchError::Path { index, error }))
        .collect::<Result<_, _>>()?;
    let methods = spec
        .methods
        .iter()
        .enumerate()
        .map(|(index, m)| {
            let upper = m.to_ascii_uppercase();
            if matches!(upper.trim(), "*" | "ANY" | "ALL") {
                return Err(MatchError::Wildcard {
                    index,
                    method: m.clone(),
                });
            }
            // At most 32 characters, as the rate-limit service takes a request's method: a
            // rule's list is stored and loaded by every instance, and its error quotes it.
            Method::from_str(&upper)
                .ok()
                .filter(|_| !upper.is_empty() && upper.len() <= MAX_METHOD)
                .ok_or_else(|| MatchError::Method {
                    index,
                    method: crate::error::shown(m),
                })
        })
        .collect::<Result<_, _>>()?;
    Ok((paths, methods))
}

/// The scope, with the `attribute` or `fields` it needs and no other.
fn scope(spec: &RuleSpec) -> Result<Scope, ScopeError> {
    let scope = match spec.scope {
        ScopeKind::Global => Scope::Global,
        ScopeKind::Ip => Scope::Ip,
        ScopeKind::User => Scope::User,
        ScopeKind::ApiKey => Scope::ApiKey,
        ScopeKind::Attribute => {
            let name = spec.attribute.as_deref().ok_or(ScopeError::MissingAttribute)?;
            check_id(name).map_err(ScopeError::AttributeName)?;
            Scope::Attribute(Arc::from(name))
        }
        ScopeKind::Composite => Scope::Composite(key_fields(&spec.fields)?),
    };
    if spec.attribute.is_some() && spec.scope != ScopeKind::Attribute {
        return Err(ScopeError::UnexpectedAttribute);
    }
    if !spec.fields.is_empty() && spec.scope != ScopeKind::Composite {
        return Err(ScopeError::UnexpectedFields);
    }
    Ok(scope)
}

/// The fields of a composite scope: at least one, none twice.
fn key_fields(names: &[String]) -> Result<Vec<KeyField>, ScopeError> {
    if names.is_empty() {
        return Err(ScopeError::MissingFields);
    }
    let mut fields = Vec::with_capacity(names.len());
    for (index, name) in names.iter().enumerate() {
        let field = match name.as_str() {
            "ip" => KeyField::Ip,
            "user" => KeyField::User,
            "api_key" => KeyField::ApiKey,
            attribute => {
                check_id(attribute).map_err(|error| ScopeError::FieldName { index, error })?;
                KeyField::Attribute(Arc::from(attribute))
            }
        };
        if fields.contains(&field) {
            return Err(ScopeError::RepeatedField {
                index,
                name: name.clone(),
            });
        }
        fields.push(field);
    }
    Ok(fields)
}

/// The algorithm and the bands to validate: a `preset` brings both, in place of
/// `algorithm` (unless it is the default or the same) and `bands`.
fn preset(spec: &RuleSpec) -> Result<(Algorithm, Cow<'_, [BandSpec]>), BandError> {
    let Some(preset) = spec.preset else {
        return Ok((spec.algorithm, Cow::Borrowed(&spec.bands)));
    };
    if !spec.bands.is_empty() {
        return Err(BandError::PresetWithBands);
    }
    if spec.algorithm != Algorithm::default() && spec.algorithm != preset {
        return Err(BandError::PresetContradictsAlgorithm {
            preset,
            algorithm: spec.algorithm,
        });
    }
    Ok((preset, Cow::Owned(vec![preset.preset_band()])))
}

/// The cost of one request: 1 to [`MAX_CAPACITY`].
fn permits(permits: u64) -> Result<u64, Problem> {
    match permits {
        0 => Err(Problem::PermitsZero),
        p if p > MAX_CAPACITY => Err(Problem::PermitsTooLarge { permits }),
        p => Ok(p),
    }
}

/// A rule's lease: `max` from the rule's cost to its smallest capacity, `ttl` 1ms to 1h.
fn lease(spec: LeaseSpec, permits: u64, bands: &[Band]) -> Result<Lease, LeaseError> {
    let LeaseSpec { max, ttl } = spec;
    if max < permits {
        return Err(LeaseError::BelowPermits { max, permits });
    }
    let capacity = bands.iter().map(Band::capacity).min().unwrap_or(u64::MAX);
    if max > capacity {
        return Err(LeaseError::AboveCapacity { max, capacity });
    }
    if ttl < Duration::from_millis(1) || ttl > Duration::from_secs(3600) {
        return Err(LeaseError::Ttl { ttl });
    }
    Ok(Lease { max, ttl })
}

/// A rule's `on_limit.wait`: `max_wait` 1ms to 1h, at least one waiter, no lease.
pub(super) fn wait(spec: WaitSpec, leased: bool) -> Result<WaitPolicy, WaitError> {
    let WaitSpec { max_wait, max_waiters } = spec;
    if max_wait < Duration::from_millis(1) || max_wait > Duration::from_secs(3600) {
        return Err(WaitError::MaxWait { max_wait });
    }
    if max_waiters == 0 {
        return Err(WaitError::NoWaiter);
    }
    if leased {
        return Err(WaitError::WithLease);
    }
    Ok(WaitPolicy { max_wait, max_waiters })
}

/// The bands, each with the identity of its counters: at least one, each in range, their
/// names (labels, or `b<position>`) unique, for a rule whose requests cost `permits` each.
fn bands(
    rule_set: &str,
    rule: &str,
    algorithm: Algorithm,
    specs: &[BandSpec],
    permits: u64,
) -> Result<Vec<Band>, BandError> {
    if specs.is_empty() {
        return Err(BandError::NoBand);
    }
    let mut names = HashSet::new();
    let mut bands = Vec::with_capacity(specs.len());
    for (index, b) in specs.iter().enumerate() {
        validate_band(b.capacity, b.window).map_err(|error| BandError::OutOfRange { index, error })?;
        if let Some(label) = &b.label {
            check_id(label).map_err(|error| BandError::Label { index, error })?;
        }
        let name = match &b.label {
            Some(l) => Name::new(l),
            None => Name::new(&format!("b{index}")),
        };
        if !names.insert(name.clone()) {
            return Err(BandError::RepeatedName {
                index,
                name: name.to_string(),
            });
        }
        bands.push(Band {
            capacity: b.capacity,
            window: b.window,
            label: b.label.as_deref().map(Arc::from),
            ident: band_ident(rule_set, rule, &name, algorithm, b.capacity, b.window),
            interval_class: interval_class(b.capacity, b.window, permits),
            weight_shift: weight_shift(permits),
            name,
        });
    }
    Ok(bands)
}

/// A band's capacity (1 to [`MAX_CAPACITY`]) and window (whole milliseconds, 1ms to
/// [`MAX_WINDOW`]).
pub(super) fn validate_band(capacity: u64, window: Duration) -> Result<(), BandRangeError> {
    if capacity == 0 {
        return Err(BandRangeError::CapacityZero);
    }
    if capacity > MAX_CAPACITY {
        return Err(BandRangeError::CapacityTooLarge);
    }
    if window.is_zero() {
        return Err(BandRangeError::WindowZero);
    }
    if window < Duration::from_millis(1) {
        return Err(BandRangeError::WindowTooShort);
    }
    if window > MAX_WINDOW {
        return Err(BandRangeError::WindowTooLong);
    }
    if window.subsec_nanos() % 1_000_000 != 0 {
        // Written back as whole milliseconds (`format_duration`), such a window would name
        // the same band as another window, in a backend's keys and in the rules stored.
        return Err(BandRangeError::WindowFraction);
    }
    Ok(())
}
