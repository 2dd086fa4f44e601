//! [`RuleChange`]: the rule change events sent on the Redis Pub/Sub channel
//! ([`DEFAULT_CHANGES_CHANNEL`]), in the three forms the channel accepts.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use fluxgate_core::rule::check_id;
use fluxgate_core::Shown;
use sha2::{Digest, Sha256};

/// The channel rule change events are published on unless another is given.
pub const DEFAULT_CHANGES_CHANNEL: &str = "fluxgate:rule-changes";

/// The longest message accepted; longer ones are invalid.
pub const MAX_CHANGE_MESSAGE: usize = 4 * 1024;

/// A rule change event.
///
/// Three message forms are accepted on the channel:
///
/// | message | meaning |
/// | --- | --- |
/// | `*`, or empty | reload every rule set; reset nothing |
/// | a bare rule set id, `api` | reload; reset the buckets of `api` |
/// | JSON, `{"ruleSetId":"api","fullReload":false,"resetBuckets":true,"source":"admin"}` | as its fields say |
///
/// The JSON fields are all optional: `ruleSetId` (a rule set id, or `*` for all),
/// `fullReload` (default: `true` without a rule set id), `resetBuckets` (default: `true`
/// with a rule set id, `false` without), `source` (who sent it, for the logs) and
/// `eventId` (tells events apart: see [`event_key`](Self::event_key)). Other fields are
/// ignored. A message is invalid when it is longer than [`MAX_CHANGE_MESSAGE`], is not
/// UTF-8, holds a rule set id that is not a valid id, or is JSON of another shape (not
/// an object, a field of the wrong type, `fullReload: false` without a rule set id).
///
/// ```
/// use fluxgate_redis::RuleChange;
///
/// let change = RuleChange::parse(r#"{"ruleSetId":"api","resetBuckets":true,"source":"admin"}"#)?;
/// assert_eq!(change.rule_set.as_deref(), Some("api"));
/// assert!(change.reset_buckets && !change.full_reload);
/// assert_eq!(RuleChange::parse("api")?, RuleChange::rule_set("api"));
/// assert_eq!(RuleChange::parse("*")?, RuleChange::everything());
/// assert!(RuleChange::parse("not an id!").is_err());
/// # Ok::<(), fluxgate_redis::ChangeError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RuleChange {
    /// The rule set that changed; `None` for every rule set.
    pub rule_set: Option<String>,
    /// Whether every rule set should be reloaded. Listeners reload every rule set for
    /// every event anyway (one consistent read of the source); the flag is kept for
    /// compatibility and for the logs.
    pub full_reload: bool,
    /// Whether the buckets of the rule set (of every rule set without one) start over.
    pub reset_buckets: bool,
    /// Who sent the event, for the logs.
    pub source: Option<String>,
    /// An id that tells this event apart from others with the same content.
    pub event_id: Option<String>,
}

/// Why a message on the change channel is not a [`RuleChange`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChangeError {
    /// The message is longer than [`MAX_CHANGE_MESSAGE`].
    #[error("rule change message of {0} bytes: at most 4096 are accepted")]
    TooLong(usize),
    /// The message is not UTF-8 text.
    #[error("rule change message is not UTF-8 text")]
    NotText,
    /// The rule set id is not a valid id.
    #[error("rule change message: rule set id `{id}` is not valid: {reason}")]
    RuleSetId {
        /// The id, cut to 64 characters, its control characters escaped.
        id: String,
        /// Why.
        reason: String,
    },
    /// The JSON form does not have the expected shape.
    #[error("rule change message: invalid JSON event: {0}")]
    Json(String),
}

/// The JSON form, as sent by the original's admin tools and by [`RuleChange::to_json`].
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Message {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rule_set_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    full_reload: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reset_buckets: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    event_id: Option<String>,
}

impl RuleChange {
    /// A change of one rule set: reload, and reset its buckets (the bare-id form).
    pub fn rule_set(id: impl Into<String>) -> Self {
        Self {
            rule_set: Some(id.into()),
            full_reload: false,
            reset_buckets: true,
            source: None,
            event_id: None,
        }
    }

