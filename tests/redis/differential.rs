//! Differential tests: random request sequences run through the reference model
//! (`tests/support/model.rs`) and through a real limiter, the in-memory one on a
//! controlled clock and the Redis one in real time, every figure compared exactly.
//!
//! Each test prints its seed; a failure prints the seed, how to replay it and the minimal
//! failing case that proptest shrank it to. Replay with
//! `FLUXGATE_PROPTEST_SEED=<seed> cargo test --test redis differential`.

use std::cell::Cell;
use std::fmt::{self, Write as _};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::support::backend::{Backend, Memory};
use crate::support::conformance::{conformance_tests, every_rule, START_NANOS};
use crate::support::model::{self, Model, ModelBackend, ModelDecision, ModelWait, Tick, Unit};
use crate::support::redis::{Redis, Servers};
use fluxgate::core::limiter::{AcquireOutcome, Wait};
use fluxgate::core::{Algorithm, BandSpec, Clock, ManualClock, Mode, Rule, RuleSet, RuleSpec};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

// ---------------------------------------------------------------------------------------
// The generated cases.
// ---------------------------------------------------------------------------------------

const ALGORITHMS: [Algorithm; 5] = [
    Algorithm::TokenBucket,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowLog,
    Algorithm::SlidingWindowCounter,
];

const LABELS: [&str; 3] = ["burst", "mid", "long"];
const KEYS: [&str; 2] = ["k0", "k1"];

#[derive(Clone, Debug)]
struct BandGen {
    capacity: u64,
    window_ms: u64,
    labeled: bool,
}

#[derive(Clone, Debug)]
struct RuleGen {
    algorithm: Algorithm,
    bands: Vec<BandGen>,
    permits: u64,
    shadow: bool,
}

/// How far the clock moves before a step, worked out from the bands and the last decision.
#[derive(Clone, Copy)]
enum Advance {
    Zero,
    /// `k × W / C` of a band (a refill or leak interval), rounded down or up, plus `jitter`
    /// ticks.
    Interval {
        band: Index,
        k: u64,
        up: bool,
        jitter: i64,
    },
    /// To the `k`-th next aligned boundary of a band's window, plus `jitter` ticks.
    Boundary {
        band: Index,
        k: u64,
        jitter: i64,
    },
    /// `per_mille` of the shortest window.
    Small {
        per_mille: u64,
    },
    /// `per_mille` of twice the longest window.
    Large {
        per_mille: u64,
    },
    /// The longest retry-after of the last decision (else its longest reset), plus `jitter`.
    LastWait {
        jitter: i64,
    },
}

#[derive(Clone, Debug)]
struct StepGen {
    advance: Advance,
    key: usize,
}

#[derive(Clone)]
struct CaseGen {
    rules: Vec<RuleGen>,
    /// In memory: where the clock starts, in nanoseconds after a whole minute.
    start: u64,
    steps: Vec<StepGen>,
}

impl fmt::Debug for Advance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let j = |jitter: i64| match jitter {
            0 => String::new(),
            j => format!("{j:+}"),
        };
        match *self {
            Advance::Zero => write!(f, "0"),
            Advance::Interval { band, k, up, jitter } => write!(
                f,
                "{k}×W/C[{}]{}{}",
                band.index(usize::MAX),
                if up { "↑" } else { "↓" },
                j(jitter)
            ),
            Advance::Boundary { band, k, jitter } => write!(f, "boundary{k}[{}]{}", band.index(usize::MAX), j(jitter)),
            Advance::Small { per_mille } => write!(f, "{per_mille}‰ shortest"),
            Advance::Large { per_mille } => write!(f, "{per_mille}‰ 2×longest"),
            Advance::LastWait { jitter } => write!(f, "last wait{}", j(jitter)),
        }
    }
}

