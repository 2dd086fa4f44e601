//! The local deny cache: bands known to reject a request until an instant, answered
//! without Redis. Only time adds capacity to a band, refunds aside (a cluster's refunds
//! across hash slots, leases and waiters giving permits back), so a remembered denial
//! outlives the real one only after such a refund, and never admits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest, Wait};

use crate::request::{Call, CallBand};

/// Denials by deny-cache key (a band's key and the cost, see `key::cost_part`).
pub(crate) struct DenyCache {
    denials: moka::sync::Cache<String, Denial>,
    /// The instants are counted from here.
    epoch: Instant,
    /// The end of the latest denial remembered, in µs from `epoch` (rounded up): once it
    /// has passed, no denial holds and a request's bands need not be looked up.
    latest_us: AtomicU64,
}

/// A band that rejected: until `until` it rejects every request of the same cost, because
/// only time adds tokens to a bucket. A local rejection repeats Redis's figures: the
/// remaining permits and the instant the band is full again, on Redis's clock (the call's
/// instant on Redis's clock, `called_ns`, plus the time since on the process's monotonic
/// clock, `called_by`; the time to the reset counted down to `reset_by`), never on the
/// host's wall clock, which may lie far from Redis's.
///
/// A denial that a refund may end early (see [`DenyCache::remember`]) lets one request
/// through to Redis every so often (`probe`: when the next may go, in µs from the cache's
/// epoch); a request that finds the band admitting makes the cache forget the denial.
#[derive(Debug, Clone)]
struct Denial {
    until: Instant,
    probe: Option<(Arc<AtomicU64>, u64)>,
    remaining: u64,
    reset_by: Instant,
    /// Redis's instant of the call that learnt the denial, in ns since the epoch, and the
    /// process's instant it is counted from (before the call): a local answer's instant is
    /// the first plus the time since the second, so that it goes forward as Redis's would,
    /// also past `reset_by` (a denial may outlive the band's reset: a wait for a window
    /// after the next).
    called_ns: u64,
    called_by: Instant,
}

impl DenyCache {
    /// An empty cache.
    pub(crate) fn new() -> Self {
        Self {
            denials: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(Duration::from_secs(60))
                .support_invalidation_closures()
                .build(),
            epoch: Instant::now(),
            latest_us: AtomicU64::new(0),
        }
    }

