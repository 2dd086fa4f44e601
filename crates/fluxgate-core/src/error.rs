//! Errors.

use std::path::PathBuf;

use crate::rule::Format;

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
        /// What is wrong, and how to fix it.
        message: String,
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

impl RuleError {
    pub(crate) fn invalid(rule_set: &str, rule: &str, field: &str, message: impl Into<String>) -> Self {
        Self::Invalid {
            rule_set: rule_set.to_owned(),
            rule: rule.to_owned(),
            field: field.to_owned(),
            message: message.into(),
        }
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
}