impl fmt::Debug for CaseGen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "rules:")?;
        for (i, r) in self.rules.iter().enumerate() {
            let bands: Vec<String> = r
                .bands
                .iter()
                .enumerate()
                .map(|(n, b)| {
                    let label = if b.labeled {
                        format!(" {}", LABELS[n])
                    } else {
                        String::new()
                    };
                    format!("{}/{}ms{label}", b.capacity, b.window_ms)
                })
                .collect();
            writeln!(
                f,
                "  r{i}: {}, permits {}{}, bands [{}]",
                r.algorithm.as_str(),
                r.permits,
                if r.shadow { ", shadow" } else { "" },
                bands.join(", ")
            )?;
        }
        writeln!(f, "start: +{} ns", self.start)?;
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|s| format!("{:?} {}", s.advance, KEYS[s.key]))
            .collect();
        write!(f, "steps: [{}]", steps.join(", "))
    }
}

/// What differs between the two tests' cases.
#[derive(Clone, Copy)]
struct Profile {
    redis: bool,
    steps: (usize, usize),
}

fn windows_ms(redis: bool) -> BoxedStrategy<u64> {
    if redis {
        // Real time: 20 ms to 2 s, mostly short.
        prop_oneof![
            6 => prop::sample::select(vec![20u64, 25, 30, 40, 50, 60, 75, 80, 100, 120, 150, 200, 250]),
            2 => 20u64..=300,
            1 => prop::sample::select(vec![400u64, 500, 750, 1000, 2000]),
        ]
        .boxed()
    } else {
        prop_oneof![
            3 => prop::sample::select(vec![1u64, 2, 3, 7, 10, 20, 50, 100, 250, 333, 1000, 1500, 2000, 60_000]),
            2 => 1u64..=5000,
        ]
        .boxed()
    }
}

fn band(redis: bool) -> impl Strategy<Value = BandGen> {
    let capacity = prop_oneof![9 => 1u64..=10, 1 => 11u64..=1000];
    (capacity, windows_ms(redis), prop::bool::weighted(0.3)).prop_map(|(capacity, window_ms, labeled)| BandGen {
        capacity,
        window_ms,
        labeled,
    })
}

fn rule(redis: bool) -> impl Strategy<Value = RuleGen> {
    (
        prop::sample::select(ALGORITHMS.to_vec()),
        prop::collection::vec(band(redis), 1..=3),
        prop::bool::weighted(0.15),
    )
        .prop_flat_map(|(algorithm, bands, shadow)| {
            let least = bands.iter().map(|b| b.capacity).min().unwrap_or(1);
            let most = bands.iter().map(|b| b.capacity).max().unwrap_or(1);
            // Up to one more than a capacity, so that some requests can never be admitted.
            let permits = prop_oneof![10 => Just(1u64), 4 => 1..=least, 1 => 1..=most, 1 => Just(least + 1)];
            (Just(algorithm), Just(bands), permits, Just(shadow))
        })
        .prop_map(|(algorithm, bands, permits, shadow)| RuleGen {
            algorithm,
            bands,
            permits,
            shadow,
        })
}

fn advance() -> impl Strategy<Value = Advance> {
    let jitter = || prop_oneof![2 => Just(0i64), 1 => -1i64..=1];
    prop_oneof![
        3 => Just(Advance::Zero),
        3 => (any::<Index>(), 1u64..=3, any::<bool>(), jitter())
            .prop_map(|(band, k, up, jitter)| Advance::Interval { band, k, up, jitter }),
        3 => (any::<Index>(), 1u64..=2, jitter()).prop_map(|(band, k, jitter)| Advance::Boundary { band, k, jitter }),
        3 => (0u64..1000).prop_map(|per_mille| Advance::Small { per_mille }),
        1 => (0u64..=1000).prop_map(|per_mille| Advance::Large { per_mille }),
        2 => jitter().prop_map(|jitter| Advance::LastWait { jitter }),
    ]
}

fn case(profile: Profile) -> impl Strategy<Value = CaseGen> {
    let start = prop_oneof![1 => Just(0u64), 3 => 0u64..60_000_000_000];
    let step = (advance(), prop_oneof![3 => Just(0usize), 1 => Just(1usize)])
        .prop_map(|(advance, key)| StepGen { advance, key });
    (
        prop::collection::vec(rule(profile.redis), 1..=3),
        start,
        prop::collection::vec(step, profile.steps.0..=profile.steps.1),
    )
        .prop_map(|(rules, start, steps)| CaseGen { rules, start, steps })
}

// ---------------------------------------------------------------------------------------
// Running a case.
// ---------------------------------------------------------------------------------------

