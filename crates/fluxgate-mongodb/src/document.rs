//! The document mapping: one BSON document per rule, as the Java FluxGate stored them in
//! its `rate_limit_rules` collection, to and from the rule model's specs.
//!
//! Pure: it uses only the [`bson`] crate and the core's rule model, so it can be used and
//! tested without a MongoDB server.
//!
//! # The document of a rule
//!
//! ```text
//! {
//!   "_id": ObjectId("..."),            // any value; named in errors, otherwise ignored
//!   "ruleSetId": "api",                // required: the rule set the rule belongs to
//!   "id": "per-ip",                    // required (a string `_id` stands in when it is absent)
//!   "name": "Per IP",                  // ignored (a label for people)
//!   "enabled": true,                   // default true
//!   "scope": "PER_IP",                 // GLOBAL, PER_IP, PER_USER, PER_API_KEY, CUSTOM, COMPOSITE; default PER_IP
//!   "keyStrategyId": "ip",             // with CUSTOM: the attribute to count per; otherwise ignored
//!   "onLimitExceedPolicy": "REJECT_REQUEST",
//!   "bands": [ { "windowSeconds": 1, "capacity": 10, "label": "burst" } ],
//!   "attributes": { "team": "billing" } // ignored (metadata for people and tools)
//! }
//! ```
//!
//! Fields of the rule model that the Java documents do not have are read when present:
//! `priority`, `paths` (or one `path`), `methods` (or one `method`), `compositeKeyFields`
//! (with `scope: COMPOSITE`), `algorithm`, `permits`, `onMissingKey`, `mode`,
//! `onBackendFailure`, `lease` (`{ "max": 100, "ttl": "1s" }`) and `onLimit`
//! (`{ "wait": { "maxWait": "500ms", "maxWaiters": 100 } }`). Other fields (`_class`, timestamps, …) are ignored,
//! except those that name a field above in another case or in the rule files' snake_case
//! (`Scope`, `on_missing_key`), near misses of one (`permit`, `scopes`, `onMissingKeys`: one
//! edit in a name of 5 to 7 letters, two in a longer one), and the rule files' `match`,
//! `fields` and `attribute`: they are refused ([`DocumentProblem::Misspelled`]), since the
//! rule would take the default.
//!
//! Numbers may be BSON int32, int64 or double; a double must be integral, except in
//! `windowSeconds`, where it gives a fraction of a second in whole milliseconds (`0.5` is
//! 500 ms; `1.0005` is refused, as every window with a fraction of a millisecond). A band's
//! window is one of `windowSeconds`, `windowMillis` (an integer) or `window` (a string of
//! the rule files, such as `"500ms"` or `"1m"`).
//!
//! [`rule_sets_from_documents`] reads a whole collection: it maps every document, groups
//! the rules by `ruleSetId` and validates each rule set as a rule file is validated. Every
//! error names the document (`_id`, `ruleSetId`, `id`) and the field, in the document's
//! own names (`bands[0].windowSeconds`).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use bson::{doc, Bson, Document};
use fluxgate_core::rule::{format_duration, parse_duration, Problem};
use fluxgate_core::{
    Algorithm, BandSpec, FailurePolicy, LeaseSpec, Mode, OnLimitSpec, OnMissingKey, Rule, RuleError, RuleSet,
    RuleSetSpec, RuleSets, RuleSpec, ScopeKind,
};

/// The collection the Java FluxGate kept its rules in, and the default of
/// [`MongoRuleSource`](crate::MongoRuleSource).
pub const DEFAULT_COLLECTION: &str = "rate_limit_rules";

/// The longest value (an `_id`, a name) shown in an error; a longer one is cut.
const MAX_SHOWN_ID: usize = 80;

/// Which document an error is about: its `_id`, `ruleSetId` and `id`, as far as they
/// could be read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DocumentRef {
    /// The `_id`, written as the MongoDB shell writes it (`ObjectId("…")`, `"text"`).
    pub object_id: Option<String>,
    /// The `ruleSetId`, when it is a string.
    pub rule_set_id: Option<String>,
    /// The rule's `id`, when it is a string.
    pub rule_id: Option<String>,
}

impl DocumentRef {
    /// The names of `document`, without checking anything else.
    pub fn of(document: &Document) -> Self {
        let text = |key: &str| match document.get(key) {
            Some(Bson::String(s)) => Some(echo(s)),
            _ => None,
        };
        let object_id = document.get("_id").map(|id| echo(&id.to_string()));
        Self {
            object_id,
            rule_set_id: text("ruleSetId"),
            rule_id: text("id").or_else(|| text("_id")),
        }
    }
}

impl fmt::Display for DocumentRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::with_capacity(3);
        if let Some(id) = &self.object_id {
            parts.push(format!("_id: {id}"));
        }
        if let Some(set) = &self.rule_set_id {
            parts.push(format!("ruleSetId: {set:?}"));
        }
        if let Some(rule) = &self.rule_id {
            parts.push(format!("id: {rule:?}"));
        }
        write!(f, "document {{{}}}", parts.join(", "))
    }
}

