//! The in-memory limiter forgets a bucket only when it counts nothing: a limiter whose idle
//! buckets are purged before every decision decides exactly as one that never forgets,
//! through every algorithm but the leaky bucket (whose grid starts over), bands of several windows, costs above 1, requests that wait
//! (token and leaky buckets in debt, windows with places in the next window, log entries
//! ahead of now), a rule whose window changed, and places and permits given back.

use std::time::Duration;

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate::core::{ManualClock, MemoryLimiter, Text};

use crate::support::app::five_algorithms_in_two_versions as versions;
use crate::support::rng::Rng;

fn show(o: &AcquireOutcome) -> String {
    let mut text = format!("{} {:?} {:?}", o.allowed, o.admitted_after, o.marks);
    for b in o.bands.iter() {
        text.push_str(&format!(
            " | {}/{} {} {} {:?} {:?}",
            b.rule, b.band, b.allowed, b.remaining, b.reset_after, b.wait
        ));
    }
    text
}

#[test]
fn purging_idle_buckets_changes_no_decision() {
    for seed in 1..=20u64 {
        let clock = ManualClock::new(1_700_000_000_123_456_789);
        let purged = MemoryLimiter::builder().shards(1).clock(clock.clone()).build();
        let kept = MemoryLimiter::builder().shards(1).clock(clock.clone()).build();
        let sets = versions();
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let (mut dropped, mut waited) = (0, 0);
        for step in 0..600 {
            let set = &sets[usize::from(rng.below_u64(5) == 0)];
            let mut request = AcquireRequest::new(set.clone());
            let count = 1 + rng.below_u64(3);
            let mut chosen = Vec::new();
            while (chosen.len() as u64) < count.min(3) {
                // Not the leaky bucket: its leak grid starts over once it is forgotten, a
                // documented difference that only ever refuses more (security.md, §9).
                let rule = [0, 1, 3, 4, 5][rng.below_u64(5) as usize];
                if !chosen.contains(&rule) {
                    chosen.push(rule);
                }
            }
            let max_wait = [0, 0, 500, 2_000, 4_000][rng.below_u64(5) as usize];
            for (index, &rule) in chosen.iter().enumerate() {
                request.push_permits(rule, Text::from("global"), 1 + rng.below_u64(3));
                request.set_max_wait(index, Duration::from_millis(max_wait));
            }
            dropped += purged.purge_idle();
            let a = purged.acquire_now(&request);
            let b = kept.acquire_now(&request);
            assert_eq!(show(&a), show(&b), "seed {seed}, step {step}");
            if a.allowed {
                waited += u32::from(!a.admitted_after.is_zero());
                if rng.below_u64(4) == 0 {
                    if a.admitted_after.is_zero() {
                        purged.give_back_now(&request, a.now_unix_nanos, None);
                        kept.give_back_now(&request, a.now_unix_nanos, None);
                    } else {
                        let at = a.now_unix_nanos + u64::try_from(a.admitted_after.as_nanos()).unwrap_or(0);
                        purged.give_back_now(&request, at, Some(&a.marks));
                        kept.give_back_now(&request, at, Some(&a.marks));
                    }
                }
            }
            clock.advance(Duration::from_millis(rng.below_u64(300)));
        }
        assert!(
            dropped > 50 && waited > 20,
            "seed {seed}: {dropped} purged, {waited} waited"
        );
    }
}
