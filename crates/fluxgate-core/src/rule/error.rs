//! What is wrong with a rule: the typed reasons carried by
//! [`RuleError::Invalid`](crate::RuleError::Invalid), one enum per concern.
//!
//! Each reason knows the field it is about (`bands[1].capacity`); the rule set and the
//! rule are named by the [`RuleError`](crate::RuleError) that carries it.

use std::borrow::Cow;

use super::{Algorithm, MAX_CAPACITY, MAX_ID_LEN};
use crate::path::PatternError;

/// What is wrong at one place of a rule file or rule spec: the `message` of
/// [`RuleError::Invalid`](crate::RuleError::Invalid), which names the place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// The rule set's or the rule's `id` is not an identifier.
    #[error(transparent)]
    Id(#[from] IdError),
    /// The rule's `match` block.
    #[error(transparent)]
    Match(#[from] MatchError),
    /// The rule's `scope`, `attribute` or `fields`.
    #[error(transparent)]
    Scope(#[from] ScopeError),
    /// The rule's `bands`, or its `preset`.
    #[error(transparent)]
    Band(#[from] BandError),
    /// The rule's `lease` block.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// The rule's `on_limit` block.
    #[error(transparent)]
    Wait(#[from] WaitError),
    /// `permits` is 0.
    #[error("permits is 0; a request costs at least 1")]
    PermitsZero,
    /// `permits` is above [`MAX_CAPACITY`].
    #[error(
        "permits is {permits}; a request costs at most 2^40 ({}), the largest capacity",
        MAX_CAPACITY
    )]
    PermitsTooLarge {
        /// The permits given.
        permits: u64,
    },
    /// Two rules of a rule set have the same id.
    #[error("duplicate rule id in this rule set")]
    DuplicateRuleId,
    /// Two rule sets of a source have the same id.
    #[error("duplicate rule set id")]
    DuplicateRuleSetId,
    /// The text does not have the shape of a rule file.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A problem known by its text only: what the deserializer says of a value (an
    /// unknown or missing field, a value of the wrong type, an unknown variant, an invalid
    /// duration). The place is the deserializer's.
    #[error("{0}")]
    Message(String),
}

impl Problem {
    /// The field the problem is about, as a path such as `bands[1].capacity`; `-` for a
    /// [`Problem::Message`], whose field only the deserializer knows.
    pub(crate) fn field(&self) -> Cow<'static, str> {
        match self {
            Self::Id(_) | Self::DuplicateRuleId | Self::DuplicateRuleSetId => "id".into(),
            Self::Match(e) => e.field(),
            Self::Scope(e) => e.field(),
            Self::Band(e) => e.field(),
            Self::Lease(e) => e.field(),
            Self::Wait(e) => e.field(),
            Self::PermitsZero | Self::PermitsTooLarge { .. } => "permits".into(),
            Self::Shape(e) => e.field(),
            Self::Message(_) => "-".into(),
        }
    }
}

impl From<String> for Problem {
    fn from(message: String) -> Self {
        Self::Message(message)
    }
}

impl From<&str> for Problem {
    fn from(message: &str) -> Self {
        Self::Message(message.to_owned())
    }
}

/// Why an identifier is rejected: rule set and rule ids, band labels and attribute names
/// are 1 to [`MAX_ID_LEN`] characters, each one of `A-Z a-z 0-9 _ - .`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The identifier is empty.
    #[error("must not be empty")]
    Empty,
    /// The identifier is longer than [`MAX_ID_LEN`].
    #[error("`{id}` is longer than {} characters", MAX_ID_LEN)]
    TooLong {
        /// The identifier, its first 64 characters.
        id: String,
    },
    /// The identifier contains a character outside `A-Z a-z 0-9 _ - .`.
    #[error("`{id}` contains {character:?}; use only letters, digits, `_`, `-` and `.`")]
    InvalidCharacter {
        /// The identifier.
        id: String,
        /// The first character not allowed.
        character: char,
    },
}

/// Why a rule's `match` block is rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MatchError {
    /// A path pattern is invalid.
    #[error("{error}")]
    Path {
        /// Its position in `match.paths`.
        index: usize,
        /// What is wrong with it.
        error: PatternError,
    },
    /// A method is not an HTTP method token of at most 32 characters.
    #[error("`{method}` is not an HTTP method (a token of 1 to 32 characters)")]
    Method {
        /// Its position in `match.methods`.
        index: usize,
        /// The method as given, cut to 64 characters and its control characters escaped.
        method: String,
    },
    /// A method meant as every method (`*`, `ANY`, `ALL`): as a token it would match none,
    /// and the rule would apply to no request.
    #[error("`{method}` names no method (the rule would apply to none): leave `methods` out to match every method")]
    Wildcard {
        /// Its position in `match.methods`.
        index: usize,
        /// The method as given.
        method: String,
    },
}