/// What is wrong with one field of a rule document.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DocumentProblem {
    /// A required field is absent (or `null`).
    #[error("is missing")]
    Missing,
    /// The field holds a value of another BSON type.
    #[error("expected {expected}, found {found}")]
    WrongType {
        /// What the field holds when it is right.
        expected: &'static str,
        /// The BSON type found, with the value when it is short.
        found: String,
    },
    /// A number that must be whole has a fraction, or is not finite.
    #[error("expected a whole number, found {}", show(*.value))]
    NotWhole {
        /// The number found.
        value: f64,
    },
    /// A number that must not be negative is.
    #[error("must not be negative, found {value}")]
    Negative {
        /// The number found.
        value: String,
    },
    /// A number beyond the field's range.
    #[error("{value} is out of range; {range}")]
    OutOfRange {
        /// The number found.
        value: String,
        /// The range of the field.
        range: &'static str,
    },
    /// A name the field does not know.
    #[error("unknown value {value:?}; expected one of {expected}")]
    UnknownValue {
        /// The name found.
        value: String,
        /// The names the field knows.
        expected: &'static str,
    },
    /// A name the field knows but FluxGate for Rust does not support.
    #[error("{value:?} is not supported: {reason}")]
    Unsupported {
        /// The name found.
        value: String,
        /// Why, and what to use instead.
        reason: &'static str,
    },
    /// Two fields that say the same thing are both given.
    #[error("`{other}` is given too; give only one of them")]
    Conflict {
        /// The other field.
        other: String,
    },
    /// Another field's value requires this one.
    #[error("is required by {by}")]
    RequiredBy {
        /// The field and value that require it.
        by: String,
    },
    /// A `window` string that is not a duration.
    #[error("{0}")]
    Duration(String),
    /// A field the mapping would ignore, though it names one the mapping reads: another
    /// case or the rule files' snake_case (`Scope`, `on_missing_key`), a near miss
    /// (`permit`, `scopes`, `onMissingKeys`), or a field of the rule files that documents
    /// name otherwise (`match`, `fields`, `attribute`). Refused rather than ignored: the rule
    /// would take the default instead.
    #[error("is not read; the field is `{known}` (document fields are camelCase, case-sensitive)")]
    Misspelled {
        /// The field the mapping reads.
        known: &'static str,
    },
}

/// A rule document that cannot be read as a rule: the document, the field (in the
/// document's names, such as `bands[1].capacity`) and the problem.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{document}: field `{field}`: {problem}")]
#[non_exhaustive]
pub struct DocumentError {
    /// The document.
    pub document: Box<DocumentRef>,
    /// The field, as a path such as `bands[1].windowSeconds`.
    pub field: String,
    /// What is wrong with it.
    pub problem: DocumentProblem,
}

/// Why rule documents do not make valid rule sets.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MappingError {
    /// A document cannot be read as a rule.
    #[error(transparent)]
    Document(#[from] DocumentError),
    /// A rule is read but is not valid: the core's validation error (naming the rule set,
    /// the rule and the field, in the document's names), with the document.
    #[error("{document}: {source}")]
    Invalid {
        /// The document of the rule.
        document: Box<DocumentRef>,
        /// The validation error.
        #[source]
        source: Box<RuleError>,
    },
    /// Two documents hold the same rule of the same rule set.
    #[error("{first} and {second}: rule `{rule}` of rule set `{rule_set}` is stored twice")]
    DuplicateRule {
        /// The rule set.
        rule_set: String,
        /// The rule.
        rule: String,
        /// One document.
        first: Box<DocumentRef>,
        /// The other.
        second: Box<DocumentRef>,
    },
}

/// Why a rule set cannot be written as documents.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The rule set is not valid; nothing is written.
    #[error(transparent)]
    Rule(#[from] RuleError),
    /// The rule set has no rule: with one document per rule, it would not exist.
    #[error("rule set `{rule_set}` has no rule; one document is stored per rule, so an empty rule set cannot be stored (delete it instead)")]
    NoRules {
        /// The rule set.
        rule_set: String,
    },
    /// A value of the rule model that this version cannot write.
    #[error("rule set `{rule_set}`, rule `{rule}`: {what} cannot be written as a document")]
    Unsupported {
        /// The rule set.
        rule_set: String,
        /// The rule.
        rule: String,
        /// What cannot be written.
        what: String,
    },
    /// A band's window is not a whole number of milliseconds.
    #[error("rule set `{rule_set}`, rule `{rule}`, band {}: the window {window:?} is not a whole number of milliseconds and cannot be stored exactly", .band + 1)]
    Window {
        /// The rule set.
        rule_set: String,
        /// The rule.
        rule: String,
        /// The band's position (0-based; the message counts from 1).
        band: usize,
        /// The window.
        window: Duration,
    },
}

/// One rule read from its document.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RuleDocument {
    /// The document's names.
    pub document: DocumentRef,
    /// The rule set the rule belongs to (`ruleSetId`).
    pub rule_set_id: String,
    /// The rule, not yet validated.
    pub rule: RuleSpec,
    /// The field each band's window was read from.
    window_fields: Vec<&'static str>,
    /// The fields the paths and methods were read from.
    path_field: &'static str,
    method_field: &'static str,
}

