//! The MongoDB rule source of [FluxGate](https://github.com/fluxgate-rs/fluxgate):
//! rate-limit rules kept in a MongoDB collection, one document per rule, in the shape the
//! Java FluxGate stored them (`rate_limit_rules`), loaded and reloaded while the service
//! runs.
//!
//! - [`document`]: the mapping between rule documents and the rule model, pure (it needs
//!   only the `bson` crate): which fields are read, which numbers are accepted, and
//!   errors that name the document and the field.
//! - [`MongoRuleSource`]: a [`RuleSource`](fluxgate_core::reload::RuleSource) over a
//!   collection, with a deadline per call, an optional filter by rule set, and
//!   [`put_rule_set`](MongoRuleSource::put_rule_set) /
//!   [`delete_rule_set`](MongoRuleSource::delete_rule_set) to fill it.
//!
//! ```
//! use bson::doc;
//! use fluxgate_mongodb::document::rule_sets_from_documents;
//!
//! let documents = [doc! {
//!     "ruleSetId": "api",
//!     "id": "per-ip",
//!     "name": "Per IP",
//!     "enabled": true,
//!     "scope": "PER_IP",
//!     "keyStrategyId": "ip",
//!     "onLimitExceedPolicy": "REJECT_REQUEST",
//!     "bands": [
//!         { "windowSeconds": 1_i64, "capacity": 10_i64, "label": "burst" },
//!         { "windowSeconds": 60_i64, "capacity": 100_i64, "label": "sustained" },
//!     ],
//! }];
//! let sets = rule_sets_from_documents(&documents)?;
//! let rule = &sets.get("api").expect("rule set api").rules()[0];
//! assert_eq!(rule.bands()[1].capacity(), 100);
//! # Ok::<(), fluxgate_mongodb::document::MappingError>(())
//! ```
//!
//! Through the `fluxgate` facade this crate is `fluxgate::mongodb` (feature `mongodb`).
//! See `docs/reload.md` for the document shape in full.

#![deny(unsafe_code)]

pub mod document;
mod source;

pub use document::{DocumentError, MappingError, WriteError, DEFAULT_COLLECTION};
pub use source::{MongoRuleSource, SourceError, DEFAULT_TIMEOUT};

/// The `bson` crate of the documents (the driver's `bson-2` API).
pub use bson;
/// The MongoDB driver the source uses.
pub use mongodb;