impl MatchError {
    fn field(&self) -> Cow<'static, str> {
        match self {
            Self::Path { index, .. } => format!("match.paths[{index}]").into(),
            Self::Method { index, .. } | Self::Wildcard { index, .. } => format!("match.methods[{index}]").into(),
        }
    }
}

/// Why a rule's `scope`, with its `attribute` or `fields`, is rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScopeError {
    /// `scope: attribute` without `attribute`.
    #[error("scope `attribute` needs `attribute: <name>`")]
    MissingAttribute,
    /// The `attribute` name is not an identifier.
    #[error(transparent)]
    AttributeName(IdError),
    /// `scope: composite` without `fields`.
    #[error("scope `composite` needs `fields: [...]` (ip, user, api_key or attribute names)")]
    MissingFields,
    /// An attribute name in `fields` is not an identifier.
    #[error("{error}")]
    FieldName {
        /// Its position in `fields`.
        index: usize,
        /// What is wrong with it.
        error: IdError,
    },
    /// A field is listed twice in `fields`.
    #[error("`{name}` is listed twice")]
    RepeatedField {
        /// The position of the second one in `fields`.
        index: usize,
        /// The field.
        name: String,
    },
    /// `attribute` with a scope other than `attribute`.
    #[error("`attribute` is only allowed with `scope: attribute`")]
    UnexpectedAttribute,
    /// `fields` with a scope other than `composite`.
    #[error("`fields` is only allowed with `scope: composite`")]
    UnexpectedFields,
}

impl ScopeError {
    fn field(&self) -> Cow<'static, str> {
        match self {
            Self::MissingAttribute | Self::AttributeName(_) | Self::UnexpectedAttribute => "attribute".into(),
            Self::MissingFields | Self::UnexpectedFields => "fields".into(),
            Self::FieldName { index, .. } | Self::RepeatedField { index, .. } => format!("fields[{index}]").into(),
        }
    }
}

/// Why a rule's `bands`, or the `preset` that stands in for them, are rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BandError {
    /// Both `preset` and `bands`.
    #[error("`preset` brings its own band; give either `preset` or `bands`")]
    PresetWithBands,
    /// A `preset` and a different `algorithm` (other than the default).
    #[error("`preset: {}` contradicts `algorithm: {}`", .preset.as_str(), .algorithm.as_str())]
    PresetContradictsAlgorithm {
        /// The preset.
        preset: Algorithm,
        /// The algorithm.
        algorithm: Algorithm,
    },
    /// Neither `bands` nor `preset`.
    #[error("a rule needs at least one band (or a `preset`)")]
    NoBand,
    /// A band's capacity or window is out of range.
    #[error("band {}: {error}", .index + 1)]
    OutOfRange {
        /// The band's position in `bands` (0-based; the message counts from 1).
        index: usize,
        /// What is out of range.
        error: BandRangeError,
    },
    /// A band's label is not an identifier.
    #[error("{error}")]
    Label {
        /// The band's position in `bands`.
        index: usize,
        /// What is wrong with the label.
        error: IdError,
    },
    /// Two bands of the rule have the same name (label, or `b<position>`).
    #[error("band name `{name}` is used twice")]
    RepeatedName {
        /// The position of the second one in `bands`.
        index: usize,
        /// The name.
        name: String,
    },
}

impl BandError {
    fn field(&self) -> Cow<'static, str> {
        match self {
            Self::PresetWithBands | Self::PresetContradictsAlgorithm { .. } => "preset".into(),
            Self::NoBand => "bands".into(),
            Self::OutOfRange { index, error } => format!("bands[{index}].{}", error.field()).into(),
            Self::Label { index, .. } | Self::RepeatedName { index, .. } => format!("bands[{index}].label").into(),
        }
    }
}

/// What is wrong with a rule's `lease` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// `max` is below the rule's `permits`: a lease would not hold one request.
    #[error("lease max is {max}; a lease holds at least one request, the rule's permits ({permits})")]
    BelowPermits {
        /// The lease's `max`.
        max: u64,
        /// The rule's `permits`.
        permits: u64,
    },
    /// `max` is above the capacity of one of the rule's bands.
    #[error("lease max is {max}; a lease takes at most the smallest band's capacity ({capacity})")]
    AboveCapacity {
        /// The lease's `max`.
        max: u64,
        /// The smallest capacity of the rule's bands.
        capacity: u64,
    },
    /// `ttl` is out of range.
    #[error("lease ttl is {}; it must be from 1ms to 1h", super::format_duration(*ttl))]
    Ttl {
        /// The `ttl` given.
        ttl: std::time::Duration,
    },
}