/// Reads one rule document.
///
/// # Errors
///
/// A [`DocumentError`] naming the document and the first field that cannot be read. The
/// rule itself is not validated: see [`rule_sets_from_documents`].
pub fn rule_from_document(document: &Document) -> Result<RuleDocument, DocumentError> {
    let at = DocumentRef::of(document);
    let fail = |field: &str, problem: DocumentProblem| DocumentError {
        document: Box::new(at.clone()),
        field: field.to_owned(),
        problem,
    };
    let get = |key: &str| match document.get(key) {
        None | Some(Bson::Null) => None,
        Some(value) => Some(value),
    };
    let string = |key: &str| -> Result<Option<&str>, DocumentError> {
        get(key).map(|v| as_str(v).map_err(|p| fail(key, p))).transpose()
    };

    misspelled(document, READ_FIELDS, FILE_FIELDS).map_err(|(field, p)| fail(&field, p))?;
    let rule_set_id = string("ruleSetId")?.ok_or_else(|| fail("ruleSetId", DocumentProblem::Missing))?;
    let id = match string("id")? {
        Some(id) => id,
        None => match get("_id") {
            Some(Bson::String(id)) => id.as_str(),
            _ => return Err(fail("id", DocumentProblem::Missing)),
        },
    };
    let mut rule = RuleSpec::new(id, Vec::new());
    if let Some(enabled) = get("enabled") {
        rule.enabled = match enabled {
            Bson::Boolean(b) => *b,
            other => return Err(fail("enabled", wrong("a boolean", other))),
        };
    }

    // The scope, with the attribute or the fields it needs.
    let (scope_field, scope) = match (string("scope")?, string("limitScope")?) {
        (Some(_), Some(_)) => {
            return Err(fail(
                "scope",
                DocumentProblem::Conflict {
                    other: "limitScope".into(),
                },
            ))
        }
        (Some(s), None) => ("scope", Some(s)),
        (None, Some(s)) => ("limitScope", Some(s)),
        (None, None) => ("scope", None),
    };
    let key_strategy = string("keyStrategyId")?;
    if let Some(name) = scope {
        rule.scope = scope_kind(name).map_err(|p| fail(scope_field, p))?;
    }
    if rule.scope == ScopeKind::Attribute {
        let attribute = key_strategy.ok_or_else(|| {
            fail(
                "keyStrategyId",
                DocumentProblem::RequiredBy {
                    by: format!("`{scope_field}: {}` (the attribute to count per)", scope.unwrap_or("")),
                },
            )
        })?;
        rule.attribute = Some(attribute.to_owned());
    }
    if let Some(fields) = get("compositeKeyFields") {
        rule.fields = strings(fields, "compositeKeyFields")
            .map_err(|(field, p)| fail(&field, p))?
            .into_iter()
            .map(|field| composite_field(&field))
            .collect();
    } else if rule.scope == ScopeKind::Composite {
        return Err(fail(
            "compositeKeyFields",
            DocumentProblem::RequiredBy {
                by: format!("`{scope_field}: COMPOSITE`"),
            },
        ));
    }

    if let Some(policy) = string("onLimitExceedPolicy")? {
        match policy.to_ascii_uppercase().as_str() {
            "REJECT_REQUEST" => {}
            "WAIT_FOR_REFILL" => {
                return Err(fail(
                    "onLimitExceedPolicy",
                    DocumentProblem::Unsupported {
                        value: echo(policy),
                        reason: "a rejected request is answered at once (with Retry-After), never held until tokens refill; use REJECT_REQUEST",
                    },
                ))
            }
            _ => {
                return Err(fail(
                    "onLimitExceedPolicy",
                    DocumentProblem::UnknownValue {
                        value: echo(policy),
                        expected: "REJECT_REQUEST",
                    },
                ))
            }
        }
    }

    // The match: `paths` or the older single `path`, `methods` or `method`.
    let (path_field, paths) = one_or_many(document, "paths", "path").map_err(|(field, p)| fail(&field, p))?;
    let (method_field, methods) = one_or_many(document, "methods", "method").map_err(|(field, p)| fail(&field, p))?;
    rule.matcher.paths = paths;
    rule.matcher.methods = methods;

    if let Some(priority) = get("priority") {
        let n = integer(priority).map_err(|p| fail("priority", p))?;
        rule.priority = i32::try_from(n).map_err(|_| {
            fail(
                "priority",
                DocumentProblem::OutOfRange {
                    value: n.to_string(),
                    range: "a priority is a 32-bit integer",
                },
            )
        })?;
    }
    if let Some(permits) = get("permits") {
        rule.permits = non_negative(permits).map_err(|p| fail("permits", p))?;
    }
    match get("lease") {
        None | Some(Bson::Null) => {}
        Some(Bson::Document(lease)) => {
            misspelled(lease, &["max", "ttl"], &[]).map_err(|(field, p)| fail(&format!("lease.{field}"), p))?;
            let max = lease
                .get("max")
                .ok_or_else(|| fail("lease.max", DocumentProblem::Missing))?;
            let max = non_negative(max).map_err(|p| fail("lease.max", p))?;
            let ttl = lease
                .get("ttl")
                .ok_or_else(|| fail("lease.ttl", DocumentProblem::Missing))?;
            let ttl = as_str(ttl)
                .and_then(|s| parse_duration(s).map_err(|e| DocumentProblem::Duration(e.to_string())))
                .map_err(|p| fail("lease.ttl", p))?;
            rule.lease = Some(LeaseSpec::new(max, ttl));
        }
        Some(other) => return Err(fail("lease", wrong("a document", other))),
    }
    match get("onLimit") {
        None | Some(Bson::Null) => {}
        Some(Bson::Document(on_limit)) => {
            misspelled(on_limit, &["wait"], &[]).map_err(|(field, p)| fail(&format!("onLimit.{field}"), p))?;
            let wait = match on_limit.get("wait") {
                Some(Bson::Document(wait)) => {
                    misspelled(wait, &["maxWait", "maxWaiters"], &[])
                        .map_err(|(field, p)| fail(&format!("onLimit.wait.{field}"), p))?;
                    wait
                }
                Some(other) => return Err(fail("onLimit.wait", wrong("a document", other))),
                None => return Err(fail("onLimit.wait", DocumentProblem::Missing)),
            };
            let max_wait = wait
                .get("maxWait")
                .ok_or_else(|| fail("onLimit.wait.maxWait", DocumentProblem::Missing))?;
            let max_wait = as_str(max_wait)
                .and_then(|s| parse_duration(s).map_err(|e| DocumentProblem::Duration(e.to_string())))
                .map_err(|p| fail("onLimit.wait.maxWait", p))?;
            let max_waiters = wait
                .get("maxWaiters")
                .ok_or_else(|| fail("onLimit.wait.maxWaiters", DocumentProblem::Missing))?;
            let max_waiters = non_negative(max_waiters).map_err(|p| fail("onLimit.wait.maxWaiters", p))?;
            let max_waiters = u32::try_from(max_waiters).map_err(|_| {
                fail(
                    "onLimit.wait.maxWaiters",
                    DocumentProblem::OutOfRange {
                        value: max_waiters.to_string(),
                        range: "at most 4294967295 waiters",
                    },
                )
            })?;
            rule.on_limit = Some(OnLimitSpec::wait(max_wait, max_waiters));
        }
        Some(other) => return Err(fail("onLimit", wrong("a document", other))),
    }
    if let Some(name) = string("algorithm")? {
        rule.algorithm = named(name, ALGORITHMS).map_err(|p| fail("algorithm", p))?;
    }
    if let Some(name) = string("onMissingKey")? {
        rule.on_missing_key = named::<OnMissingKey>(name, ON_MISSING_KEY).map_err(|p| fail("onMissingKey", p))?;
    }
    if let Some(name) = string("mode")? {
        rule.mode = named::<Mode>(name, MODES).map_err(|p| fail("mode", p))?;
    }
    if let Some(name) = string("onBackendFailure")? {
        rule.on_backend_failure =
            Some(named::<FailurePolicy>(name, FAILURE_POLICIES).map_err(|p| fail("onBackendFailure", p))?);
    }
    match get("attributes") {
        None | Some(Bson::Document(_)) => {}
        Some(other) => return Err(fail("attributes", wrong("a document", other))),
    }

    let bands = match get("bands") {
        Some(Bson::Array(bands)) => bands,
        Some(other) => return Err(fail("bands", wrong("an array of bands", other))),
        None => return Err(fail("bands", DocumentProblem::Missing)),
    };
    let mut window_fields = Vec::with_capacity(bands.len());
    for (index, band) in bands.iter().enumerate() {
        let Bson::Document(band) = band else {
            return Err(fail(&format!("bands[{index}]"), wrong("a band document", band)));
        };
        let (field, spec) =
            band_from_document(band).map_err(|(field, p)| fail(&format!("bands[{index}].{field}"), p))?;
        window_fields.push(field);
        rule.bands.push(spec);
    }

    Ok(RuleDocument {
        document: at,
        rule_set_id: rule_set_id.to_owned(),
        rule,
        window_fields,
        path_field,
        method_field,
    })
}