    /// `at` in µs from the epoch, rounded up.
    fn micros(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.epoch);
        u64::try_from(since.as_micros()).unwrap_or(u64::MAX).saturating_add(1)
    }

    /// A rejection, when a band of the request is known to reject it. It repeats what Redis
    /// said of that band: its remaining permits and the instant it is full again; the
    /// retry-after counts down to the end of the denial.
    ///
    /// A request that may wait for the refill ([`Bucket::max_wait`](fluxgate_core::limiter::Bucket::max_wait))
    /// is refused by a denial that ends later than it may wait, as Redis would refuse it;
    /// a denial that ends within its wait lets it through to Redis, which takes its place.
    pub(crate) fn check(&self, request: &AcquireRequest, calls: &[Call], now: Instant) -> Option<AcquireOutcome> {
        self.check_probing(request, calls, now, true)
    }

    /// As [`check`](Self::check), but a denial whose probe is due refuses too, and the
    /// probe stays due: for a request that cannot reach Redis anyway (an open circuit), which
    /// would spend the probe and be left to the failure policy.
    pub(crate) fn check_without_probing(
        &self,
        request: &AcquireRequest,
        calls: &[Call],
        now: Instant,
    ) -> Option<AcquireOutcome> {
        self.check_probing(request, calls, now, false)
    }

    fn check_probing(
        &self,
        request: &AcquireRequest,
        calls: &[Call],
        now: Instant,
        probing: bool,
    ) -> Option<AcquireOutcome> {
        if self.latest_us.load(Ordering::Relaxed) <= self.micros(now) {
            return None; // every denial remembered has ended
        }
        let may_wait = request.may_wait();
        let (position, denial) = calls.iter().find_map(|call| {
            call.bands.iter().find_map(|band| {
                let key = band.deny_key(call.keys.get(band.key)?)?;
                let denial = self.denials.get(&key)?;
                if denial.until <= now {
                    return None;
                }
                if may_wait {
                    let (bucket, _) = request.bands().nth(band.position)?;
                    if denial.until - now <= bucket.max_wait() {
                        return None;
                    }
                }
                (!(probing && self.probes(&denial, now))).then_some((band.position, denial))
            })
        })?;
        let (bucket, band) = request.bands().nth(position)?;
        let wait = denial.until - now;
        let reset_after = denial.reset_by.saturating_duration_since(now);
        // Now on Redis's clock: the call's instant and the time since.
        let since = u64::try_from(now.saturating_duration_since(denial.called_by).as_nanos()).unwrap_or(u64::MAX);
        let now_ns = denial.called_ns.saturating_add(since);
        // Only the denying band is known; the others were not asked.
        let report = bucket.report(
            band,
            now_ns,
            denial.remaining,
            reset_after,
            Wait::After(wait.max(Duration::from_micros(1))),
        );
        Some(AcquireOutcome::new(false, true, now_ns, vec![report]).answered_locally())
    }

    /// Whether the request that found `denial` live at `now` goes to Redis as its probe: the
    /// first to find the probe due, which sets the next.
    fn probes(&self, denial: &Denial, now: Instant) -> bool {
        let Some((next, every_us)) = &denial.probe else {
            return false;
        };
        let now_us = self.micros(now);
        let due = next.load(Ordering::Acquire);
        now_us >= due
            && next
                .compare_exchange(
                    due,
                    now_us.saturating_add(*every_us),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Forgets the denials of the bands whose keys begin with `start` (a bucket reset).
    pub(crate) fn forget(&self, start: &str) {
        let start = start.to_owned();
        if self
            .denials
            .invalidate_entries_if(move |key, _| key.starts_with(&start))
            .is_err()
        {
            self.denials.invalidate_all();
        }
    }

    /// Forgets the denials of these deny-cache keys (bands whose permits were given back).
    pub(crate) fn forget_keys(&self, keys: &[String]) {
        for key in keys {
            self.denials.invalidate(key);
        }
    }

    /// Remembers the bands of a call of `request` (its keys named with `prefix`) that
    /// rejected, counted from `start`, before the call, so that a denial never outlives the
    /// real wait.
    ///
    /// With `probe`, the bands' capacity may come back before time frees it (on a cluster,
    /// refunds across hash slots): a denial then lets one request through to Redis every
    /// `probe`, and a band of the call that admitted makes the cache forget its denial.
    ///
    /// A request admitted for later (it waits for the refill) leaves no denial: its bands
    /// admit it, at the instant it proceeds.
    pub(crate) fn remember(
        &self,
        request: &AcquireRequest,
        prefix: &str,
        bands: &[CallBand],
        outcome: &AcquireOutcome,
        start: Instant,
        probe: Option<Duration>,
    ) {
        let admitted_later = outcome.allowed && request.may_wait();
        for band in bands {
            let report = &outcome.bands[band.position];
            let Wait::After(wait) = report.wait else {
                if probe.is_some() && report.allowed && self.latest_us.load(Ordering::Relaxed) > self.micros(start) {
                    if let Some(key) = band.deny_key_in(request, prefix) {
                        self.denials.invalidate(&key);
                    }
                }
                continue;
            };
            if admitted_later {
                continue;
            }
            if let Some(key) = band.deny_key_in(request, prefix) {
                let probe = probe.map(|every| {
                    let every_us = u64::try_from(every.as_micros()).unwrap_or(u64::MAX);
                    (Arc::new(AtomicU64::new(self.micros(start + every))), every_us)
                });
                let reset_ns = report
                    .reset_at
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
                let denial = Denial {
                    until: start + wait,
                    probe,
                    remaining: report.remaining,
                    reset_by: start + report.reset_after,
                    called_ns: reset_ns
                        .saturating_sub(u64::try_from(report.reset_after.as_nanos()).unwrap_or(u64::MAX)),
                    called_by: start,
                };
                self.latest_us.fetch_max(self.micros(denial.until), Ordering::Relaxed);
                self.denials.insert(key, denial);
            }
        }
    }
}
