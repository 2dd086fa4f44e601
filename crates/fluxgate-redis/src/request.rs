//! A request as script calls, one per hash slot, and their replies back as an outcome.

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate_core::RuleError;
use fred::bytes_utils::Str;
use smallvec::SmallVec;

use crate::band::{band_args, script_algorithm, script_number};
use crate::key;
use crate::protocol::{BandArgs, BandReply, BucketArgs, DecideArgs, Flags, RefundBand, RulePlace, ScriptAlgorithm};

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
    request: &AcquireRequest,
    prefix: &str,
    cluster: bool,
    with_deny_keys: bool,
) -> Result<Vec<Call>, RuleError> {
    let mut calls: Vec<(u16, Call)> = Vec::new();
    let mut position = 0;
    for bucket in request.buckets() {
        let rule = bucket.rule;
        let rule_set = bucket.rule_set.id();
        let tag = key::hash_tag(rule_set, rule, bucket.key.as_str());
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
        let Some(first) = rule.bands().first() else {
            continue; // validated rules have at least one band
        };
        let algorithm = script_algorithm(rule_set, rule, first)?;
        let permits = script_number(rule.permits(), rule_set, rule, first)?;
        let shadow = bucket.shadow();
        // Each band's numbers for the scripts, worked out once for the layout and the arguments.
        let band_numbers = rule
            .bands()
            .iter()
            .map(|band| band_args(rule_set, rule, band))
            .collect::<Result<SmallVec<[BandArgs; 4]>, RuleError>>()?;
        let (layout, tags) = if algorithm == ScriptAlgorithm::TokenBucket {
            // A token-bucket rule is one key, its bands named in its layout.
            let mut layout = String::with_capacity(32);
            for (i, (band, args)) in rule.bands().iter().zip(&band_numbers).enumerate() {
                if i > 0 {
                    layout.push(',');
                }
                key::push_band_tag(&mut layout, band, args.capacity);
            }
            layout.push('|');
            let rule_key = key::rule_key(prefix, &tag);
            // The deny cache names a band `<rule key>:<band tag>`, as the other algorithms'
            // keys are named (see `key::deny_key`).
            let tags: Vec<String> = if with_deny_keys && !shadow {
                layout[..layout.len() - 1]
                    .split(',')
                    .map(|band_tag| key::deny_key_in_rule(&rule_key, band_tag, rule.permits()))
                    .collect()
            } else {
                Vec::new()
            };
            call.keys.push(rule_key);
            (Some(Str::from(layout)), tags)
        } else {
            (None, Vec::new())
        };
        let count = rule.bands().len();
        call.args.bucket(BucketArgs {
            permits,
            flags: Flags::new(count, algorithm, shadow),
            layout: layout.clone(),
        });
        let mut tags = tags.into_iter();
        for ((index, band), &args) in (1..).zip(rule.bands().iter()).zip(&band_numbers) {
            call.args.band(args);
            let deny_key = match layout {
                Some(_) => tags.next(),
                None => {
                    let band_key = key::band_key(prefix, &tag, band, args.capacity, algorithm);
                    let deny_key = (with_deny_keys && !shadow).then(|| key::deny_key(&band_key, rule.permits()));
                    call.keys.push(band_key);
                    deny_key
                }
            };
            call.bands.push(CallBand {
                position,
                key: call.keys.len() - 1,
                shadow,
                deny_key,
                refund: RefundBand {
                    algorithm,
                    permits: permits.min(args.capacity),
                    band: args,
                    place: layout.as_ref().map(|layout| RulePlace {
                        layout: layout.clone(),
                        index,
                        count: i64::try_from(count).unwrap_or(i64::MAX),
                    }),
                },
            });
            position += 1;
        }
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