/// Reads every document, groups the rules by `ruleSetId` and validates each rule set.
///
/// Rule sets come out in id order, their rules in id order before the core orders them by
/// priority (so rules of equal priority are ordered by id, whatever order the documents
/// came in). Disabled rules are kept, disabled.
///
/// # Errors
///
/// The first document that cannot be read, in the order given; otherwise, the first
/// rule, in rule set and rule id order, that is stored twice or is not valid.
pub fn rule_sets_from_documents<'a>(
    documents: impl IntoIterator<Item = &'a Document>,
) -> Result<RuleSets, MappingError> {
    let grouped = group(documents)?;
    for (rule_set, rules) in &grouped {
        for rule in rules {
            Rule::from_spec(rule_set, rule.rule.clone()).map_err(|e| invalid(rule, e))?;
        }
    }
    let mut sets = RuleSets::default();
    for (rule_set, rules) in grouped {
        let first = rules[0].clone();
        let spec = RuleSetSpec::new(rule_set, rules.into_iter().map(|r| r.rule).collect());
        sets.insert(RuleSet::from_spec(spec).map_err(|e| invalid(&first, e))?);
    }
    Ok(sets)
}

/// Reads every document and groups the rules by `ruleSetId`, in id order, the rules of
/// each in id order, without validating them.
///
/// # Errors
///
/// As [`rule_sets_from_documents`], except that rules are not validated.
pub fn rule_set_specs_from_documents<'a>(
    documents: impl IntoIterator<Item = &'a Document>,
) -> Result<Vec<RuleSetSpec>, MappingError> {
    Ok(group(documents)?
        .into_iter()
        .map(|(id, rules)| RuleSetSpec::new(id, rules.into_iter().map(|r| r.rule).collect()))
        .collect())
}

