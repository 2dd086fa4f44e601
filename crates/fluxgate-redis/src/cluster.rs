//! A request whose buckets live in several hash slots of a Redis Cluster: one decision call
//! per slot, concurrently, then the refunds the combined decision calls for.

use std::sync::Arc;

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest};
use futures_util::future::join_all;

use crate::error::RedisError;
use crate::protocol::{BandReply, RefundedBand, Reply};
use crate::request::{mark_instants, outcome, Call};
use crate::script::Scripts;

/// Decides a request across the hash slots of `calls`. Runs as a task of its own, so that
/// a caller who stops waiting (a client gone, an outer timeout) cannot leave a consumption
/// that should have been given back.
///
/// # Errors
///
/// The error of a slot that failed, after the other slots' refunds, unless a slot that
/// answered rejects the request: it is then rejected.
pub(crate) async fn decide_across_slots(
    scripts: Arc<Scripts>,
    calls: Vec<Call>,
    request: AcquireRequest,
    decided: impl FnOnce(&AcquireRequest, &[Call], &AcquireOutcome),
) -> Result<AcquireOutcome, RedisError> {
    let results = join_all(calls.iter().map(|c| scripts.decide_kept(c.slot, &c.keys, &c.args))).await;
    let mut replies = Vec::with_capacity(results.len());
    let mut failure = None;
    for (result, call) in results.into_iter().zip(&calls) {
        // Whether Redis still answers the call's slot.
        scripts.connection().saw(call.slot, &result);
        match result {
            Ok(reply) => replies.push(Some(reply)),
            Err(e) => {
                failure = Some(e);
                replies.push(None);
            }
        }
    }
    let answered = || replies.iter().flatten();
    let allowed = failure.is_none() && answered().all(|r| r.allowed);
    let shadow_allowed = failure.is_none() && answered().all(|r| r.shadow_allowed);
    let now_us = answered().map(|r| r.now_us).max().unwrap_or(0);
    let mut per_band: Vec<Option<BandReply>> = vec![None; request.band_count()];
    // Each band's mark: a token or leaky bucket's state from its call (a refund gives such
    // a band back only while it holds that state), a window's its call's instant.
    let mut marks = vec![0; request.band_count()];
    for (call, reply) in calls.iter().zip(&replies) {
        if let Some(reply) = reply {
            for (band, reply) in call.bands.iter().zip(reply.bands()) {
                per_band[band.position] = Some(reply);
            }
            for (band, &mark) in call.bands.iter().zip(&reply.marks) {
                marks[band.position] = mark;
            }
            // Each window band's own slot's instant: a lease's permits go back into the
            // window they were counted in, not the window of the latest slot's instant.
            mark_instants(&call.bands, &mut marks, reply.now_us);
        }
    }
    match refund(&scripts, &calls, &replies, &marks, allowed, shadow_allowed).await {
        Ok(refunded) => {
            for (position, after) in refunded {
                if let Some(band) = &mut per_band[position] {
                    band.remaining = after.remaining;
                    band.reset_after = after.reset_after;
                }
            }
        }
        // The decision stands; what could not be given back errs towards admitting less.
        Err(error) => tracing::warn!(%error, "rate-limit refund failed: a rejected request's consumption stays"),
    }
    // A slot that answered rejects the request: the request is rejected, whatever the failed
    // slot would have said, and no failure policy gets to admit it. The failed slot's bands,
    // of which nothing is known, are reported full and never binding. A slot that timed out
    // may still run its call late: its consumption then stays, erring towards rejecting.
    let partial = failure.is_some();
    if let Some(e) = failure {
        if !answered().any(|r| !r.allowed) {
            return Err(e);
        }
        tracing::warn!(error = %e, "a hash slot failed; another slot's rejection decides the request");
        for (position, (_, band)) in request.bands().enumerate() {
            per_band[position].get_or_insert(BandReply {
                allowed: true,
                remaining: band.capacity(),
                reset_after: std::time::Duration::ZERO,
                wait: fluxgate_core::limiter::Wait::None,
            });
        }
    }
    if let Some(position) = per_band.iter().position(Option::is_none) {
        return Err(RedisError::Reply(format!("no reply for band {position}")));
    }
    // Requests split across slots never wait (see `encode`).
    let marks = if request.marks_places() && allowed {
        marks
    } else {
        Vec::new()
    };
    let outcome = outcome(
        &request,
        (allowed, shadow_allowed),
        (now_us, 0),
        marks,
        per_band.into_iter().flatten(),
    );
    decided(&request, &calls, &outcome);
    // A slot failed: the answer is no evidence that the backend is healthy, so a circuit
    // breaker neither closes nor counts a success for it.
    Ok(if partial { outcome.answered_locally() } else { outcome })
}

/// The bands of a call that it committed and the request as a whole must not keep: every
/// band of a slot that admitted when another slot rejected (or failed), and the shadow
/// bands of a slot whose shadow rules admitted when another slot's shadow rules rejected.
fn to_refund<'a>(
    call: &'a Call,
    reply: &'a Reply,
    allowed: bool,
    shadow_allowed: bool,
) -> impl Iterator<Item = usize> + 'a {
    call.bands
        .iter()
        .zip(reply.bands())
        .enumerate()
        .filter(move |(_, (band, band_reply))| {
            let committed = reply.allowed && band_reply.allowed && (!band.shadow || reply.shadow_allowed);
            let keep = allowed && band_reply.allowed && (!band.shadow || shadow_allowed);
            committed && !keep
        })
        .map(|(j, _)| j)
}

/// Gives back what the slots of a request committed and the request must not keep, all
/// slots at once. Returns, per band position, the figures after the refund.
///
/// # Errors
///
/// The first error of a slot's refund: then no figures are returned.
async fn refund(
    scripts: &Scripts,
    calls: &[Call],
    replies: &[Option<Reply>],
    marks: &[u128],
    allowed: bool,
    shadow_allowed: bool,
) -> Result<Vec<(usize, RefundedBand)>, RedisError> {
    let mut pending = Vec::new();
    for (call, reply) in calls.iter().zip(replies) {
        let Some(reply) = reply else {
            continue; // this slot failed: it consumed nothing
        };
        // Each band refunded answers with its figures, in order (`Call::refund`).
        let bands: Vec<usize> = to_refund(call, reply, allowed, shadow_allowed)
            .filter(|&j| call.bands[j].refund().is_some())
            .collect();
        if bands.is_empty() {
            continue;
        }
        let positions: Vec<usize> = bands.iter().map(|&j| call.bands[j].position).collect();
        let (keys, args) = call.refund(bands, reply.now_us, marks, true);
        let call = scripts.refund(keys, args);
        pending.push(async move { (positions, call.await) });
    }
    if pending.is_empty() {
        return Ok(Vec::new());
    }
    // The calls start together: one deadline for all of them.
    let mut refunded = Vec::new();
    for (positions, result) in join_all(pending).await {
        refunded.extend(positions.into_iter().zip(result?.bands()));
    }
    Ok(refunded)
}
