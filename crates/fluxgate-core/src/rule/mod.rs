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

mod duration;
mod error;
mod load;
mod model;
mod options;
mod spec;
#[cfg(test)]
mod tests;
mod validate;

use std::time::Duration;

pub use duration::{format_duration, parse_duration, DurationError};
pub use error::{
    BandError, BandRangeError, IdError, LeaseError, MatchError, Problem, ScopeError, ShapeError, WaitError,
};
pub use load::{Format, MAX_RULE_FILE};
pub use model::{Band, KeyField, Lease, Rule, RuleSet, RuleSets, Scope, WaitPolicy};
pub use options::{Algorithm, Mode, OnMissingKey, ScopeKind};
pub use spec::{BandSpec, LeaseSpec, MatchSpec, OnLimitSpec, RuleSetSpec, RuleSpec, RulesFileSpec, WaitSpec};
pub use validate::check_id;

/// The largest capacity a band may have.
pub const MAX_CAPACITY: u64 = 1 << 40;
/// The longest window a band may have (ten years).
pub const MAX_WINDOW: Duration = Duration::from_secs(10 * 366 * 24 * 3600);
/// The longest id (rule set, rule, band label, attribute name).
pub const MAX_ID_LEN: usize = 64;