impl LeaseError {
    fn field(&self) -> Cow<'static, str> {
        match self {
            Self::BelowPermits { .. } | Self::AboveCapacity { .. } => "lease.max".into(),
            Self::Ttl { .. } => "lease.ttl".into(),
        }
    }
}

/// What is wrong with a rule's `on_limit.wait` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// `max_wait` is out of range.
    #[error("max_wait is {}; it must be from 1ms to 1h", super::format_duration(*max_wait))]
    MaxWait {
        /// The `max_wait` given.
        max_wait: std::time::Duration,
    },
    /// `max_waiters` is 0.
    #[error("max_waiters is 0; at least one request must be able to wait")]
    NoWaiter,
    /// The rule has a lease as well: its requests are decided from the lease, locally.
    #[error("a rule with a lease cannot wait for the refill; remove `lease` or `on_limit`")]
    WithLease,
}

impl WaitError {
    fn field(&self) -> Cow<'static, str> {
        match self {
            Self::MaxWait { .. } => "on_limit.wait.max_wait".into(),
            Self::NoWaiter => "on_limit.wait.max_waiters".into(),
            Self::WithLease => "on_limit".into(),
        }
    }
}

/// Why a band's capacity or window is out of range: a capacity is 1 to [`MAX_CAPACITY`],
/// a window a whole number of milliseconds from 1ms to [`MAX_WINDOW`](super::MAX_WINDOW).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BandRangeError {
    /// The capacity is 0.
    #[error("capacity is 0; capacity must be at least 1")]
    CapacityZero,
    /// The capacity is above [`MAX_CAPACITY`].
    #[error("capacity is larger than 2^40")]
    CapacityTooLarge,
    /// The window is 0.
    #[error("window is 0; a window must be at least 1ms")]
    WindowZero,
    /// The window is shorter than a millisecond.
    #[error("window is shorter than 1ms; a window must be at least 1ms")]
    WindowTooShort,
    /// The window is longer than [`MAX_WINDOW`](super::MAX_WINDOW).
    #[error("window is longer than ten years")]
    WindowTooLong,
    /// The window has a fraction of a millisecond: the rules' format and the names of
    /// bands in a backend's keys count whole milliseconds.
    #[error("window has a fraction of a millisecond; a window is a whole number of milliseconds")]
    WindowFraction,
}

impl BandRangeError {
    /// The band's field that is out of range: `capacity` or `window`.
    pub fn field(self) -> &'static str {
        match self {
            Self::CapacityZero | Self::CapacityTooLarge => "capacity",
            Self::WindowZero | Self::WindowTooShort | Self::WindowTooLong | Self::WindowFraction => "window",
        }
    }
}

/// Why a rule file's text, once parsed, is not a rule file: `{ rule_sets: [...] }`, each
/// rule set a map with `id` and `rules`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShapeError {
    /// The text holds nothing.
    #[error("the rules are empty; expected `rule_sets: [...]`")]
    Empty,
    /// The top level is not a map.
    #[error("expected a map with `rule_sets: [...]` at the top level")]
    NotAMap,
    /// The top level has a field other than `rule_sets`.
    #[error("unknown field; expected `rule_sets`")]
    UnknownField {
        /// The field.
        field: String,
    },
    /// The top level has no `rule_sets`.
    #[error("missing `rule_sets`")]
    MissingRuleSets,
    /// `rule_sets` is not a list.
    #[error("expected a list of rule sets")]
    RuleSetsNotAList,
    /// A rule set is not a map.
    #[error("expected a map with `id` and `rules`")]
    RuleSetNotAMap,
    /// A rule set's `rules` is not a list.
    #[error("expected a list of rules")]
    RulesNotAList,
}

impl ShapeError {
    fn field(&self) -> Cow<'static, str> {
        match self {
            Self::Empty | Self::NotAMap | Self::MissingRuleSets | Self::RuleSetsNotAList => "rule_sets".into(),
            Self::UnknownField { field } => field.clone().into(),
            Self::RuleSetNotAMap => "-".into(),
            Self::RulesNotAList => "rules".into(),
        }
    }
}