fn rule_set(case: &CaseGen) -> RuleSet {
    let rules = case.rules.iter().enumerate().map(|(i, r)| {
        let bands = r
            .bands
            .iter()
            .enumerate()
            .map(|(n, b)| {
                let spec = BandSpec::new(b.capacity, Duration::from_millis(b.window_ms));
                if b.labeled {
                    spec.label(LABELS[n])
                } else {
                    spec
                }
            })
            .collect();
        let mut spec = RuleSpec::new(format!("r{i}"), bands);
        spec.algorithm = r.algorithm;
        spec.permits = r.permits;
        spec.mode = if r.shadow { Mode::Shadow } else { Mode::Enforce };
        Rule::from_spec("diff", spec).unwrap_or_else(|e| panic!("generated rule: {e}"))
    });
    RuleSet::new("diff", rules).unwrap_or_else(|e| panic!("generated rule set: {e}"))
}

/// Every band of the case as (capacity, window in ticks).
fn all_bands(case: &CaseGen, unit: Unit) -> Vec<(u64, Tick)> {
    case.rules
        .iter()
        .flat_map(|r| r.bands.iter())
        .map(|b| (b.capacity, unit.ticks(Duration::from_millis(b.window_ms))))
        .collect()
}

fn jittered(ticks: Tick, jitter: i64) -> Tick {
    ticks.saturating_add_signed(jitter)
}

/// The advance of a step in ticks, at `now`, after the model's `last` decision.
fn resolve(advance: Advance, bands: &[(u64, Tick)], now: Tick, last: Option<&ModelDecision>) -> Tick {
    let shortest = bands.iter().map(|b| b.1).min().unwrap_or(1);
    let longest = bands.iter().map(|b| b.1).max().unwrap_or(1);
    match advance {
        Advance::Zero => 0,
        Advance::Interval { band, k, up, jitter } => {
            let (c, w) = *band.get(bands);
            let t = u128::from(k) * u128::from(w);
            let q = t / u128::from(c) + u128::from(up && t % u128::from(c) != 0);
            jittered(u64::try_from(q).unwrap_or(u64::MAX), jitter)
        }
        Advance::Boundary { band, k, jitter } => {
            let (_, w) = *band.get(bands);
            jittered((now / w + k) * w - now, jitter)
        }
        Advance::Small { per_mille } => shortest * per_mille / 1000,
        Advance::Large { per_mille } => 2 * longest * per_mille / 1000,
        Advance::LastWait { jitter } => {
            let Some(last) = last else { return 0 };
            let wait = last
                .bands
                .iter()
                .filter_map(|b| match b.wait {
                    ModelWait::After(d) => Some(d),
                    _ => None,
                })
                .max();
            let reset = last.bands.iter().map(|b| b.reset_after).max().unwrap_or(0);
            jittered(wait.unwrap_or(reset), jitter)
        }
    }
}

fn show_wait(w: Wait) -> String {
    match w {
        Wait::None => "-".into(),
        Wait::After(d) => format!("{d:?}"),
        Wait::Never => "never".into(),
    }
}

/// One line per band: `allowed remaining reset wait`.
fn show(outcome: &AcquireOutcome) -> String {
    let mut s = format!("allowed {} shadow_allowed {}:", outcome.allowed, outcome.shadow_allowed);
    for b in &outcome.bands {
        let _ = write!(
            s,
            " [{}/{} {} rem {} reset {:?} wait {}]",
            b.rule,
            b.band,
            if b.allowed { "ok" } else { "no" },
            b.remaining,
            b.reset_after,
            show_wait(b.wait)
        );
    }
    s
}

