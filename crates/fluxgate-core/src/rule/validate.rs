//! Validation: from the specs of a file to the validated model.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::Method;

use super::model::band_ident;
use super::{
    Algorithm, Band, KeyField, Rule, RuleSet, RuleSetSpec, RuleSets, RuleSpec, Scope, ScopeKind, MAX_CAPACITY,
    MAX_ID_LEN, MAX_WINDOW,
};
use crate::error::RuleError;
use crate::path::PathPattern;

pub(super) fn validate_band(capacity: u64, window: Duration) -> Result<(), &'static str> {
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
        let id: Arc<str> = Arc::from(spec.id);
        Self::assemble(
            id.clone(),
            spec.rules,
            |rule| &rule.id,
            |rule| Rule::from_spec(&id, rule),
        )
    }

    /// A rule set from already validated rules.
    pub fn new(id: impl Into<Arc<str>>, rules: impl IntoIterator<Item = Rule>) -> Result<Self, RuleError> {
        let id = id.into();
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

    /// The one place where a rule set is put together: checks its id, then each rule in
    /// order, its id unique before the rule itself (`into_rule`), and orders the rules by
    /// priority, highest first; ties keep their order. Errors name a rule with an empty id
    /// by its position.
    fn assemble<T>(
        id: Arc<str>,
        items: impl IntoIterator<Item = T>,
        rule_id: impl Fn(&T) -> &str,
        mut into_rule: impl FnMut(T) -> Result<Rule, RuleError>,
    ) -> Result<Self, RuleError> {
        check_id(&id).map_err(|m| RuleError::invalid(&id, "-", "id", m))?;
        let items = items.into_iter();
        let mut seen = HashSet::new();
        let mut rules = Vec::with_capacity(items.size_hint().0);
        for (j, item) in items.enumerate() {
            let at_position = |e: RuleError| e.at_position(None, Some(j));
            if !seen.insert(rule_id(&item).to_owned()) {
                let duplicate = RuleError::invalid(&id, rule_id(&item), "id", "duplicate rule id in this rule set");
                return Err(at_position(duplicate));
            }
            rules.push(into_rule(item).map_err(at_position)?);
        }
        // Stable: ties keep their order.
        rules.sort_by_key(|r| std::cmp::Reverse(r.priority));
        Ok(Self {
            id,
            rules: rules.into(),
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rule::BandSpec;

    fn rule(id: &str, priority: i32) -> Rule {
        let mut spec = RuleSpec::new(id, vec![BandSpec::new(1, Duration::from_secs(1))]);
        spec.priority = priority;
        Rule::from_spec("elsewhere", spec).unwrap()
    }

    #[test]
    fn both_constructors_order_by_priority_and_reject_duplicate_ids() {
        let order = |set: &RuleSet| set.rules().iter().map(|r| r.id().to_string()).collect::<Vec<_>>();
        let set = RuleSet::new("s", [rule("a", 0), rule("b", 5), rule("c", 0)]).unwrap();
        assert_eq!(order(&set), ["b", "a", "c"]);
        let spec = RuleSetSpec {
            id: "s".into(),
            rules: [("a", 0), ("b", 5), ("c", 0)]
                .map(|(id, priority)| RuleSpec {
                    priority,
                    ..RuleSpec::new(id, vec![BandSpec::new(1, Duration::from_secs(1))])
                })
                .into(),
        };
        assert_eq!(order(&RuleSet::from_spec(spec).unwrap()), ["b", "a", "c"]);

        let msg = RuleSet::new("s", [rule("a", 0), rule("a", 1)]).unwrap_err().to_string();
        assert_eq!(
            msg,
            "rule set `s`, rule `a`, field `id`: duplicate rule id in this rule set"
        );
    }

    #[test]
    fn a_duplicate_id_is_reported_before_the_rule_is_validated() {
        let valid = RuleSpec::new("a", vec![BandSpec::new(1, Duration::from_secs(1))]);
        let invalid = RuleSpec::new("a", vec![BandSpec::new(0, Duration::from_secs(1))]);
        let spec = RuleSetSpec {
            id: "s".into(),
            rules: vec![valid, invalid],
        };
        let msg = RuleSet::from_spec(spec).unwrap_err().to_string();
        assert!(msg.contains("duplicate rule id"), "{msg}");
    }

    #[test]
    fn rules_from_another_rule_set_get_counters_of_this_one() {
        let set = RuleSet::new("s", [rule("a", 0)]).unwrap();
        let spec = RuleSetSpec {
            id: "s".into(),
            rules: vec![RuleSpec::new("a", vec![BandSpec::new(1, Duration::from_secs(1))])],
        };
        let same = RuleSet::from_spec(spec).unwrap();
        assert_eq!(set.rules()[0].bands()[0].ident(), same.rules()[0].bands()[0].ident());
        assert_ne!(rule("a", 0).bands()[0].ident(), same.rules()[0].bands()[0].ident());
    }
}
