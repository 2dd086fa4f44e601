//! Tests of the in-memory limiter.

use std::time::Duration;

use super::*;

/// An IPv4 address's hash keeps its low 32 bits a bijection of the address, and a
/// band's identity keeps them: no two addresses share a bucket of a band. Typed values
/// of other kinds, and IPv6 prefixes, hash apart.
#[test]
fn typed_addresses_never_share_a_bucket() {
    let typed = TypedHashes::new((0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210));
    let band = Band::new(3, Duration::from_secs(1)).unwrap();
    let mut seen = std::collections::HashSet::new();
    // Neighbouring addresses, and ones spread over the whole space.
    let addresses: std::collections::HashSet<u32> = (0..1u32 << 18)
        .chain((0..1u32 << 18).map(|i| i.wrapping_mul(0x9e37_79b9)))
        .collect();
    for &address in &addresses {
        let hash = typed.ipv4(address);
        let identity = hash.band(&band);
        assert_eq!(identity as u64 & (!0 >> 7), hash.low & (!0 >> 7));
        seen.insert(identity as u32);
    }
    assert_eq!(seen.len(), addresses.len());
    let v6 = |bits, prefix| typed.of(TypedKey::Ipv6 { bits, prefix }).unwrap().band(&band);
    let others = [
        typed.of(TypedKey::Global).unwrap().band(&band),
        typed.of(TypedKey::NoIp).unwrap().band(&band),
        v6(0x2001_0db8_0001 << 80, 48),
        v6(0x2001_0db8_0001 << 80, 64),
        v6(0x2001_0db8_0002 << 80, 64),
        typed.ipv4(0).band(&band),
    ];
    let distinct: std::collections::HashSet<_> = others.iter().collect();
    assert_eq!(distinct.len(), others.len());
    assert!(typed.of(TypedKey::Text).is_none());
}

/// SipHash-2-4-128 against the reference test vectors (key `00..0f`, message `00..`,
/// from the SipHash reference implementation's `vectors.h`): the same code with one
/// and three rounds is the limiter's hash.
#[test]
fn siphash_128_matches_the_reference_vectors() {
    let key = (0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);
    let message: Vec<u8> = (0..64).collect();
    for (len, expected) in [
        (0, "a3817f04ba25a8e66df67214c7550293"),
        (1, "da87c1d86b99af44347659119b22fc45"),
        (7, "a1f1ebbed8dbc153c0b84aa61ff08239"),
        (8, "3b62a9ba6258f5610f83e264f31497b4"),
        (15, "5493e99933b0a8117e08ec0f97cfc3d9"),
        (16, "6ee2a4ca67b054bbfd3315bf85230577"),
        (63, "5150d1772f50834a503e069a973fbd7c"),
    ] {
        let (first, second) = siphash128::<2, 4>(key, &message[..len]);
        let tag: String = first
            .to_le_bytes()
            .iter()
            .chain(&second.to_le_bytes())
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(tag, expected, "{len} bytes");
    }
    // Another key, another hash; one more byte, another hash.
    assert_ne!(siphash128::<1, 3>(key, b"ip=1"), siphash128::<1, 3>((1, 2), b"ip=1"));
    assert_ne!(siphash128::<1, 3>(key, b"ip=1"), siphash128::<1, 3>(key, b"ip=1\0"));
}
use crate::clock::ManualClock;
use crate::rule::{BandSpec, Rule, RuleSpec};

fn rule(cap: u64, secs: u64) -> Rule {
    Rule::from_spec(
        "s",
        RuleSpec::new("r", vec![BandSpec::new(cap, Duration::from_secs(secs))]),
    )
    .unwrap()
}

fn request(rule: &Rule, key: &str) -> AcquireRequest {
    let set = crate::rule::RuleSet::new("s", [rule.clone()]).unwrap();
    let mut request = AcquireRequest::new(Arc::new(set));
    request.push(0, key.into());
    request
}

