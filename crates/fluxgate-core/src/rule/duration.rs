//! Durations as written in files: `500ms`, `1s`, `1m`, `1h`, `1d`.

use std::time::Duration;

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
/// A [`DurationError`] naming the text.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || DurationError { text: s.to_owned() };
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

/// A duration that is not `<integer><unit>` or does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration `{text}`: expected a whole number followed by ms, s, m, h or d (e.g. `500ms`, `1m`)")]
#[non_exhaustive]
pub struct DurationError {
    /// The text given.
    pub text: String,
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

pub(super) mod duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(in crate::rule) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub(in crate::rule) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        super::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}