/// The documents of a rule set, one per rule, in the shape the Java FluxGate wrote:
/// `ruleSetId`, `id`, `name` (the id), `enabled`, `scope`, `keyStrategyId`,
/// `onLimitExceedPolicy`, `bands` (`windowSeconds` and `capacity` as int64, `label`), and
/// the fields of the rule model that Java does not have only when they differ from their
/// defaults (`priority` always).
///
/// A window that is not a whole number of seconds is written as `windowMillis`. Bands
/// without a label are written without one, and `COMPOSITE` scopes with
/// `compositeKeyFields`: the Java reader needs a label and knows no `COMPOSITE`.
///
/// # Errors
///
/// [`WriteError::Rule`] when the rule set is not valid, [`WriteError::NoRules`] for a rule
/// set without rules, [`WriteError::Window`] for a window that is not a whole number of
/// milliseconds. Nothing is written then.
pub fn rule_set_to_documents(spec: &RuleSetSpec) -> Result<Vec<Document>, WriteError> {
    RuleSet::from_spec(spec.clone())?;
    if spec.rules.is_empty() {
        return Err(WriteError::NoRules {
            rule_set: spec.id.clone(),
        });
    }
    spec.rules.iter().map(|rule| rule_to_document(&spec.id, rule)).collect()
}

fn rule_to_document(rule_set: &str, rule: &RuleSpec) -> Result<Document, WriteError> {
    let (algorithm, bands) = match rule.preset {
        Some(preset) => (preset, vec![preset.preset_band()]),
        None => (rule.algorithm, rule.bands.clone()),
    };
    let (scope, key_strategy) = match rule.scope {
        ScopeKind::Global => ("GLOBAL", "global".to_owned()),
        ScopeKind::User => ("PER_USER", "userId".to_owned()),
        ScopeKind::ApiKey => ("PER_API_KEY", "apiKey".to_owned()),
        ScopeKind::Attribute => ("CUSTOM", rule.attribute.clone().unwrap_or_default()),
        ScopeKind::Composite => ("COMPOSITE", "composite".to_owned()),
        ScopeKind::Ip => ("PER_IP", "ip".to_owned()),
        other => return Err(unsupported(rule_set, rule, format!("the scope {other:?}"))),
    };
    let mut band_documents = Vec::with_capacity(bands.len());
    for (index, band) in bands.iter().enumerate() {
        let mut document = Document::new();
        let window = band.window;
        if window.subsec_nanos() == 0 {
            document.insert("windowSeconds", int64(window.as_secs()));
        } else if window.subsec_nanos() % 1_000_000 == 0 {
            document.insert("windowMillis", int64(window.as_millis().try_into().unwrap_or(u64::MAX)));
        } else {
            return Err(WriteError::Window {
                rule_set: rule_set.to_owned(),
                rule: rule.id.clone(),
                band: index,
                window,
            });
        }
        document.insert("capacity", int64(band.capacity));
        if let Some(label) = &band.label {
            document.insert("label", label.as_str());
        }
        band_documents.push(Bson::Document(document));
    }
    let mut document = doc! {
        "ruleSetId": rule_set,
        "id": rule.id.as_str(),
        "name": rule.id.as_str(),
        "enabled": rule.enabled,
        "scope": scope,
        "keyStrategyId": key_strategy,
        "onLimitExceedPolicy": "REJECT_REQUEST",
        "bands": band_documents,
        "priority": rule.priority,
    };
    if rule.scope == ScopeKind::Composite {
        let fields: Vec<Bson> = rule
            .fields
            .iter()
            .map(|f| {
                Bson::String(match f.as_str() {
                    "ip" => "IP".to_owned(),
                    "user" => "USER_ID".to_owned(),
                    "api_key" => "API_KEY".to_owned(),
                    attribute => attribute.to_owned(),
                })
            })
            .collect();
        document.insert("compositeKeyFields", fields);
    }
    if !rule.matcher.paths.is_empty() {
        document.insert("paths", rule.matcher.paths.clone());
    }
    if !rule.matcher.methods.is_empty() {
        document.insert("methods", rule.matcher.methods.clone());
    }
    if algorithm != Algorithm::default() {
        document.insert("algorithm", algorithm.as_str());
    }
    if rule.permits != 1 {
        document.insert("permits", int64(rule.permits));
    }
    if rule.on_missing_key != OnMissingKey::default() {
        document.insert("onMissingKey", serde_name(rule_set, rule, &rule.on_missing_key)?);
    }
    if rule.mode != Mode::default() {
        document.insert("mode", serde_name(rule_set, rule, &rule.mode)?);
    }
    if let Some(policy) = rule.on_backend_failure {
        document.insert("onBackendFailure", serde_name(rule_set, rule, &policy)?);
    }
    if let Some(on_limit) = rule.on_limit {
        let wait = on_limit.wait;
        document.insert(
            "onLimit",
            doc! { "wait": { "maxWait": format_duration(wait.max_wait), "maxWaiters": i64::from(wait.max_waiters) } },
        );
    }
    if let Some(lease) = rule.lease {
        document.insert(
            "lease",
            doc! { "max": int64(lease.max), "ttl": format_duration(lease.ttl) },
        );
    }
    Ok(document)
}

fn unsupported(rule_set: &str, rule: &RuleSpec, what: String) -> WriteError {
    WriteError::Unsupported {
        rule_set: rule_set.to_owned(),
        rule: rule.id.clone(),
        what,
    }
}

/// A count or a number of seconds as a BSON int64, as the Java driver writes a `long`.
/// Validated values are far below `i64::MAX`.
fn int64(n: u64) -> Bson {
    Bson::Int64(i64::try_from(n).unwrap_or(i64::MAX))
}

/// The name of a unit enum of the core as its serde form gives it (`fail_open`).
fn serde_name<T: serde::Serialize + fmt::Debug>(
    rule_set: &str,
    rule: &RuleSpec,
    value: &T,
) -> Result<String, WriteError> {
    match bson::to_bson(value) {
        Ok(Bson::String(name)) => Ok(name),
        _ => Err(unsupported(rule_set, rule, format!("{value:?}"))),
    }
}

