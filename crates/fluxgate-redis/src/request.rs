//! A request as script calls, one per hash slot, and their replies back as an outcome.

use std::sync::Arc;
use std::time::Duration;

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest, Bucket};
use fluxgate_core::RuleError;
use smallvec::SmallVec;

use crate::key;
use crate::plan::{plan, RulePlan};
use crate::protocol::{
    expected_leaky_state, expected_state, nonnegative, BandReply, DecideArgs, RefundArgs, RefundBand, ScriptAlgorithm,
};

/// The keys of a decision call: in place for a call of one key.
pub(crate) type Keys = SmallVec<[String; 1]>;

/// One decision call: the buckets of one hash slot (all buckets on a standalone Redis).
pub(crate) struct Call {
    /// The hash slot of its keys (0 on a standalone Redis).
    pub(crate) slot: u16,
    /// One key per token-bucket rule, one per band of the other algorithms.
    pub(crate) keys: Keys,
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

    /// The deny-cache key of this band, whose key in Redis (its rule's for a token bucket)
    /// is `key`; `None` for a band in shadow mode, which the deny cache never answers.
    /// Made only when the deny cache needs it, not for every request.
    pub(crate) fn deny_key(&self, key: &str) -> Option<String> {
        (!self.shadow).then(|| self.plan.deny_key(key, self.index))
    }

    /// The deny-cache key of this band of `request`, from the request itself (after the
    /// call, whose keys went to Redis), as [`encode`] named its key with `prefix`.
    pub(crate) fn deny_key_in(&self, request: &AcquireRequest, prefix: &str) -> Option<String> {
        let (bucket, _) = request.bands().nth(self.position)?;
        let start = key::rule_key(prefix, bucket.rule_set.id(), bucket.rule, bucket.key.as_str());
        if self.plan.is_one_key() {
            self.deny_key(&start)
        } else {
            self.deny_key(&self.plan.band_key(&start, self.index))
        }
    }
}

/// Encodes a request: one call on a standalone Redis, one call per hash slot on a cluster.
/// What depends on the rule alone comes from its plan ([`plan`]); only the keys are
/// written per request.
///
/// A request may wait for the refill ([`Bucket::max_wait`](fluxgate_core::limiter::Bucket::max_wait))
/// only in one call, which decides all its rules at one instant: split across the slots of
/// a cluster, it is encoded again without waiting, and is refused at once when a band
/// refuses.
///
/// # Errors
///
/// [`RuleError::Unsupported`] for a band the scripts cannot decide exactly (a rule that
/// was not validated).
pub(crate) fn encode(request: &AcquireRequest, prefix: &str, cluster: bool) -> Result<SmallVec<[Call; 1]>, RuleError> {
    let mut calls = encode_waiting(request, prefix, cluster, true)?;
    if calls.len() > 1 && request.may_wait() {
        calls = encode_waiting(request, prefix, cluster, false)?;
    }
    // Marks for the request that asks, and for the slots a refund may follow.
    if request.marks_places() || calls.len() > 1 {
        for call in &mut calls {
            call.args.mark_places();
        }
    }
    Ok(calls)
}

/// How long, in whole µs, the request may wait for `bucket` to admit it, if `waits` and the
/// rule is enforced (a shadow rule never makes a request wait).
fn max_wait_us(bucket: &Bucket<'_>, waits: bool) -> i64 {
    if !waits || bucket.shadow() {
        return 0;
    }
    i64::try_from(bucket.max_wait().as_micros()).unwrap_or(i64::MAX)
}

/// [`encode`], letting the request wait when `waits`.
fn encode_waiting(
    request: &AcquireRequest,
    prefix: &str,
    cluster: bool,
    waits: bool,
) -> Result<SmallVec<[Call; 1]>, RuleError> {
    let mut calls: SmallVec<[(u16, Call); 1]> = SmallVec::new();
    let mut position = 0;
    for bucket in request.buckets() {
        let rule = bucket.rule;
        let Some(first) = rule.bands().first() else {
            continue; // validated rules have at least one band
        };
        let plan = plan(
            bucket.rule_set.id(),
            rule,
            first,
            bucket.permits,
            max_wait_us(&bucket, waits),
        )?;
        let start = key::rule_key(prefix, bucket.rule_set.id(), rule, bucket.key.as_str());
        let slot = if cluster {
            // As Redis computes it, from the whole key: with a prefix holding `{` its tag
            // is not the rule's, and every key of the call must still share the slot.
            fred::util::redis_keyslot(start.as_bytes())
        } else {
            0
        };
        let at = match calls.iter().position(|(s, _)| *s == slot) {
            Some(at) => at,
            None => {
                calls.push((
                    slot,
                    Call {
                        slot,
                        keys: Keys::with_capacity(request.buckets().len()),
                        args: DecideArgs::new(),
                        bands: Vec::with_capacity(request.bands().count()),
                    },
                ));
                calls.len() - 1
            }
        };
        let call = &mut calls[at].1;
        let shadow = plan.shadow();
        let one_key = plan.is_one_key();
        let first_key = call.keys.len();
        if one_key {
            call.keys.push(start); // all the rule's bands
        } else {
            call.keys
                .extend((0..plan.band_count()).map(|index| plan.band_key(&start, index)));
        }
        for index in 0..plan.band_count() {
            call.bands.push(CallBand {
                position,
                key: if one_key { first_key } else { first_key + index },
                shadow,
                plan: plan.clone(),
                index,
            });
            position += 1;
        }
        call.args.rule(plan.args.clone());
    }
    Ok(calls.into_iter().map(|(_, call)| call).collect())
}