    /// Reload every rule set and reset nothing (the `*` form).
    pub fn everything() -> Self {
        Self {
            rule_set: None,
            full_reload: true,
            reset_buckets: false,
            source: None,
            event_id: None,
        }
    }

    /// The same event, resetting buckets or not.
    #[must_use]
    pub fn with_reset(mut self, reset: bool) -> Self {
        self.reset_buckets = reset;
        self
    }

    /// The same event, naming who sent it.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The same event with a new event id, unique to this process and instant, so that
    /// listeners reset its buckets once even when the same change is published again.
    #[must_use]
    pub fn with_new_event_id(mut self) -> Self {
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let random = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(nanos);
            h.finish()
        };
        let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        self.event_id = Some(format!("{nanos:x}-{:x}-{sequence:x}-{random:016x}", std::process::id()));
        self
    }

    /// Reads a message of the change channel.
    ///
    /// # Errors
    ///
    /// A [`ChangeError`] saying why the message is not a valid event.
    pub fn parse(message: &str) -> Result<Self, ChangeError> {
        if message.len() > MAX_CHANGE_MESSAGE {
            return Err(ChangeError::TooLong(message.len()));
        }
        let text = message.trim();
        if text.is_empty() || text == "*" {
            return Ok(Self::everything());
        }
        if !text.starts_with('{') {
            valid_id(text)?;
            return Ok(Self::rule_set(text));
        }
        let json: Message = serde_json::from_str(text).map_err(|e| ChangeError::Json(e.to_string()))?;
        let rule_set = match json.rule_set_id {
            Some(id) if id.trim() == "*" => None,
            Some(id) => {
                valid_id(&id)?;
                Some(id)
            }
            None => None,
        };
        let full_reload = json.full_reload.unwrap_or(rule_set.is_none());
        if !full_reload && rule_set.is_none() {
            return Err(ChangeError::Json(
                "`fullReload` is false but no `ruleSetId` names what changed".into(),
            ));
        }
        Ok(Self {
            reset_buckets: json.reset_buckets.unwrap_or(rule_set.is_some()),
            rule_set,
            full_reload,
            source: json.source,
            event_id: json.event_id,
        })
    }

    /// Reads a message's bytes (see [`parse`](Self::parse)).
    ///
    /// # Errors
    ///
    /// [`ChangeError::NotText`] when the bytes are not UTF-8, or those of `parse`.
    pub fn parse_bytes(message: &[u8]) -> Result<Self, ChangeError> {
        if message.len() > MAX_CHANGE_MESSAGE {
            return Err(ChangeError::TooLong(message.len()));
        }
        Self::parse(std::str::from_utf8(message).map_err(|_| ChangeError::NotText)?)
    }

    /// The JSON form of the event.
    pub fn to_json(&self) -> String {
        let message = Message {
            rule_set_id: self.rule_set.clone(),
            full_reload: Some(self.full_reload),
            reset_buckets: Some(self.reset_buckets),
            source: self.source.clone(),
            event_id: self.event_id.clone(),
        };
        serde_json::to_string(&message).unwrap_or_default()
    }

    /// What tells this event apart from others, as 32 hex digits: a digest of its event
    /// id when it has one, of the message otherwise. Two messages without an event id
    /// and with the same text are therefore one event to the listeners' reset claim
    /// (see [`RuleChangeListener`](crate::RuleChangeListener)).
    pub fn event_key(&self, message: &str) -> String {
        let mut h = Sha256::new();
        match &self.event_id {
            Some(id) => {
                h.update(b"id:");
                h.update(id.as_bytes());
            }
            None => {
                h.update(b"message:");
                h.update(message.trim().as_bytes());
            }
        }
        h.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What whoever may publish on the channel wrote (the id, the `source`) is shown cut and
/// escaped ([`Shown`]): the listener logs each event, and a `source` holding a line break and
/// a terminal escape, written as it was, forged log lines of its own.
impl fmt::Display for RuleChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.rule_set {
            Some(id) => write!(f, "rule set `{}` changed", Shown(id))?,
            None => f.write_str("every rule set changed")?,
        }
        if self.reset_buckets {
            f.write_str(", buckets reset")?;
        }
        if let Some(source) = &self.source {
            write!(f, " (from {})", Shown(source))?;
        }
        Ok(())
    }
}