/// Compares the limiter's outcome with the model's, field by field.
fn differences(expected: &AcquireOutcome, got: &AcquireOutcome) -> Vec<String> {
    let mut d = Vec::new();
    if expected.allowed != got.allowed {
        d.push(format!("allowed: model {}, limiter {}", expected.allowed, got.allowed));
    }
    if expected.shadow_allowed != got.shadow_allowed {
        d.push(format!(
            "shadow_allowed: model {}, limiter {}",
            expected.shadow_allowed, got.shadow_allowed
        ));
    }
    if expected.now_unix_nanos != got.now_unix_nanos {
        d.push(format!(
            "now: model {}, limiter {}",
            expected.now_unix_nanos, got.now_unix_nanos
        ));
    }
    if expected.bands.len() != got.bands.len() {
        d.push(format!(
            "bands: model {}, limiter {}",
            expected.bands.len(),
            got.bands.len()
        ));
    }
    for (e, g) in expected.bands.iter().zip(&got.bands) {
        let name = format!("{}/{}", e.rule, e.band);
        let mut field = |what: &str, e: String, g: String| {
            if e != g {
                d.push(format!("{name} {what}: model {e}, limiter {g}"));
            }
        };
        field("allowed", e.allowed.to_string(), g.allowed.to_string());
        field("remaining", e.remaining.to_string(), g.remaining.to_string());
        field(
            "reset_after",
            format!("{:?}", e.reset_after),
            format!("{:?}", g.reset_after),
        );
        field("wait", show_wait(e.wait), show_wait(g.wait));
        field(
            "identity (rule, band, labeled, limit, window, shadow)",
            format!("{:?}", (&e.rule, &e.band, e.labeled, e.limit, e.window, e.shadow)),
            format!("{:?}", (&g.rule, &g.band, g.labeled, g.limit, g.window, g.shadow)),
        );
        field("reset_at", format!("{:?}", e.reset_at), format!("{:?}", g.reset_at));
    }
    d
}

/// The steps run so far, for the failure message.
#[derive(Default)]
struct Trace {
    start: Option<Tick>,
    lines: Vec<String>,
}

impl Trace {
    fn step(&mut self, i: usize, key: &str, t: Tick, unit: Unit, outcome: &AcquireOutcome) {
        let start = *self.start.get_or_insert(t);
        self.lines.push(format!(
            "  step {i} at +{:?} key {key}: {}",
            unit.duration(t - start),
            show(outcome)
        ));
    }

    fn fail(
        &self,
        i: usize,
        key: &str,
        t: Tick,
        unit: Unit,
        expected: &AcquireOutcome,
        got: &AcquireOutcome,
    ) -> String {
        let start = self.start.unwrap_or(t);
        format!(
            "step {i} at +{:?} (t = {t} ticks of {}), key {key}:\n  {}\n model:   {}\n limiter: {}\nsteps before it (as both agreed):\n{}",
            unit.duration(t - start),
            match unit {
                Unit::Nanos => "1 ns",
                Unit::Micros => "1 µs",
            },
            differences(expected, got).join("\n  "),
            show(expected),
            show(got),
            self.lines.join("\n")
        )
    }
}

/// What the cases exercised, to show that they reach every kind of decision.
#[derive(Debug, Default)]
struct Stats {
    cases: Cell<usize>,
    steps: Cell<usize>,
    admitted: Cell<usize>,
    rejected: Cell<usize>,
    never: Cell<usize>,
    shadow_rejected: Cell<usize>,
    expired_leaky: Cell<usize>,
    /// Redis: steps left out once a case had slept its time budget.
    cut: Cell<usize>,
}

impl Stats {
    fn count(&self, outcome: &AcquireOutcome) {
        let add = |c: &Cell<usize>, yes: bool| c.set(c.get() + usize::from(yes));
        add(&self.steps, true);
        add(&self.admitted, outcome.allowed);
        add(&self.rejected, !outcome.allowed);
        add(&self.never, outcome.bands.iter().any(|b| b.wait == Wait::Never));
        add(&self.shadow_rejected, !outcome.shadow_allowed);
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} runs, {} steps: {} admitted, {} rejected, {} with a band that never admits, \
             {} rejected by a shadow rule, {} after a leaky bucket's key expired, \
             {} left out (time budget)",
            self.cases.get(),
            self.steps.get(),
            self.admitted.get(),
            self.rejected.get(),
            self.never.get(),
            self.shadow_rejected.get(),
            self.expired_leaky.get(),
            self.cut.get()
        )
    }
}

/// 2025-11-24T16:00:00Z in nanoseconds: a whole minute, so that `start` places the
/// clock within a minute-long window.
const BASE_NANOS: u64 = 1_764_000_000_000_000_000;

