//! [`Owed`]: what the in-memory fallback admitted for `fallback_local` rules while the
//! backend failed, kept until the backend counts it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::limiter::{AcquireRequest, Bucket};
use crate::name::Name;

/// The most buckets with permits owed at once: past it, what the fallback admits for a new
/// bucket is not sent to the backend later (the bound of security.md, section 5, without
/// this correction).
const MOST: usize = 100_000;

/// Per bucket (rule set, rule, key), the permits the in-memory fallback admitted while the
/// backend failed and the backend has not counted yet. The backend's next call for the
/// bucket takes them with the request's own permits ([`Owed::take`]), so that after an
/// outage the backend does not admit again what memory admitted meanwhile. A debt lapses
/// after its rule's longest window: by then the backend would have refilled it.
#[derive(Debug, Default)]
pub(crate) struct Owed {
    /// The buckets in `debts`, read without the lock on every call of the backend.
    len: AtomicUsize,
    debts: Mutex<HashMap<(Name, Name, String), Debt>>,
}

#[derive(Debug, Clone, Copy)]
struct Debt {
    permits: u64,
    until: Instant,
}

/// The bucket's identity among the debts.
fn id(bucket: &Bucket<'_>) -> (Name, Name, String) {
    (
        bucket.rule_set.id().clone(),
        bucket.rule.id().clone(),
        bucket.key.as_str().to_owned(),
    )
}

/// How long a debt of `bucket`'s rule lasts: its longest window.
fn lasts(bucket: &Bucket<'_>) -> Duration {
    bucket.rule.bands().iter().map(|b| b.window()).max().unwrap_or_default()
}

/// The most a call of `bucket` may take on top of its own permits: more than its smallest
/// band holds, the backend would refuse the request for good.
fn room(bucket: &Bucket<'_>) -> u64 {
    let smallest = bucket.rule.bands().iter().map(|b| b.capacity()).min().unwrap_or(0);
    smallest.saturating_sub(bucket.rule.permits())
}

impl Owed {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Name, Name, String), Debt>> {
        self.debts.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records that memory admitted `bucket`'s request (its rule's permits).
    pub(crate) fn add(&self, bucket: &Bucket<'_>) {
        let now = Instant::now();
        let mut debts = self.lock();
        if debts.len() >= MOST {
            debts.retain(|_, debt| debt.until > now);
        }
        let until = now.checked_add(lasts(bucket)).unwrap_or(now);
        let room = room(bucket);
        let id = id(bucket);
        let full = debts.len() >= MOST;
        match debts.get_mut(&id) {
            Some(debt) if debt.until > now => {
                debt.permits = debt.permits.saturating_add(bucket.rule.permits()).min(room);
                debt.until = until;
            }
            Some(debt) => {
                *debt = Debt {
                    permits: bucket.rule.permits().min(room),
                    until,
                };
            }
            None if full => return,
            None => {
                debts.insert(
                    id,
                    Debt {
                        permits: bucket.rule.permits().min(room),
                        until,
                    },
                );
            }
        }
        self.len.store(debts.len(), Ordering::Relaxed);
    }

    /// Adds what the buckets of `request` owe to their permits, for those `owes` picks,
    /// and forgets the debts: the backend's call now takes them. A request the backend
    /// does not admit gives them back ([`Self::put_back`]). Returns whether it added any.
    pub(crate) fn take(&self, request: &mut AcquireRequest, owes: impl Fn(&Bucket<'_>) -> bool) -> bool {
        if self.len.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let mut took = false;
        let now = Instant::now();
        let mut debts = self.lock();
        for index in 0..request.len() {
            let Some(bucket) = request.bucket(index).filter(|b| owes(b)) else {
                continue;
            };
            let Some(debt) = debts.remove(&id(&bucket)) else {
                continue;
            };
            if debt.until > now && debt.permits > 0 {
                let permits = bucket.permits.saturating_add(debt.permits);
                request.set_permits(index, permits);
                took = true;
            }
        }
        self.len.store(debts.len(), Ordering::Relaxed);
        took
    }

    /// Gives back the debts [`Self::take`] added to `request`'s permits (what a bucket
    /// takes beyond its rule's cost), when the backend did not admit it.
    pub(crate) fn put_back(&self, request: &AcquireRequest) {
        let owed: Vec<_> = request
            .buckets()
            .filter(|b| b.permits > b.rule.permits())
            .map(|b| (id(&b), b.permits - b.rule.permits(), lasts(&b), room(&b)))
            .collect();
        if owed.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut debts = self.lock();
        for (id, permits, lasts, room) in owed {
            let until = now.checked_add(lasts).unwrap_or(now);
            let debt = debts.entry(id).or_insert(Debt { permits: 0, until });
            debt.permits = debt.permits.saturating_add(permits).min(room);
            debt.until = debt.until.max(until);
        }
        self.len.store(debts.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::rule::{BandSpec, Rule, RuleSet, RuleSpec};

    fn request(set: &Arc<RuleSet>, key: &str) -> AcquireRequest {
        let mut request = AcquireRequest::new(set.clone());
        request.push(0, key.into());
        request
    }

    /// Debts are kept per key, taken whole by the next call (at most what the smallest
    /// band holds beside the request's own cost), and given back when it is not admitted.
    #[test]
    fn debts_are_taken_by_the_next_call_and_given_back_when_it_is_refused() {
        let spec = RuleSpec::new("r", vec![BandSpec::new(5, Duration::from_secs(60))]);
        let rule = Rule::from_spec("s", spec).expect("a valid rule");
        let set = Arc::new(RuleSet::new("s", [rule]).expect("a valid rule set"));
        let owed = Owed::default();
        let permits = |r: &AcquireRequest| r.bucket(0).map(|b| b.permits);
        for _ in 0..2 {
            owed.add(&request(&set, "a").bucket(0).expect("a bucket"));
        }
        for _ in 0..9 {
            owed.add(&request(&set, "b").bucket(0).expect("a bucket"));
        }
        let mut a = request(&set, "a");
        assert!(owed.take(&mut a, |_| true), "a debt taken");
        assert_eq!(permits(&a), Some(3), "its own permit and the 2 memory admitted");
        let mut again = request(&set, "a");
        assert!(!owed.take(&mut again, |_| true), "none left");
        assert_eq!(permits(&again), Some(1), "a debt is taken once");
        owed.put_back(&a);
        let mut after_refusal = request(&set, "a");
        owed.take(&mut after_refusal, |_| true);
        assert_eq!(permits(&after_refusal), Some(3), "a refused call gives its debt back");
        let mut b = request(&set, "b");
        assert!(!owed.take(&mut b, |_| false), "nothing taken");
        assert_eq!(permits(&b), Some(1), "a bucket not picked takes nothing");
        owed.take(&mut b, |_| true);
        assert_eq!(permits(&b), Some(5), "at most the band's capacity in all");
    }
}