fn valid_id(id: &str) -> Result<(), ChangeError> {
    check_id(id).map_err(|e| ChangeError::RuleSetId {
        id: Shown(id).to_string(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_forms() {
        assert_eq!(RuleChange::parse("").unwrap(), RuleChange::everything());
        assert_eq!(RuleChange::parse(" * \n").unwrap(), RuleChange::everything());
        assert_eq!(RuleChange::parse("api").unwrap(), RuleChange::rule_set("api"));
        let json = RuleChange::parse(r#"{"ruleSetId":"api","fullReload":false,"resetBuckets":true,"source":"admin"}"#)
            .unwrap();
        assert_eq!(json, RuleChange::rule_set("api").with_source("admin"));
        let no_reset = RuleChange::parse(r#"{"ruleSetId":"api","resetBuckets":false}"#).unwrap();
        assert!(!no_reset.reset_buckets && !no_reset.full_reload);
        let all = RuleChange::parse(r#"{"fullReload":true,"resetBuckets":true,"x":1}"#).unwrap();
        assert_eq!(all, RuleChange::everything().with_reset(true));
        let star = RuleChange::parse(r#"{"ruleSetId":"*"}"#).unwrap();
        assert_eq!(star, RuleChange::everything());
    }

    #[test]
    fn json_round_trips() {
        let change = RuleChange::rule_set("api").with_source("admin").with_new_event_id();
        assert_eq!(RuleChange::parse(&change.to_json()).unwrap(), change);
        assert_ne!(
            change.event_id,
            RuleChange::rule_set("api").with_new_event_id().event_id,
            "event ids are unique"
        );
    }

    #[test]
    fn invalid_messages_say_why() {
        let cases: &[(&str, &str)] = &[
            ("api key", "rule set id `api key` is not valid"),
            ("{not json", "invalid JSON event"),
            (r#"{"ruleSetId":7}"#, "invalid JSON event"),
            (r#"{"ruleSetId":"a:b"}"#, "rule set id `a:b` is not valid"),
            (r#"{"ruleSetId":"{x}"}"#, "rule set id `{x}` is not valid"),
            (r#"{"fullReload":false}"#, "no `ruleSetId`"),
            ("[1]", "rule set id `[1]` is not valid"),
        ];
        for (message, expected) in cases {
            let error = RuleChange::parse(message).unwrap_err().to_string();
            assert!(error.contains(expected), "{message}: {error}");
        }
        let long = "a".repeat(MAX_CHANGE_MESSAGE + 1);
        assert_eq!(RuleChange::parse(&long), Err(ChangeError::TooLong(long.len())));
        assert_eq!(RuleChange::parse_bytes(b"\xff\xfe"), Err(ChangeError::NotText));
    }

    /// The listener logs each event and each message it ignores: what a publisher wrote
    /// there is cut and escaped, so that it writes no log line of its own (the `source`
    /// below was written with its line break and escape, a second line of 2,000 characters).
    #[test]
    fn a_publisher_forges_no_log_line() {
        let forged = format!("admin\n2025-01-01T00:00:00Z ERROR forged\u{1b}[2K{}", "x".repeat(2_000));
        let message = serde_json::json!({"ruleSetId": "api", "source": forged}).to_string();
        let shown = RuleChange::parse(&message).unwrap().to_string();
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
        assert!(shown.contains("(from admin\\n2025"), "{shown}");
        assert!(shown.len() < 150, "{} bytes", shown.len());
        for message in [
            format!("api\n{forged}"),
            serde_json::json!({"ruleSetId": forged}).to_string(),
        ] {
            let error = RuleChange::parse(&message).unwrap_err().to_string();
            assert!(!error.chars().any(char::is_control), "{error:?}");
        }
    }

    #[test]
    fn event_keys_tell_events_apart_by_id_or_text() {
        let a = RuleChange::rule_set("api");
        assert_eq!(a.event_key("api"), a.event_key(" api "));
        assert_ne!(a.event_key("api"), RuleChange::rule_set("web").event_key("web"));
        let (x, y) = (a.clone().with_new_event_id(), a.clone().with_new_event_id());
        assert_ne!(x.event_key("same"), y.event_key("same"));
        assert_eq!(x.event_key("api").len(), 32);
    }
}