/// One case on the in-memory limiter, on a clock that moves only by the steps' advances.
fn run_memory(case: &CaseGen, stats: &Stats) -> Result<(), TestCaseError> {
    let set = Arc::new(rule_set(case));
    let clock = ManualClock::new(BASE_NANOS + case.start);
    let limiter = Memory::manual(clock.clone()).memory_limiter();
    let mut model = Model::new();
    let bands = all_bands(case, Unit::Nanos);
    let mut last: Option<ModelDecision> = None;
    let mut trace = Trace::default();
    for (i, step) in case.steps.iter().enumerate() {
        let advance = resolve(step.advance, &bands, clock.now_nanos(), last.as_ref());
        clock.advance(Duration::from_nanos(advance));
        let t = clock.now_nanos();
        let key = KEYS[step.key];
        let request = every_rule(&set, key);
        let got = limiter.acquire_now(&request);
        let decision = model.decide(&Model::buckets(&request, Unit::Nanos), t);
        let expected = model::report(&decision, &request, t, Unit::Nanos);
        last = Some(decision);
        if expected != got {
            return Err(TestCaseError::fail(trace.fail(i, key, t, Unit::Nanos, &expected, &got)));
        }
        trace.step(i, key, t, Unit::Nanos, &got);
        stats.count(&got);
    }
    Ok(())
}

fn wall_clock_micros() -> Tick {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970");
    u64::try_from(since.as_micros()).expect("microseconds within u64")
}

/// How close (µs) to a leaky bucket's key expiry a decision cannot be predicted: Redis
/// expires keys on its millisecond clock, read at other moments than the script's `TIME`.
const EXPIRY_MARGIN_US: Tick = 5_000;

/// The most a Redis case sleeps in all; the steps beyond it are not run.
const REDIS_CASE_BUDGET_US: Tick = 2_000_000;

/// One case on Redis, in real time: each step sleeps its advance, and the model decides
/// at the instant Redis decided at (the reply's `TIME`, in microseconds).
async fn run_redis(redis: &Redis, case: &CaseGen, stats: &Stats) -> Result<(), TestCaseError> {
    let set = Arc::new(rule_set(case));
    let limiter = redis.limiter();
    let mut model = Model::redis();
    let bands = all_bands(case, Unit::Micros);
    let mut last: Option<ModelDecision> = None;
    let mut trace = Trace::default();
    let mut now = wall_clock_micros();
    let mut slept = 0;
    for (i, step) in case.steps.iter().enumerate() {
        let key = KEYS[step.key];
        let request = every_rule(&set, key);
        let names: Vec<String> = Model::buckets(&request, Unit::Micros)
            .into_iter()
            .flat_map(|b| b.names)
            .collect();
        let advance = resolve(step.advance, &bands, now, last.as_ref());
        slept += advance;
        if slept > REDIS_CASE_BUDGET_US {
            stats.cut.set(stats.cut.get() + case.steps.len() - i);
            break;
        }
        // Keep clear of the instants at which a leaky bucket's key expires.
        let mut target = (now + advance).max(wall_clock_micros());
        for expiry in model.expiries(names.iter().map(String::as_str)) {
            if (expiry.saturating_sub(6 * EXPIRY_MARGIN_US)..=expiry + EXPIRY_MARGIN_US).contains(&target) {
                target = expiry + EXPIRY_MARGIN_US + 1_000;
            }
        }
        let wall = wall_clock_micros();
        if target > wall {
            tokio::time::sleep(Duration::from_micros(target - wall)).await;
        }
        let got = limiter
            .acquire(&request)
            .await
            .map_err(|e| TestCaseError::fail(format!("step {i}: Redis failed: {e}")))?;
        if got.now_unix_nanos % 1000 != 0 {
            return Err(TestCaseError::fail(format!(
                "step {i}: Redis's instant {} ns is not whole microseconds",
                got.now_unix_nanos
            )));
        }
        let t = got.now_unix_nanos / 1000;
        if last.is_some() && t < now {
            return Err(TestCaseError::reject("Redis's clock went backwards"));
        }
        if model
            .expiries(names.iter().map(String::as_str))
            .any(|e| e.abs_diff(t) <= EXPIRY_MARGIN_US)
        {
            return Err(TestCaseError::reject(
                "a decision too close to a leaky bucket's key expiry",
            ));
        }
        let expired = model.expiries(names.iter().map(String::as_str)).any(|e| e < t);
        let decision = model.decide(&Model::buckets(&request, Unit::Micros), t);
        let expected = model::report(&decision, &request, t, Unit::Micros);
        last = Some(decision);
        if expected != got {
            return Err(TestCaseError::fail(trace.fail(
                i,
                key,
                t,
                Unit::Micros,
                &expected,
                &got,
            )));
        }
        trace.step(i, key, t, Unit::Micros, &got);
        stats.count(&got);
        stats
            .expired_leaky
            .set(stats.expired_leaky.get() + usize::from(expired));
        now = t;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The runners.
// ---------------------------------------------------------------------------------------

const SEED_VAR: &str = "FLUXGATE_PROPTEST_SEED";

/// The seed: `FLUXGATE_PROPTEST_SEED` when set, else a random one.
fn seed() -> u64 {
    match std::env::var(SEED_VAR) {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{SEED_VAR}={s}: expected an unsigned 64-bit integer")),
        Err(_) => {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(SystemTime::now())
        }
    }
}

fn config(seed: u64, cases: u32, max_shrink_time_ms: u32) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        // Replays go by seed; nothing is written next to the sources.
        failure_persistence: None,
        max_shrink_time: max_shrink_time_ms,
        max_global_rejects: 64,
        ..Config::default()
    }
}

