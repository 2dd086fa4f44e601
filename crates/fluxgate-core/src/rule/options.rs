//! The named options of a rule, the same in files and in the validated model.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::BandSpec;

/// The kind of scope, as named in files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
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
#[non_exhaustive]
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
#[non_exhaustive]
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
    /// Whether a band's state is one instant (the token and leaky buckets): moving it
    /// back frees the last permits taken, whoever took them.
    pub(crate) fn keeps_an_instant(self) -> bool {
        matches!(self, Self::TokenBucket | Self::LeakyBucket)
    }

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
#[non_exhaustive]
pub enum Mode {
    /// Rejections block the request.
    #[default]
    Enforce,
    /// Decide and report, never block.
    Shadow,
}
