//! A request as script calls, one per hash slot, and their replies back as an outcome.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate_core::{Band, BandReport, RuleError};

use crate::band::{band_args, script_number};
use crate::key;
use crate::protocol::{BandReply, BucketArgs, DecideArgs, Flags, RefundBand, ScriptAlgorithm};

/// One decision call: the buckets of one hash slot (all buckets on a standalone Redis).
pub(crate) struct Call {
    /// One key per band.
    pub(crate) keys: Vec<String>,
    pub(crate) args: DecideArgs,
    /// Per band, in the order of `keys`.
    pub(crate) bands: Vec<CallBand>,
}

/// What the limiter keeps of a band of a call, besides its key.
pub(crate) struct CallBand {
    /// Its position among all bands of the request.
    pub(crate) position: usize,
    /// Whether its rule is in shadow mode.
    pub(crate) shadow: bool,
    /// The deny-cache key of an enforced band (see [`key::deny_key`]), when the limiter
    /// has a deny cache.
    pub(crate) deny_key: Option<String>,
    /// What the refund script needs to give its consumption back.
    pub(crate) refund: RefundBand,
}

/// Encodes a request: one call on a standalone Redis, one call per hash slot on a cluster.
/// Deny-cache keys are made only `with_deny_keys`.
///
/// # Errors
///
/// [`RuleError::Unsupported`] for a band the scripts cannot decide exactly (a rule that
/// was not validated).
pub(crate) fn encode(
    request: &AcquireRequest<'_>,
    prefix: &str,
    cluster: bool,
    with_deny_keys: bool,
) -> Result<Vec<Call>, RuleError> {
    let mut calls: Vec<(u16, Call)> = Vec::new();
    let mut position = 0;
    for bucket in request.buckets {
        let rule = bucket.rule;
        let tag = key::hash_tag(bucket.rule_set, rule, bucket.key.as_str());
        let slot = if cluster {
            fred::util::redis_keyslot(tag.as_bytes())
        } else {
            0
        };
        let at = match calls.iter().position(|(s, _)| *s == slot) {
            Some(at) => at,
            None => {
                calls.push((
                    slot,
                    Call {
                        keys: Vec::new(),
                        args: DecideArgs::new(),
                        bands: Vec::new(),
                    },
                ));
                calls.len() - 1
            }
        };
        let call = &mut calls[at].1;
        let algorithm = rule.algorithm();
        let Some(first) = rule.bands().first() else {
            continue; // validated rules have at least one band
        };
        let permits = script_number(rule.permits(), bucket.rule_set, rule, first)?;
        let shadow = bucket.shadow();
        call.args.bucket(BucketArgs {
            permits,
            flags: Flags::new(rule.bands().len(), algorithm.into(), shadow),
        });
        for band in rule.bands().iter() {
            let args = band_args(bucket.rule_set, rule, band)?;
            let band_key = key::band_key(prefix, &tag, band, args.capacity, algorithm);
            call.args.band(args);
            call.bands.push(CallBand {
                position,
                shadow,
                deny_key: (with_deny_keys && !shadow).then(|| key::deny_key(&band_key, rule.permits())),
                refund: RefundBand {
                    algorithm: ScriptAlgorithm::from(algorithm),
                    permits: permits.min(args.capacity),
                    band: args,
                },
            });
            call.keys.push(band_key);
            position += 1;
        }
    }
    Ok(calls.into_iter().map(|(_, call)| call).collect())
}

/// What the limiter needs of the request to read the replies, owned.
pub(crate) struct Shape {
    bands: Vec<ShapeBand>,
}

/// A band of the request: its rule's id and mode and the band.
pub(crate) struct ShapeBand {
    pub(crate) rule: Arc<str>,
    pub(crate) shadow: bool,
    pub(crate) band: Band,
}

impl Shape {
    /// The bands of `request`, in order.
    pub(crate) fn of(request: &AcquireRequest<'_>) -> Self {
        let bands = request
            .buckets
            .iter()
            .flat_map(|b| {
                let (rule, shadow) = (b.rule.id(), b.shadow());
                b.rule.bands().iter().map(move |band| ShapeBand {
                    rule: rule.clone(),
                    shadow,
                    band: band.clone(),
                })
            })
            .collect();
        Self { bands }
    }

    /// The band at `position` among all bands of the request.
    pub(crate) fn band(&self, position: usize) -> &ShapeBand {
        &self.bands[position]
    }

    /// The number of bands.
    pub(crate) fn len(&self) -> usize {
        self.bands.len()
    }

    /// The outcome of a decision taken at `now_us` (Redis time), with what Redis said of
    /// each band, in order.
    pub(crate) fn outcome(
        &self,
        allowed: bool,
        shadow_allowed: bool,
        now_us: i64,
        replies: impl Iterator<Item = BandReply>,
    ) -> AcquireOutcome {
        let now_ns = u64::try_from(now_us).unwrap_or(0).saturating_mul(1_000);
        let bands = self
            .bands
            .iter()
            .zip(replies)
            .map(|(ShapeBand { rule, shadow, band }, reply)| BandReport {
                rule: rule.clone(),
                band: band.name().clone(),
                labeled: band.label().is_some(),
                limit: band.capacity(),
                remaining: reply.remaining,
                window: band.window(),
                reset_after: reply.reset_after,
                reset_at: UNIX_EPOCH + Duration::from_nanos(now_ns) + reply.reset_after,
                allowed: reply.allowed,
                shadow: *shadow,
                wait: reply.wait,
            })
            .collect();
        AcquireOutcome {
            allowed,
            shadow_allowed,
            now_unix_nanos: now_ns,
            bands,
            local: false,
        }
    }
}