#[test]
fn idle_buckets_are_swept_and_max_keys_holds() {
    let clock = ManualClock::new(1_000_000_000);
    let limiter = MemoryLimiter::builder()
        .shards(1)
        .max_keys(2_000)
        .clock(clock.clone())
        .build();
    let r = rule(10, 1);
    for i in 0..5_000 {
        assert!(limiter.acquire_now(&request(&r, &format!("k{i}"))).allowed);
    }
    assert!(limiter.len() <= 2_000, "{}", limiter.len());
    clock.advance(Duration::from_secs(2));
    assert!(limiter.purge_idle() > 0);
    assert_eq!(limiter.len(), 0);
}

/// A small `max_keys` does not leave the default shards (16 per core, 1,024 on a big
/// machine) a bucket or two each: a shard that holds one evicts it for any other key
/// landing there, and that client starts over full. 16 clients of a rule of 1 per hour,
/// within a `max_keys` of 32, are each admitted once, however many cores.
#[test]
fn a_small_max_keys_is_not_spread_over_shards_of_one_bucket() {
    let shards = |limiter: &MemoryLimiter| limiter.inner.shards.len();
    assert_eq!(shards(&MemoryLimiter::builder().max_keys(32).build()), 1);
    assert_eq!(shards(&MemoryLimiter::builder().max_keys(1_000).build()), 2);
    assert!(shards(&MemoryLimiter::builder().max_keys(100_000).build()) <= 256);
    // A count that is set is kept.
    assert_eq!(shards(&MemoryLimiter::builder().max_keys(32).shards(8).build()), 8);
    let clock = ManualClock::new(1_000_000_000);
    let limiter = MemoryLimiter::builder().max_keys(32).clock(clock).build();
    let r = rule(1, 3_600);
    let admitted = (0..10)
        .flat_map(|_| 0..16)
        .filter(|i| limiter.acquire_now(&request(&r, &format!("client{i}"))).allowed)
        .count();
    assert_eq!(admitted, 16, "buckets evicted and started over");
}

/// A rule of one band of `cap` per `secs` seconds, by `algorithm`.
fn one_band(algorithm: crate::rule::Algorithm, cap: u64, secs: u64) -> Rule {
    one_band_costing(algorithm, cap, secs, 1)
}

/// The same, each request costing `permits`.
fn one_band_costing(algorithm: crate::rule::Algorithm, cap: u64, secs: u64, permits: u64) -> Rule {
    let mut spec = RuleSpec::new("r", vec![BandSpec::new(cap, Duration::from_secs(secs))]);
    spec.algorithm = algorithm;
    spec.permits = permits;
    Rule::from_spec("s", spec).unwrap()
}

/// What another limiter admitted, charged in memory (the `fallback_local` rules'
/// buckets): the permits come off the band, and a charge past what the band holds
/// empties it without putting it in debt, with every algorithm.
#[test]
fn a_charge_takes_its_permits_and_empties_a_band_without_debt() {
    use crate::rule::Algorithm;
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
        Algorithm::SlidingWindowLog,
    ] {
        let (clock, limiter) = one_shard_of_1000();
        let r = one_band(algorithm, 10, 100);
        let charge = |key: &str, permits: u64| {
            let request = request(&r, key);
            let mut bucket = request.bucket(0).expect("one bucket");
            bucket.permits = permits;
            limiter.charge_bucket(&bucket);
        };
        let admitted = |key: &str| {
            (0..20)
                .filter(|_| limiter.acquire_now(&request(&r, key)).allowed)
                .count()
        };
        charge("part", 4);
        assert_eq!(admitted("part"), 6, "{algorithm:?}: 4 of 10 charged");
        charge("over", 25);
        assert_eq!(admitted("over"), 0, "{algorithm:?}: charged past its capacity");
        charge("over", 5);
        clock.advance(Duration::from_secs(200));
        assert_eq!(admitted("over"), 10, "{algorithm:?}: an emptied band is in no debt");
    }
}

