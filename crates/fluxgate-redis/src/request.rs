//! A request as script calls, one per hash slot, and their replies back as an outcome.

use std::sync::Arc;

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate_core::RuleError;
use smallvec::SmallVec;

use crate::key;
use crate::plan::{plan, RulePlan};
use crate::protocol::{BandReply, DecideArgs, RefundBand};

/// One decision call: the buckets of one hash slot (all buckets on a standalone Redis).
pub(crate) struct Call {
    /// One key per token-bucket rule, one per band of the other algorithms.
    pub(crate) keys: Vec<String>,
    pub(crate) args: DecideArgs,
    /// Per band, in the order of `keys`.
    pub(crate) bands: Vec<CallBand>,
}

/// What the limiter keeps of a band of a call, besides its key.
pub(crate) struct CallBand {
    /// Its position among all bands of the request.
    pub(crate) position: usize,
    /// Its key, in the call's `keys`.
    pub(crate) key: usize,
    /// Whether its rule is in shadow mode.
    pub(crate) shadow: bool,
    /// The deny-cache key of an enforced band (see [`key::deny_key`]), when the limiter
    /// has a deny cache.
    pub(crate) deny_key: Option<String>,
    /// Its rule's plan and its place among the rule's bands: what the refund script needs
    /// to give its consumption back ([`RulePlan::refund`]).
    pub(crate) plan: Arc<RulePlan>,
    pub(crate) index: usize,
}

impl CallBand {
    /// What the refund script needs to give this band's consumption back.
    pub(crate) fn refund(&self) -> Option<RefundBand> {
        self.plan.refund(self.index)
    }
}

/// Encodes a request: one call on a standalone Redis, one call per hash slot on a cluster.
/// Deny-cache keys are made only `with_deny_keys`. What depends on the rule alone comes
/// from its plan ([`plan`]); only the keys are written per request.
///
/// # Errors
///
/// [`RuleError::Unsupported`] for a band the scripts cannot decide exactly (a rule that
/// was not validated).
pub(crate) fn encode(
    request: &AcquireRequest,
    prefix: &str,
    cluster: bool,
    with_deny_keys: bool,
) -> Result<SmallVec<[Call; 1]>, RuleError> {
    let mut calls: SmallVec<[(u16, Call); 1]> = SmallVec::new();
    let mut position = 0;
    for bucket in request.buckets() {
        let rule = bucket.rule;
        let Some(first) = rule.bands().first() else {
            continue; // validated rules have at least one band
        };
        let plan = plan(bucket.rule_set.id(), rule, first)?;
        let tag = key::hash_tag(bucket.rule_set.id(), rule, bucket.key.as_str());
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
                        keys: Vec::with_capacity(request.buckets().len()),
                        args: DecideArgs::new(),
                        bands: Vec::with_capacity(request.bands().count()),
                    },
                ));
                calls.len() - 1
            }
        };
        let call = &mut calls[at].1;
        let shadow = plan.shadow();
        let deny = with_deny_keys && !shadow;
        let start = key::rule_key(prefix, &tag);
        let one_key = plan.is_one_key();
        if one_key {
            call.keys.push(start.clone());
        }
        for index in 0..plan.band_count() {
            let deny_key = if one_key {
                deny.then(|| plan.deny_key(&start, index))
            } else {
                let band_key = plan.band_key(&start, index);
                let deny_key = deny.then(|| plan.deny_key(&band_key, index));
                call.keys.push(band_key);
                deny_key
            };
            call.bands.push(CallBand {
                position,
                key: call.keys.len() - 1,
                shadow,
                deny_key,
                plan: plan.clone(),
                index,
            });
            position += 1;
        }
        call.args.rule(plan.args.clone());
    }
    Ok(calls.into_iter().map(|(_, call)| call).collect())
}

/// The outcome of a decision on `request` taken at `now_us` (Redis time), with what Redis
/// said of each of its bands, in order.
pub(crate) fn outcome(
    request: &AcquireRequest,
    allowed: bool,
    shadow_allowed: bool,
    now_us: i64,
    replies: impl Iterator<Item = BandReply>,
) -> AcquireOutcome {
    let now_ns = u64::try_from(now_us).unwrap_or(0).saturating_mul(1_000);
    let bands: fluxgate_core::Bands = request
        .bands()
        .zip(replies)
        .map(|((bucket, band), reply)| bucket.report(band, now_ns, reply.remaining, reply.reset_after, reply.wait))
        .collect();
    AcquireOutcome::new(allowed, shadow_allowed, now_ns, bands)
}
