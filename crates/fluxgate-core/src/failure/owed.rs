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
/// band holds, the backend would refuse the request for good. Read again when a debt is
/// carried ([`Owed::take`]): the rule in force then may hold less than the one that owed it.
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

    /// Adds what the buckets of `request` owe to their permits, for those `owes` picks: the
    /// backend's call takes them with the request. The debts stay until a request carrying
    /// them is admitted ([`Self::settle`]), so that requests made at once each carry them,
    /// and a refusal, a failure or a request dropped leaves them as they were. Whether it
    /// added any: one atomic load when nothing is owed.
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
            let id = id(&bucket);
            let Some(debt) = debts.get(&id).copied() else {
                continue;
            };
            if debt.until <= now {
                debts.remove(&id);
            } else {
                // At most what the rule in force leaves beside the cost: the rule may have
                // been tightened since memory admitted them, and a call the band can never
                // admit would refuse the bucket until the debt lapsed. The rest stays owed.
                let carried = debt.permits.min(room(&bucket));
                if carried > 0 {
                    request.set_permits(index, bucket.permits.saturating_add(carried));
                    took = true;
                }
            }
        }
        self.len.store(debts.len(), Ordering::Relaxed);
        took
    }

    /// The backend admitted `request`, which carried debts ([`Self::take`]: what a bucket
    /// takes beyond its rule's cost): they are paid. Requests made at once that carried the
    /// same debt each pay it, and the backend counts it as many times: the error is towards
    /// refusing.
    pub(crate) fn settle(&self, request: &AcquireRequest) {
        let paid: Vec<_> = request
            .buckets()
            .filter(|b| b.permits > b.rule.permits())
            .map(|b| (id(&b), b.permits - b.rule.permits()))
            .collect();
        if paid.is_empty() {
            return;
        }
        let mut debts = self.lock();
        for (id, permits) in paid {
            if let Some(debt) = debts.get_mut(&id) {
                debt.permits = debt.permits.saturating_sub(permits);
                if debt.permits == 0 {
                    debts.remove(&id);
                }
            }
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

    /// Debts are kept per key, carried whole by every call (at most what the smallest band
    /// holds beside the request's own cost) until one carrying them is admitted.
    #[test]
    fn debts_are_carried_by_every_call_until_one_is_admitted() {
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
        let mut at_once = request(&set, "a");
        assert!(
            owed.take(&mut at_once, |_| true),
            "carried by a request made at once too"
        );
        assert_eq!(permits(&at_once), Some(3));
        owed.settle(&a);
        let mut after = request(&set, "a");
        assert!(!owed.take(&mut after, |_| true), "paid by the admitted one");
        assert_eq!(permits(&after), Some(1));
        owed.settle(&at_once);
        assert!(
            !owed.take(&mut request(&set, "a"), |_| true),
            "paid twice: nothing owed"
        );
        let mut b = request(&set, "b");
        assert!(!owed.take(&mut b, |_| false), "nothing taken");
        assert_eq!(permits(&b), Some(1), "a bucket not picked takes nothing");
        owed.take(&mut b, |_| true);
        assert_eq!(permits(&b), Some(5), "at most the band's capacity in all");
    }
}