/// A refund call: its keys and arguments.
pub(crate) type RefundCall = (Vec<String>, RefundArgs);

/// What giving back `request`'s consumption, decided at `decided_us`, sends: one refund call
/// per hash slot (one on a standalone Redis), each with one key per band (a token-bucket
/// rule's key once for each of its bands) and the bands' refund arguments. With `marks`
/// (a waiting request's place, [`AcquireOutcome::marks`]), each token- or leaky-bucket band
/// is refunded only while it holds the state its mark records.
///
/// # Errors
///
/// [`RuleError::Unsupported`] for a band the scripts cannot decide exactly.
pub(crate) fn encode_refund(
    request: &AcquireRequest,
    prefix: &str,
    cluster: bool,
    decided_us: i64,
    marks: &[u128],
) -> Result<SmallVec<[RefundCall; 1]>, RuleError> {
    Ok(encode_waiting(request, prefix, cluster, false)?
        .iter()
        .map(|call| call.refund(0..call.bands.len(), decided_us, marks, false))
        .collect())
}

impl Call {
    /// The refund call giving back what this call's `bands` (indexes into
    /// [`bands`](Self::bands)) consumed when Redis decided at `decided_us`: each band's
    /// key (a token-bucket rule's once per band) and refund arguments; with `marks` (per
    /// band of the request, see [`encode_refund`]), the state each token- or leaky-bucket
    /// band must still hold, or, `ahead_only`, the state the request left, of whose permits
    /// only those still ahead of now and not refilled since the decision go back (see
    /// `token_bucket_refund` in `lua/token_bucket.lua` and the leaky bucket's in
    /// `lua/refund.lua`).
    pub(crate) fn refund(
        &self,
        bands: impl IntoIterator<Item = usize>,
        decided_us: i64,
        marks: &[u128],
        ahead_only: bool,
    ) -> RefundCall {
        let refunds: Vec<(&CallBand, RefundBand)> = bands
            .into_iter()
            .filter_map(|j| self.bands.get(j))
            .filter_map(|band| Some((band, band.refund()?)))
            .collect();
        // When the permits were taken: the decision's instant, which a window or log band's
        // mark records for a waiting request's place (`decided_us` is then its later
        // instant). Permits taken before the server started go back nowhere.
        let made_us = refunds
            .iter()
            .filter(|(_, refund)| refund.keeps_no_state())
            .filter_map(|(band, _)| marks.get(band.position).copied())
            .filter_map(|mark| i64::try_from(mark).ok())
            .filter(|&mark| mark > 0)
            .fold(decided_us, i64::min);
        let mut args = RefundArgs::new(decided_us, made_us);
        let mut keys = Vec::new();
        for (band, mut refund) in refunds {
            // A token or leaky bucket keeps one instant: its state as the request left it,
            // in the form the refund script compares (a leaky bucket's in whole leak
            // intervals, see `lua/refund.lua`).
            let mark = marks.get(band.position).copied().unwrap_or(0);
            let expected = if refund.place.is_some() {
                Some(expected_state(mark))
            } else if refund.algorithm == ScriptAlgorithm::LeakyBucket {
                Some(expected_leaky_state(mark))
            } else {
                None
            };
            if let Some(expected) = expected.filter(|_| !marks.is_empty()) {
                refund.expect = Some(match (expected, ahead_only) {
                    (Some(state), true) => format!("~{state}"),
                    (Some(state), false) => state,
                    // Without a mark (a band not committed): nothing (a state no band
                    // holds).
                    (None, _) => "-".to_owned(),
                });
            }
            args.band(&refund);
            keys.push(self.keys[band.key].clone());
        }
        (keys, args)
    }
}

/// Records in `marks` (per band of the request, as the decision's reply gives them; empty
/// when the call asked for none) the decision's instant, `now_us`, for each window or log
/// band of `bands`, whose state the scripts do not record (0): what a refund of its place
/// or lease compares with the server's start (see [`Call::refund`]).
pub(crate) fn mark_instants(bands: &[CallBand], marks: &mut [u128], now_us: i64) {
    if marks.is_empty() {
        return;
    }
    for band in bands {
        if band.refund().is_some_and(|refund| refund.keeps_no_state()) {
            if let Some(mark) = marks.get_mut(band.position) {
                *mark = u128::from(nonnegative(now_us));
            }
        }
    }
}

/// The outcome of a decision on `request` taken at `now_us` (Redis time), with what Redis
/// said of each of its bands, in order; admitted `admitted_after_us` later when it waits
/// for the refill.
pub(crate) fn outcome(
    request: &AcquireRequest,
    (allowed, shadow_allowed): (bool, bool),
    (now_us, admitted_after_us): (i64, i64),
    marks: Vec<u128>,
    replies: impl Iterator<Item = BandReply>,
) -> AcquireOutcome {
    let now_ns = u64::try_from(now_us).unwrap_or(0).saturating_mul(1_000);
    let bands: fluxgate_core::Bands = request
        .bands()
        .zip(replies)
        .map(|((bucket, band), reply)| bucket.report(band, now_ns, reply.remaining, reply.reset_after, reply.wait))
        .collect();
    let outcome = AcquireOutcome::new(allowed, shadow_allowed, now_ns, bands).with_marks(marks);
    match u64::try_from(admitted_after_us) {
        Ok(after) if after > 0 => outcome.admitted_later(Duration::from_micros(after)),
        _ => outcome,
    }
}