/// A limiter of one shard of at most 1,000 keys, on a manual clock.
fn one_shard_of_1000() -> (ManualClock, MemoryLimiter) {
    let clock = ManualClock::new(1_000_000_000);
    let limiter = MemoryLimiter::builder()
        .shards(1)
        .max_keys(1_000)
        .clock(clock.clone())
        .build();
    (clock, limiter)
}

/// Exhausts the `victim`'s bucket in a shard of at most 1,000 keys, floods the shard with
/// 5,000 keys of `flood` a microsecond apart (each ranks differently by time), and
/// asserts that the victim's bucket was not evicted: it still refuses.
fn assert_a_flood_keeps_the_exhausted_bucket(victim: &Rule, flood: &Rule) {
    let (clock, limiter) = one_shard_of_1000();
    let capacity = victim.bands()[0].capacity();
    for _ in 0..capacity / victim.permits() {
        assert!(limiter.acquire_now(&request(victim, "victim")).allowed);
    }
    assert!(!limiter.acquire_now(&request(victim, "victim")).allowed);
    for i in 0..5_000 {
        clock.advance(Duration::from_micros(1));
        assert!(limiter.acquire_now(&request(flood, &format!("k{i}"))).allowed);
    }
    assert!(limiter.len() <= 1_000, "{}", limiter.len());
    assert!(
        !limiter.acquire_now(&request(victim, "victim")).allowed,
        "{:?} {capacity} per {:?} flooded by {:?}: the exhausted bucket was evicted and came back full",
        victim.algorithm(),
        victim.bands()[0].window(),
        flood.algorithm()
    );
}

/// At `max_keys`, a flood of made-up keys does not evict an exhausted bucket, which
/// would come back full: eviction drops the buckets that still count the fewest
/// permits, whatever their windows. A flood of buckets under a long window, each
/// counting one request, does not evict a login's minute; nor does a flood of minute
/// buckets, each exhausted by one request, evict a daily quota. So for windows.
#[test]
fn a_flood_of_made_up_keys_does_not_evict_an_exhausted_bucket() {
    use crate::rule::Algorithm::{FixedWindow, TokenBucket};
    // The victim's rule, then the flood's.
    for (victim, flood) in [
        (one_band(TokenBucket, 5, 60), one_band(TokenBucket, 1000, 86_400)),
        (one_band(TokenBucket, 20, 86_400), one_band(TokenBucket, 1, 60)),
        (one_band(FixedWindow, 5, 60), one_band(FixedWindow, 1000, 86_400)),
        (one_band(FixedWindow, 20, 86_400), one_band(FixedWindow, 1, 60)),
    ] {
        assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
    }
}

/// Buckets are ranked by the requests they still count, not their permits: a flood of
/// made-up keys of a rule whose requests cost 10 permits, each key counting one request
/// (10 permits), does not evict an exhausted bucket of 5 (5 permits, 5 requests), for
/// any algorithm. Before, it did, and the exhausted bucket came back full.
#[test]
fn a_flood_of_costly_requests_does_not_evict_an_exhausted_bucket() {
    for algorithm in crate::rule::Algorithm::ALL {
        let victim = one_band(algorithm, 5, 60);
        let flood = one_band_costing(algorithm, 1000, 86_400, 10);
        assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
        // And a victim whose own requests cost several permits.
        let victim = one_band_costing(algorithm, 20, 60, 4);
        assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
    }
}