fn report(test: &str, seed: u64, result: Result<(), TestError<CaseGen>>) {
    let replay = format!("{SEED_VAR}={seed} cargo test --test redis {test}");
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, case)) => panic!(
            "{test}: the limiter and the model disagree (seed {seed}; replay: {replay})\n\
             minimal case:\n{case:?}\n{reason}"
        ),
        Err(TestError::Abort(reason)) => panic!("{test}: aborted (seed {seed}; replay: {replay}): {reason}"),
    }
}

#[test]
fn memory_limiter_agrees_with_the_model() {
    let seed = seed();
    eprintln!("memory_limiter_agrees_with_the_model: seed {seed}");
    let started = Instant::now();
    let mut runner = TestRunner::new(config(seed, 256, 60_000));
    let profile = Profile {
        redis: false,
        steps: (5, 40),
    };
    let stats = Stats::default();
    let result = runner.run(&case(profile), |case| {
        stats.cases.set(stats.cases.get() + 1);
        run_memory(&case, &stats)
    });
    eprintln!("memory_limiter_agrees_with_the_model: {:?}; {stats}", started.elapsed());
    report("memory_limiter_agrees_with_the_model", seed, result);
}

#[test]
fn redis_limiter_agrees_with_the_model() {
    let seed = seed();
    eprintln!("redis_limiter_agrees_with_the_model: seed {seed}");
    let started = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let redis = rt.block_on(Redis::scripts_only(Servers::standalone()));
    let stats = Stats::default();
    let mut runner = TestRunner::new(config(seed, 24, 90_000));
    let profile = Profile {
        redis: true,
        steps: (4, 16),
    };
    let result = runner.run(&case(profile), |case| {
        stats.cases.set(stats.cases.get() + 1);
        rt.block_on(run_redis(&redis, &case, &stats))
    });
    eprintln!("redis_limiter_agrees_with_the_model: {:?}; {stats}", started.elapsed());
    report("redis_limiter_agrees_with_the_model", seed, result);
}

// ---------------------------------------------------------------------------------------
// The model itself, against figures worked out by hand.
// ---------------------------------------------------------------------------------------

/// Every hand-worked figure of every case, from the model on a controlled clock.
mod model_conformance {
    use super::*;

    conformance_tests!(
        #[tokio::test]
        ModelBackend::new(ManualClock::new(START_NANOS))
    );
}

mod model_examples {
    use super::*;
    use crate::support::model::{BandSpec, BucketSpec};

    const S: Tick = 1_000_000_000;

    fn one(algorithm: Algorithm, capacity: u64, window: Tick, permits: u64) -> Vec<BucketSpec> {
        vec![BucketSpec {
            names: vec!["b".into()],
            bands: vec![BandSpec {
                algorithm,
                capacity,
                window,
            }],
            permits,
            shadow: false,
        }]
    }