fn group<'a>(
    documents: impl IntoIterator<Item = &'a Document>,
) -> Result<BTreeMap<String, Vec<RuleDocument>>, MappingError> {
    let mut grouped: BTreeMap<String, Vec<RuleDocument>> = BTreeMap::new();
    for document in documents {
        let rule = rule_from_document(document)?;
        grouped.entry(rule.rule_set_id.clone()).or_default().push(rule);
    }
    for (rule_set, rules) in &mut grouped {
        // Stable: two documents of one rule keep their order, for the error below.
        rules.sort_by(|a, b| a.rule.id.cmp(&b.rule.id));
        if let Some(pair) = rules.windows(2).find(|pair| pair[0].rule.id == pair[1].rule.id) {
            return Err(MappingError::DuplicateRule {
                rule_set: rule_set.clone(),
                rule: pair[0].rule.id.clone(),
                first: Box::new(pair[0].document.clone()),
                second: Box::new(pair[1].document.clone()),
            });
        }
    }
    Ok(grouped)
}

/// The core's validation error of `rule`, its field renamed to the document's name.
fn invalid(rule: &RuleDocument, error: RuleError) -> MappingError {
    let source = match error {
        RuleError::Invalid {
            rule_set,
            rule: rule_id,
            field,
            message,
        } => {
            let field = document_field(rule, &rule_id, &field, &message);
            RuleError::Invalid {
                rule_set,
                rule: rule_id,
                field,
                message,
            }
        }
        other => other,
    };
    MappingError::Invalid {
        document: Box::new(rule.document.clone()),
        source: Box::new(source),
    }
}

/// The name in the document of a field of the rule model (`match.paths[0]` is
/// `paths[0]`, a band's `window` the field it was read from).
fn document_field(rule: &RuleDocument, rule_id: &str, field: &str, message: &Problem) -> String {
    if rule_id == "-" && field == "id" {
        return "ruleSetId".to_owned();
    }
    if matches!(message, Problem::DuplicateRuleId) {
        return "id".to_owned();
    }
    if let Some(rest) = field.strip_prefix("match.paths") {
        return if rule.path_field == "path" {
            "path".to_owned()
        } else {
            format!("paths{rest}")
        };
    }
    if let Some(rest) = field.strip_prefix("match.methods") {
        return if rule.method_field == "method" {
            "method".to_owned()
        } else {
            format!("methods{rest}")
        };
    }
    if field == "attribute" {
        return "keyStrategyId".to_owned();
    }
    if let Some(rest) = field.strip_prefix("fields") {
        return format!("compositeKeyFields{rest}");
    }
    if field == "on_missing_key" {
        return "onMissingKey".to_owned();
    }
    if let Some(rest) = field.strip_prefix("bands[") {
        if let Some((index, tail)) = rest.split_once("].") {
            if tail == "window" {
                let name = index
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| rule.window_fields.get(i))
                    .copied()
                    .unwrap_or("windowSeconds");
                return format!("bands[{index}].{name}");
            }
        }
    }
    field.to_owned()
}

/// A band: its capacity, its window (from one of three fields) and its label; answers the
/// field the window was read from. Errors name the band's field.
fn band_from_document(band: &Document) -> Result<(&'static str, BandSpec), (String, DocumentProblem)> {
    let get = |key: &str| match band.get(key) {
        None | Some(Bson::Null) => None,
        Some(value) => Some(value),
    };
    misspelled(band, &BAND_FIELDS, &[])?;
    let capacity = get("capacity").ok_or_else(|| ("capacity".to_owned(), DocumentProblem::Missing))?;
    let capacity = non_negative(capacity).map_err(|p| ("capacity".to_owned(), p))?;

    let given: Vec<&'static str> = WINDOW_FIELDS.into_iter().filter(|k| get(k).is_some()).collect();
    let (field, window) = match given.as_slice() {
        [] => return Err(("windowSeconds".to_owned(), DocumentProblem::Missing)),
        [one] => (*one, get(one).unwrap_or(&Bson::Null)),
        [one, other, ..] => {
            return Err((
                (*one).to_owned(),
                DocumentProblem::Conflict {
                    other: (*other).to_owned(),
                },
            ))
        }
    };
    let window = match field {
        "windowSeconds" => seconds(window),
        "windowMillis" => non_negative(window).map(Duration::from_millis),
        _ => as_str(window).and_then(|s| parse_duration(s).map_err(|e| DocumentProblem::Duration(e.to_string()))),
    }
    .map_err(|p| (field.to_owned(), p))?;

    let label = match get("label") {
        None => None,
        Some(label) => Some(as_str(label).map_err(|p| ("label".to_owned(), p))?.to_owned()),
    };
    let mut spec = BandSpec::new(capacity, window);
    spec.label = label;
    Ok((field, spec))
}

/// The fields a band's window may be read from, in the order they are named in errors.
const WINDOW_FIELDS: [&str; 3] = ["windowSeconds", "windowMillis", "window"];

/// The fields of a band the mapping reads.
const BAND_FIELDS: [&str; 5] = ["capacity", "windowSeconds", "windowMillis", "window", "label"];