/// A rule reloaded with a lower cost per request keeps its counters (the cost is not
/// part of their identity): a bucket its clients exhausted before, now counting 1024
/// requests of the new cost, still outranks a flood of made-up keys counting two each.
/// Before, a token or leaky bucket kept the interval class, and a window state the
/// weight, of the cost it was last written under (a log the one it was created under),
/// and a refused request wrote nothing: ranked 1024 times too low, the exhausted bucket
/// went first and came back full, for every algorithm. A refusal now ranks the state by
/// the band's cost ([`Shard::restamp`]).
#[test]
fn a_bucket_kept_across_a_cost_change_is_ranked_by_the_new_cost() {
    let mut evicted = Vec::new();
    for algorithm in crate::rule::Algorithm::ALL {
        let before = one_band_costing(algorithm, 1024, 60, 1024);
        let after = one_band_costing(algorithm, 1024, 60, 1);
        assert_eq!(before.bands()[0].ident(), after.bands()[0].ident());
        let flood = one_band(algorithm, 1000, 86_400);
        let (clock, limiter) = one_shard_of_1000();
        assert!(limiter.acquire_now(&request(&before, "victim")).allowed);
        assert!(!limiter.acquire_now(&request(&after, "victim")).allowed);
        for i in 0..5_000 {
            clock.advance(Duration::from_micros(1));
            for _ in 0..2 {
                assert!(limiter.acquire_now(&request(&flood, &format!("k{i}"))).allowed);
            }
        }
        if limiter.acquire_now(&request(&after, "victim")).allowed {
            evicted.push(algorithm);
        }
    }
    assert!(
        evicted.is_empty(),
        "{evicted:?}: the bucket exhausted before the cost changed was evicted and came back full"
    );
}

/// A window's state holds its rule's weight beside the variant's tag: no larger than
/// without it.
#[test]
fn a_window_state_with_its_weight_is_no_larger() {
    assert_eq!(std::mem::size_of::<Slot>(), 48);
}

/// The token and leaky buckets and the window states live in two tables of a shard:
/// a flood of one kind does not evict an exhausted bucket of the other, which it
/// outranks no more than it would one of its own kind.
#[test]
fn a_flood_of_another_algorithm_does_not_evict_an_exhausted_bucket() {
    use crate::rule::Algorithm::{FixedWindow, SlidingWindowLog, TokenBucket};
    for (victim, flood) in [
        (one_band(TokenBucket, 5, 60), one_band(FixedWindow, 1000, 86_400)),
        (one_band(FixedWindow, 5, 60), one_band(TokenBucket, 1000, 86_400)),
        (one_band(SlidingWindowLog, 5, 60), one_band(TokenBucket, 1000, 86_400)),
    ] {
        assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
    }
}

/// Eviction drops every bucket that counts fewer permits than the cut before any at
/// the cut, whatever order the table holds them in: an exhausted bucket does not go in
/// the place of one that counts a single request.
#[test]
fn eviction_drops_the_lightest_buckets_before_the_ties() {
    let clock = ManualClock::new(1_000_000_000);
    let limiter = MemoryLimiter::builder()
        .shards(1)
        .max_keys(100)
        .clock(clock.clone())
        .build();
    // 3 per minute: 90 exhausted buckets, then 10 that took one permit each.
    let r = rule(3, 60);
    for i in 0..90 {
        for _ in 0..3 {
            assert!(limiter.acquire_now(&request(&r, &format!("heavy{i}"))).allowed);
        }
    }
    for i in 0..10 {
        assert!(limiter.acquire_now(&request(&r, &format!("light{i}"))).allowed);
    }
    // One more bucket: 12 go, the 10 light ones and 2 exhausted ones.
    assert!(limiter.acquire_now(&request(&r, "new")).allowed);
    assert_eq!(limiter.len(), 89);
    let exhausted = (0..90)
        .filter(|i| !limiter.acquire_now(&request(&r, &format!("heavy{i}"))).allowed)
        .count();
    assert_eq!(exhausted, 88, "exhausted buckets evicted in place of lighter ones");
}

