//! Errors.

use std::path::PathBuf;

use crate::rule::{Format, Problem};

/// Why rules could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// A rule, rule set or field is invalid.
    #[error("rule set `{rule_set}`, rule `{rule}`, field `{field}`: {message}")]
    Invalid {
        /// The rule set's id (or `#n` when it has none; `-` outside any rule set).
        rule_set: String,
        /// The rule's id (or `#n` when it has none; `-` outside any rule).
        rule: String,
        /// The field, as a path such as `bands[1].capacity`.
        field: String,
        /// What is wrong, and how to fix it; its `Display` is the message.
        message: Problem,
    },
    /// The text is not valid YAML, TOML or JSON.
    #[error("{format} syntax error: {message}")]
    Syntax {
        /// The format being read.
        format: Format,
        /// The parser's message, with the location.
        message: String,
    },
    /// The file's extension names no known format.
    #[error("unknown rule file format: use the extension .yaml, .yml, .toml or .json")]
    UnknownFormat,
    /// The file could not be read.
    #[error("cannot read: {0}")]
    Io(#[from] std::io::Error),
    /// A limiter backend cannot decide a rule exactly (a number beyond its exact range).
    #[error("rule set `{rule_set}`, rule `{rule}`, band `{band}`: the {backend} backend cannot decide it exactly: {message}")]
    Unsupported {
        /// The backend (`redis`, …).
        backend: &'static str,
        /// The rule set's id.
        rule_set: String,
        /// The rule's id.
        rule: String,
        /// The band's name (its label, or `b<position>`).
        band: String,
        /// What is out of range, the limit, and how to fix it.
        message: String,
    },
    /// A rate-limit service cannot decide the rules of a request (its answer `500` with
    /// its error): a configuration error at the service, reported by a client of it.
    #[error("the rate-limit service cannot decide the request's rules: {message}")]
    Service {
        /// The service's error.
        message: String,
    },
    /// An error in a rule file.
    #[error("rule file `{}`: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        #[source]
        source: Box<RuleError>,
    },
}

/// How an empty name (an `id: ""`, a key `""`) is shown where an error names its place.
const EMPTY: &str = "\"\"";

/// `text` as an error or a log line shows it (see [`Shown`]).
pub(crate) fn shown(text: &str) -> String {
    Shown(text).to_string()
}

pub(crate) use crate::text::Shown;

impl RuleError {
    /// A [`RuleError::Invalid`] at the field the problem is about.
    pub(crate) fn at(rule_set: &str, rule: &str, problem: impl Into<Problem>) -> Self {
        let problem = problem.into();
        Self::invalid(rule_set, rule, &problem.field(), problem)
    }

    /// A [`RuleError::Invalid`] at a field named by the caller (the deserializer's path).
    pub(crate) fn invalid(rule_set: &str, rule: &str, field: &str, message: impl Into<Problem>) -> Self {
        let name = |s: &str| if s.is_empty() { EMPTY.to_owned() } else { shown(s) };
        Self::Invalid {
            rule_set: name(rule_set),
            rule: name(rule),
            field: name(field),
            message: message.into(),
        }
    }

    /// Names a rule set or rule whose id is empty by its position (`#1` for the first).
    pub(crate) fn at_position(mut self, set: Option<usize>, rule: Option<usize>) -> Self {
        if let Self::Invalid { rule_set, rule: r, .. } = &mut self {
            if let (Some(i), true) = (set, rule_set == EMPTY) {
                *rule_set = format!("#{}", i + 1);
            }
            if let (Some(j), true) = (rule, r == EMPTY) {
                *r = format!("#{}", j + 1);
            }
        }
        self
    }
}

/// A boxed error from a backend or a rule source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a decision could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The rule provider failed.
    #[error("rule provider failed for rule set `{rule_set}`: {source}")]
    Provider {
        /// The rule set asked for.
        rule_set: String,
        /// The provider's error.
        #[source]
        source: BoxError,
    },
    /// The limiter backend failed.
    #[error("rate-limit backend failed: {0}")]
    Backend(#[source] BoxError),
    /// A rule of the request cannot be decided: a configuration error, found at request
    /// time because the rule set was never validated against the limiter (see
    /// [`RateLimiter::validate`](crate::RateLimiter::validate)). Never a backend failure:
    /// it opens no circuit and no failure policy admits the request.
    #[error("rate-limit rules cannot be decided: {0}")]
    Rule(#[source] RuleError),
    /// The request cannot be decided as it was described: a value beyond the bounds of a
    /// rate-limit service (its answer `400`) or of the engine (a path longer than
    /// [`LONGEST_MATCHED_PATH`](crate::path::LONGEST_MATCHED_PATH) for a rule set whose
    /// rules match paths, or a user id or API key that is
    /// [`AMBIGUOUS_IDENTITY`](crate::AMBIGUOUS_IDENTITY) for an enforced rule keyed by
    /// it). No backend failed: it opens no circuit, and no failure policy admits the
    /// request.
    #[error("the request cannot be rate-limited: {0}")]
    Refused(String),
    /// The request's rule set could not be looked up in time: the lookups its provider
    /// allows at once were all taken ([`LookupsBusy`](crate::LookupsBusy), from a
    /// [`CachingRuleSetProvider`](crate::CachingRuleSetProvider) under a flood of rule set
    /// ids that no entry holds, or in front of a slow source). Requests can cause it at
    /// will, so no failure policy admits the request: the layer answers it with its
    /// unavailable status (`503` by default), and a rate-limit service `503`.
    #[error("the request's rules cannot be looked up now: {0}")]
    Overloaded(String),
}

impl Error {
    /// A limiter's error: a [`RuleError`] is a configuration error, anything else a
    /// backend failure.
    pub(crate) fn from_limiter(error: BoxError) -> Self {
        match error.downcast::<RuleError>() {
            Ok(rule) => Self::Rule(*rule),
            Err(other) => Self::Backend(other),
        }
    }
}