/// The fields of a rule document the mapping reads (`id` before `_id`: a misspelled `ID`
/// is taken for the rule's id), and the Java documents' `_class`.
const READ_FIELDS: &[&str] = &[
    "id",
    "_id",
    "_class",
    "ruleSetId",
    "name",
    "enabled",
    "scope",
    "limitScope",
    "keyStrategyId",
    "compositeKeyFields",
    "onLimitExceedPolicy",
    "bands",
    "attributes",
    "priority",
    "paths",
    "path",
    "methods",
    "method",
    "algorithm",
    "permits",
    "onMissingKey",
    "mode",
    "onBackendFailure",
    "lease",
    "onLimit",
];

/// Fields of the rule files that rule documents name otherwise.
const FILE_FIELDS: &[(&str, &str)] = &[
    ("match", "paths"),
    ("fields", "compositeKeyFields"),
    ("attribute", "keyStrategyId"),
];

/// Refuses a field of `document` that is not one of `known` but names one: the same
/// letters in another case or with `_` and `-` (`Scope`, `on_missing_key`), a near miss of
/// one ([`near_miss`]: `permit`, `scopes`, `scpoe`, `onMissingKeys`), or a field of the rule
/// files (`renamed`). Other fields are ignored (metadata, timestamps).
fn misspelled(
    document: &Document,
    known: &[&'static str],
    renamed: &[(&str, &'static str)],
) -> Result<(), (String, DocumentProblem)> {
    for key in document.keys() {
        if known.contains(&key.as_str()) {
            continue;
        }
        let squashed = squash(key);
        let near = known
            .iter()
            .find(|name| squash(name) == squashed)
            .copied()
            .or_else(|| renamed.iter().find(|(name, _)| name == key).map(|(_, known)| *known))
            .or_else(|| near_miss(&squashed, known));
        if let Some(known) = near {
            return Err((echo(key), DocumentProblem::Misspelled { known }));
        }
    }
    Ok(())
}

/// A field name without `_` and `-`, in lower case: `on_missing_key` and `OnMissingKey` are
/// both `onmissingkey`.
fn squash(name: &str) -> String {
    name.chars()
        .filter(|c| !matches!(c, '_' | '-'))
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// The known field that `squashed` (a [`squash`]ed name) misspells, if any: the nearest one
/// within one edit (a letter added, left out, replaced, or two neighbours swapped) of a
/// name of 5 to 7 letters, or two edits of a longer one. Names of 4 letters or fewer (`id`,
/// `name`, `mode`, `path`, `max`, `ttl`) take no edit: too many short words of metadata
/// (`code`, `note`, `node`) are that near to them.
fn near_miss(squashed: &str, known: &[&'static str]) -> Option<&'static str> {
    known
        .iter()
        .filter_map(|&name| {
            let target = squash(name);
            let allowed = match target.chars().count() {
                0..=4 => 0,
                5..=7 => 1,
                _ => 2,
            };
            let distance = edit_distance(squashed, &target);
            (distance > 0 && distance <= allowed).then_some((distance, name))
        })
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, name)| name)
}

/// The optimal string alignment distance between `a` and `b`: the fewest letters added,
/// left out or replaced, and neighbours swapped, that make one the other. Field names are
/// short; longer texts are not compared (`usize::MAX`).
fn edit_distance(a: &str, b: &str) -> usize {
    const LONGEST: usize = 64;
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    if a.len() > LONGEST || b.len() > LONGEST {
        return usize::MAX;
    }
    // rows[i][j]: the distance between the first i letters of a and the first j of b.
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = d;
        }
    }
    rows[a.len()][b.len()]
}

/// `windowSeconds`: whole seconds as an integer, or seconds with a fraction as a double,
/// rounded to the nanosecond.
fn seconds(value: &Bson) -> Result<Duration, DocumentProblem> {
    match value {
        Bson::Double(d) => {
            let d = *d;
            if !d.is_finite() {
                return Err(DocumentProblem::OutOfRange {
                    value: show(d),
                    range: "a window is a finite number of seconds",
                });
            }
            if d < 0.0 {
                return Err(DocumentProblem::Negative { value: show(d) });
            }
            if d >= 1e9 {
                // Decades past the longest window: the fraction does not matter, and the
                // validation reports the length. `as` saturates.
                return Ok(Duration::from_secs(d as u64));
            }
            // Below 1e18 nanoseconds: exact in u64.
            Ok(Duration::from_nanos((d * 1e9).round() as u64))
        }
        other => non_negative(other).map(Duration::from_secs),
    }
}

/// A whole number that is not negative.
fn non_negative(value: &Bson) -> Result<u64, DocumentProblem> {
    let n = integer(value)?;
    u64::try_from(n).map_err(|_| DocumentProblem::Negative { value: n.to_string() })
}

/// A whole number: an int32, an int64, or a double without a fraction.
fn integer(value: &Bson) -> Result<i64, DocumentProblem> {
    match value {
        Bson::Int32(n) => Ok(i64::from(*n)),
        Bson::Int64(n) => Ok(*n),
        Bson::Double(d) => {
            let d = *d;
            if !d.is_finite() || d.fract() != 0.0 {
                return Err(DocumentProblem::NotWhole { value: d });
            }
            // 2^63 is exactly representable; anything at or beyond it does not fit.
            if !(-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&d) {
                return Err(DocumentProblem::OutOfRange {
                    value: show(d),
                    range: "a number is at most 2^63 - 1",
                });
            }
            Ok(d as i64)
        }
        other => Err(wrong("a number (int32, int64 or double)", other)),
    }
}

fn as_str(value: &Bson) -> Result<&str, DocumentProblem> {
    match value {
        Bson::String(s) => Ok(s),
        other => Err(wrong("a string", other)),
    }
}

/// The strings of an array; errors name the element (`key[i]`).
fn strings(value: &Bson, key: &str) -> Result<Vec<String>, (String, DocumentProblem)> {
    let Bson::Array(items) = value else {
        return Err((key.to_owned(), wrong("an array of strings", value)));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| as_str(item).map(str::to_owned).map_err(|p| (format!("{key}[{i}]"), p)))
        .collect()
}

/// A list given as an array under `many`, or as one string under `one` (the older
/// documents' `path` and `method`); answers the field used.
fn one_or_many(
    document: &Document,
    many: &'static str,
    one: &'static str,
) -> Result<(&'static str, Vec<String>), (String, DocumentProblem)> {
    let get = |key: &str| match document.get(key) {
        None | Some(Bson::Null) => None,
        Some(value) => Some(value),
    };
    match (get(many), get(one)) {
        (Some(_), Some(_)) => Err((many.to_owned(), DocumentProblem::Conflict { other: one.to_owned() })),
        (Some(list), None) => Ok((many, strings(list, many)?)),
        (None, Some(single)) => {
            let single = as_str(single).map_err(|p| (one.to_owned(), p))?;
            Ok((one, vec![single.to_owned()]))
        }
        (None, None) => Ok((many, Vec::new())),
    }
}

/// A `scope` (or `limitScope`) of the Java documents.
fn scope_kind(name: &str) -> Result<ScopeKind, DocumentProblem> {
    Ok(match name.to_ascii_uppercase().as_str() {
        "GLOBAL" => ScopeKind::Global,
        "PER_IP" | "IP" => ScopeKind::Ip,
        "PER_USER" | "USER_ID" => ScopeKind::User,
        "PER_API_KEY" | "API_KEY" => ScopeKind::ApiKey,
        "CUSTOM" => ScopeKind::Attribute,
        "COMPOSITE" => ScopeKind::Composite,
        _ => {
            return Err(DocumentProblem::UnknownValue {
                value: echo(name),
                expected: "GLOBAL, PER_IP, PER_USER, PER_API_KEY, CUSTOM (with keyStrategyId), COMPOSITE (with compositeKeyFields)",
            })
        }
    })
}

/// A field of `compositeKeyFields`: the Java names of the request's fields, or an
/// attribute name as it is.
fn composite_field(name: &str) -> String {
    match name.to_ascii_uppercase().as_str() {
        "IP" => "ip".to_owned(),
        "USER_ID" => "user".to_owned(),
        "API_KEY" => "api_key".to_owned(),
        _ => name.to_owned(),
    }
}

const ALGORITHMS: &str = "token_bucket, leaky_bucket, fixed_window, sliding_window_log, sliding_window_counter";
const ON_MISSING_KEY: &str = "fallback_ip, skip, deny";
const MODES: &str = "enforce, shadow";
const FAILURE_POLICIES: &str = "fail_open, fail_closed, fallback_local";

/// A unit enum of the core by its name in the rule files, in any case (`SHADOW`).
fn named<T: serde::de::DeserializeOwned>(name: &str, expected: &'static str) -> Result<T, DocumentProblem> {
    bson::from_bson(Bson::String(name.to_ascii_lowercase())).map_err(|_| DocumentProblem::UnknownValue {
        value: echo(name),
        expected,
    })
}

/// A name found in a document as written in errors: cut after 80 characters.
fn echo(value: &str) -> String {
    match value.char_indices().nth(MAX_SHOWN_ID) {
        Some((cut, _)) => format!("{}…", &value[..cut]),
        None => value.to_owned(),
    }
}

/// A double as written in errors: with an exponent when it is large (`1e300`).
fn show(d: f64) -> String {
    if d.is_finite() && d.abs() >= 1e16 {
        format!("{d:e}")
    } else {
        d.to_string()
    }
}

/// A [`DocumentProblem::WrongType`] for `found`.
fn wrong(expected: &'static str, found: &Bson) -> DocumentProblem {
    let kind = match found {
        Bson::Double(_) => "double",
        Bson::String(_) => "string",
        Bson::Array(_) => "array",
        Bson::Document(_) => "document",
        Bson::Boolean(_) => "boolean",
        Bson::Null => "null",
        Bson::RegularExpression(_) => "regular expression",
        Bson::JavaScriptCode(_) | Bson::JavaScriptCodeWithScope(_) => "JavaScript code",
        Bson::Int32(_) => "int32",
        Bson::Int64(_) => "int64",
        Bson::Timestamp(_) => "timestamp",
        Bson::Binary(_) => "binary",
        Bson::ObjectId(_) => "ObjectId",
        Bson::DateTime(_) => "date",
        Bson::Symbol(_) => "symbol",
        Bson::Decimal128(_) => "decimal128",
        Bson::Undefined => "undefined",
        Bson::MaxKey => "MaxKey",
        Bson::MinKey => "MinKey",
        Bson::DbPointer(_) => "DBPointer",
    };
    let found = match found {
        Bson::Double(_) | Bson::String(_) | Bson::Boolean(_) | Bson::Int32(_) | Bson::Int64(_) => {
            let shown = found.to_string();
            if shown.len() <= 40 {
                format!("{kind} {shown}")
            } else {
                kind.to_owned()
            }
        }
        _ => kind.to_owned(),
    };
    DocumentProblem::WrongType { expected, found }
}