    #[test]
    fn leaky_bucket_grid() {
        // docs/algorithms.md: capacity 1 per second; 0 s, 1.9 s and 2.1 s admitted, 2.5 s
        // waits for the leak at 3 s.
        let b = one(Algorithm::LeakyBucket, 1, S, 1);
        let mut m = Model::new();
        for t in [0, 1_900_000_000, 2_100_000_000] {
            assert!(m.decide(&b, t).allowed, "{t}");
        }
        let d = m.decide(&b, 2_500_000_000);
        assert!(!d.allowed);
        assert_eq!(d.bands[0].wait, ModelWait::After(500_000_000));
        assert_eq!(d.bands[0].reset_after, 500_000_000);
    }

    #[test]
    fn token_bucket_exact_refill() {
        // docs/algorithms.md: 10 per second with a request every 66 ms admits "70 in 6 s":
        // 10 + 59.4 tokens by the last request, at 5.94 s, so 69 (the library's own unit
        // test accepts 69 to 71).
        let b = one(Algorithm::TokenBucket, 10, S, 1);
        let mut m = Model::new();
        let admitted = (0..)
            .map(|i| i * 66_000_000)
            .take_while(|&t| t < 6 * S)
            .filter(|&t| m.decide(&b, t).allowed)
            .count();
        assert_eq!(admitted, 69);
        // 3 per second: a token every 333,333,333.3 ns, rounded up for a wait.
        let b = one(Algorithm::TokenBucket, 3, S, 1);
        let mut m = Model::new();
        for _ in 0..3 {
            assert!(m.decide(&b, 0).allowed);
        }
        assert_eq!(m.decide(&b, 0).bands[0].wait, ModelWait::After(333_333_334));
        // After exactly 1 s, exactly 3 more; at 1 s − 1 ns only 2.
        let three = one(Algorithm::TokenBucket, 3, S, 3);
        assert!(!m.decide(&three, S - 1).allowed);
        assert!(m.decide(&three, S).allowed);
    }

    #[test]
    fn sliding_window_counter_estimate() {
        // docs/algorithms.md: 5 per second, 5 at 0.95 s; at 1.05 s the previous 5 weigh
        // 4.75: rejected until 1.2 s (5 × 0.8 + 1 = 5).
        let b = one(Algorithm::SlidingWindowCounter, 5, S, 1);
        let mut m = Model::new();
        for _ in 0..5 {
            assert!(m.decide(&b, 950_000_000).allowed);
        }
        let d = m.decide(&b, 1_050_000_000);
        assert!(!d.allowed);
        assert_eq!(d.bands[0].remaining, 0);
        assert_eq!(d.bands[0].wait, ModelWait::After(150_000_000));
        assert_eq!(d.bands[0].reset_after, 950_000_000);
        assert!(!m.decide(&b, 1_199_999_999).allowed);
        let d = m.decide(&b, 1_200_000_000);
        assert!(d.allowed);
        // Current 1 of the window ending at 2 s: nothing counts from 3 s.
        assert_eq!(d.bands[0].reset_after, 1_800_000_000);
    }

    #[test]
    fn redis_forgets_an_expired_leaky_bucket() {
        // Capacity 2 per 100 ms (a leak every 50 ms), in µs: the key expires 1,101 ms after
        // the write, and the grid starts over at the next admitted request.
        let b = one(Algorithm::LeakyBucket, 2, 100_000, 1);
        let mut redis = Model::redis();
        let mut memory = Model::new();
        redis.decide(&b, 0);
        memory.decide(&b, 0);
        assert_eq!(redis.expiries(["b"]).collect::<Vec<_>>(), vec![1_101_000]);
        // Before the expiry the grid holds: at 1,000,025 µs the unit leaves at 1,050,000.
        assert_eq!(redis.decide(&b, 1_000_025).bands[0].reset_after, 49_975);
        // After it, on Redis only, a new grid: the unit leaves a whole interval later.
        let t = 1_000_025 + 1_101_001;
        assert_eq!(memory.decide(&b, t).bands[0].reset_after, 48_974);
        assert_eq!(redis.decide(&b, t).bands[0].reset_after, 50_000);
    }
}