/// The three paths a request of `algorithm` takes, as rule sets of a band of
/// `per_second` per second: one band alone, one rule of two bands, two rules.
fn three_paths(algorithm: crate::rule::Algorithm, per_second: u64) -> [(&'static str, Arc<crate::rule::RuleSet>); 3] {
    let of = |id: &str, bands: Vec<BandSpec>| {
        let mut spec = RuleSpec::new(id, bands);
        spec.algorithm = algorithm;
        Rule::from_spec("s", spec).unwrap()
    };
    let second = || BandSpec::new(per_second, Duration::from_secs(1));
    let daily = || BandSpec::new(1000, Duration::from_secs(86_400));
    let set = |rules| Arc::new(crate::rule::RuleSet::new("s", rules).unwrap());
    [
        ("one band", set(vec![of("r", vec![second()])])),
        ("two bands", set(vec![of("r", vec![second(), daily()])])),
        (
            "two rules",
            set(vec![of("r", vec![second()]), of("daily", vec![daily()])]),
        ),
    ]
}

/// A request of key `k` to every rule of `set`.
fn every_rule(set: &Arc<crate::rule::RuleSet>) -> AcquireRequest {
    let mut request = AcquireRequest::new(set.clone());
    for i in 0..set.rules().len() {
        request.push(i, "k".into());
    }
    request
}

/// A clock that a thread named `stalled` reads, then stalls on (until released, or
/// for 300 ms when it holds a lock the others need): what a preempted thread, or one
/// waiting for a shard's lock, does between reading the clock and deciding.
#[derive(Debug, Clone)]
struct StallingClock {
    now: ManualClock,
    read: Arc<std::sync::Barrier>,
    released: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl Clock for StallingClock {
    fn now_nanos(&self) -> u64 {
        let now = self.now.now_nanos();
        if std::thread::current().name() == Some("stalled") {
            self.read.wait();
            let (released, signal) = &*self.released;
            let guard = released.lock().unwrap();
            let _ = signal
                .wait_timeout_while(guard, Duration::from_millis(300), |r| !*r)
                .unwrap();
        }
        now
    }
}

/// A request that read the clock before another decided at a later instant is decided
/// after it, at that later instant: a fixed window or a sliding window counter does
/// not count it in the window that had ended, and does not lose the new window's
/// count to it. For every path: one band, one rule of two bands, two rules.
#[test]
fn a_request_that_read_the_clock_before_another_decided_counts_after_it() {
    use crate::rule::Algorithm::{FixedWindow, SlidingWindowCounter};
    for algorithm in [FixedWindow, SlidingWindowCounter] {
        for (shape, set) in three_paths(algorithm, 2) {
            let request = || every_rule(&set);
            const SEC: u64 = 1_000_000_000;
            let clock = ManualClock::new(1_000 * SEC);
            let read = Arc::new(std::sync::Barrier::new(2));
            let released = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
            let limiter = MemoryLimiter::builder()
                .clock(StallingClock {
                    now: clock.clone(),
                    read: read.clone(),
                    released: released.clone(),
                })
                .build();
            // 2 per second: the window of second 1000 is spent by its first half.
            clock.advance(Duration::from_millis(500));
            let mut admitted = 0;
            for _ in 0..3 {
                admitted += u32::from(limiter.acquire_now(&request()).allowed);
            }
            // One request reads the clock late in the second, and stalls.
            clock.advance(Duration::from_millis(499));
            let stalled = {
                let (limiter, request) = (limiter.clone(), request());
                std::thread::Builder::new()
                    .name("stalled".into())
                    .spawn(move || limiter.acquire_now(&request).allowed)
                    .unwrap()
            };
            read.wait();
            // Meanwhile the next second begins, and its requests are decided.
            clock.advance(Duration::from_millis(1));
            for _ in 0..3 {
                admitted += u32::from(limiter.acquire_now(&request()).allowed);
            }
            *released.0.lock().unwrap() = true;
            released.1.notify_all();
            admitted += u32::from(stalled.join().unwrap());
            for _ in 0..3 {
                admitted += u32::from(limiter.acquire_now(&request()).allowed);
            }
            // Two in the window of second 1000; in second 1001, at its first
            // millisecond, a sliding window counter still counts nearly all of the
            // previous one's two, and admits nothing; a fixed window admits two.
            let expected = if algorithm == FixedWindow { 4 } else { 2 };
            assert_eq!(admitted, expected, "{algorithm:?}, {shape}");
        }
    }
}

/// A clock read on two cores whose time-stamp counters disagree (as quanta reads them on
/// some machines): every other reading is a little ahead, across a window's end.
#[derive(Debug)]
struct TwoCoresClock {
    behind: u64,
    ahead: u64,
    reads: std::sync::atomic::AtomicU64,
}

impl Clock for TwoCoresClock {
    fn now_nanos(&self) -> u64 {
        if self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 2 == 0 {
            self.behind
        } else {
            self.ahead
        }
    }
}

/// A clock that goes back between two readings (two cores' counters apart) never makes
/// a bucket count anew: decisions in a shard are made at instants that never go back, so
/// at most the two windows the readings fall in are counted, for every algorithm and
/// every path (one band, one rule of two bands, two rules).
#[test]
fn a_clock_that_goes_back_between_readings_admits_no_more() {
    const SEC: u64 = 1_000_000_000;
    for algorithm in crate::rule::Algorithm::ALL {
        for (shape, set) in three_paths(algorithm, 5) {
            let limiter = MemoryLimiter::builder()
                .clock(TwoCoresClock {
                    behind: 1_000 * SEC - 1_000_000,
                    ahead: 1_000 * SEC + 1_000_000,
                    reads: 0.into(),
                })
                .build();
            let admitted = (0..100)
                .filter(|_| limiter.acquire_now(&every_rule(&set)).allowed)
                .count();
            assert!(
                admitted <= 10,
                "{algorithm:?}, {shape}: {admitted} admitted of 5 per second"
            );
        }
    }
}

/// A clock read on whichever core a caller runs on, as the test sets it.
#[derive(Debug, Default)]
struct SetClock(std::sync::atomic::AtomicU64);

impl SetClock {
    fn set(&self, nanos: u64) {
        self.0.store(nanos, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Clock for Arc<SetClock> {
    fn now_nanos(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// `purge_idle` read on a core whose counter is ahead sweeps a bucket as idle at that
/// instant: the shard's next decisions, read on a core behind it, are made at no
/// earlier an instant than the sweep's, or the swept bucket counts anew in the window
/// it was exhausted in (a fixed window of 5 per second admitted 5 more at each sweep).
#[test]
fn a_sweep_on_a_clock_ahead_makes_no_bucket_count_anew() {
    const SEC: u64 = 1_000_000_000;
    for algorithm in crate::rule::Algorithm::ALL {
        let [(_, set), ..] = three_paths(algorithm, 5);
        let clock = Arc::new(SetClock::default());
        let limiter = MemoryLimiter::builder().shards(1).clock(clock.clone()).build();
        let (behind, ahead) = (1_000 * SEC - 1_000_000, 1_002 * SEC - 1_000_000);
        let mut admitted = 0;
        for _ in 0..10 {
            clock.set(behind);
            for _ in 0..10 {
                admitted += usize::from(limiter.acquire_now(&every_rule(&set)).allowed);
            }
            clock.set(ahead);
            limiter.purge_idle();
        }
        assert!(admitted <= 10, "{algorithm:?}: {admitted} admitted of 5 per second");
    }
}

/// One reading far ahead (a core's counter an hour off, once) is the instant of every
/// later decision in its shard until the clock catches up: the shard's time stands
/// still, and every other client of the shard gets one burst of its capacity for that
/// hour (here 1 of the 10 a rule of 1 per second admits over 10 seconds). Before, the
/// reading made only its own request's buckets wait. A design question: how far behind
/// the latest instant a reading may be and still be the clock's (a bound on the skew
/// tolerated) is not settled.
#[test]
#[ignore = "design question: a single reading far ahead stands a shard's time still; no bound on the skew tolerated yet"]
fn a_single_reading_far_ahead_does_not_stand_a_shard_still() {
    const SEC: u64 = 1_000_000_000;
    let clock = Arc::new(SetClock::default());
    let limiter = MemoryLimiter::builder().shards(1).clock(clock.clone()).build();
    let r = rule(1, 1);
    clock.set(1_000 * SEC + 3_600 * SEC);
    assert!(limiter.acquire_now(&request(&r, "a")).allowed);
    let admitted = (0..10)
        .filter(|i| {
            clock.set(1_000 * SEC + i * SEC);
            limiter.acquire_now(&request(&r, "b")).allowed
        })
        .count();
    assert_eq!(
        admitted, 10,
        "another key of the shard, one request a second at 1 per second"
    );
}

/// The one pass over token buckets writes each band as it goes: a request another band
/// refuses leaves every band it wrote as it was, a new key's bucket included.
#[test]
fn a_refused_request_leaves_the_bands_it_wrote_as_they_were() {
    use crate::rule::RuleSet;
    let limiter = MemoryLimiter::builder().clock(ManualClock::new(1_000_000_000)).build();
    let hourly = Rule::from_spec(
        "s",
        RuleSpec::new("hourly", vec![BandSpec::new(1, Duration::from_secs(3600))]),
    )
    .unwrap();
    let set = Arc::new(RuleSet::new("s", [rule(10, 1), hourly]).unwrap());
    let request = |key: &str| {
        let mut request = AcquireRequest::new(set.clone());
        request.push(0, key.into());
        request.push(1, "shared".into());
        request
    };
    let first = limiter.acquire_now(&request("old"));
    assert!(first.allowed);
    assert_eq!(first.bands[0].remaining, 9);
    let buckets = limiter.len();
    // The second rule's only permit is gone: refused, after the first rule's band took
    // one from a key it had seen and from a key it had not.
    for key in ["old", "new"] {
        let refused = limiter.acquire_now(&request(key));
        assert!(!refused.allowed, "{key}");
        let expected = if key == "old" { 9 } else { 10 };
        assert_eq!(refused.bands[0].remaining, expected, "{key}: the band as it stays");
        assert_eq!(limiter.len(), buckets, "{key}: no bucket left behind");
    }
    let mut alone = AcquireRequest::new(set.clone());
    alone.push(0, "old".into());
    assert_eq!(limiter.acquire_now(&alone).bands[0].remaining, 8, "nothing taken twice");
}

#[test]
fn a_rule_in_two_rule_sets_has_two_counters() {
    use crate::rule::RuleSet;
    let limiter = MemoryLimiter::default();
    let shared = rule(1, 3600);
    let a = RuleSet::new("a", [shared.clone()]).unwrap();
    let b = RuleSet::new("b", [shared]).unwrap();
    for set in [a, b] {
        let id = set.id().clone();
        let mut request = AcquireRequest::new(Arc::new(set));
        request.push(0, "k".into());
        assert!(limiter.acquire_now(&request).allowed, "{id}");
    }
}

#[test]
fn sweeping_does_not_forget_active_buckets() {
    let clock = ManualClock::new(1_000_000_000);
    let limiter = MemoryLimiter::builder()
        .shards(1)
        .max_keys(1_000_000)
        .clock(clock.clone())
        .build();
    let (hourly, per_second) = (rule(1, 3600), rule(10, 1));
    let hot = request(&hourly, "hot");
    assert!(limiter.acquire_now(&hot).allowed);
    for i in 0..10_000 {
        limiter.acquire_now(&request(&per_second, &format!("k{i}")));
        clock.advance(Duration::from_millis(1));
    }
    assert!(!limiter.acquire_now(&hot).allowed, "an active bucket was forgotten");
}
