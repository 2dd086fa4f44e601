//! The engine decides a request by one of several paths: a rule set of one enforced rule of
//! one band directly, one bucket of one band, the one pass over token and leaky buckets,
//! the general path over any mix; keys known by their typed value or by their text; a
//! refusal or a wait for the refill. Every path must decide alike: random rules and random
//! sequences of requests and clock advances, run through engines whose rules differ only
//! by a shadow rule that never binds (which sends every request to another path), and
//! through one that keys by text, must give the same decisions, figure for figure.
//!
//! A failure prints the minimal case proptest shrank it to.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fluxgate_core::limiter::RateLimiter;
use fluxgate_core::{
    AddressDecision, Bands, Decision, Engine, ManualClock, MemoryLimiter, Outcome, RequestContext, RuleSets, WaitPolicy,
};
use http::Method;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::support::app::ALGORITHMS;

/// The shadow rule that never binds (a capacity no sequence here comes near), added last.
const NEUTRAL: &str = "zz-neutral";

const SCOPES: [&str; 8] = [
    "scope: ip",
    "scope: global",
    "scope: user, on_missing_key: skip",
    "scope: user, on_missing_key: fallback_ip",
    "scope: user, on_missing_key: deny",
    "scope: api_key",
    "scope: attribute, attribute: tenant",
    "scope: composite, fields: [ip, user], on_missing_key: fallback_ip",
];

const WINDOWS_MS: [u64; 4] = [100, 250, 1_000, 3_000];

/// The clients: IPv4 addresses, the same as IPv4-mapped IPv6 and under the NAT64
/// well-known prefix, IPv6 addresses of one /64 and of its neighbours, a neighbour of the
/// NAT64 prefix, and none.
const CLIENTS: [Option<&str>; 12] = [
    Some("192.0.2.1"),
    Some("192.0.2.2"),
    Some("::ffff:192.0.2.1"),
    Some("64:ff9b::192.0.2.1"),
    Some("64:ff9b::192.0.2.2"),
    Some("2001:db8:0:1::1"),
    Some("2001:db8:0:1:ffff::2"),
    Some("2001:db8:0:2::1"),
    Some("2001:db8:0:0:8000::1"),
    Some("64:ff9b:1::192.0.2.1"),
    Some("::192.0.2.1"),
    None,
];
const USERS: [Option<&str>; 3] = [None, Some("u0"), Some("ip=192.0.2.1")];
const API_KEYS: [Option<&str>; 2] = [None, Some("k0")];
const TENANTS: [Option<&str>; 3] = [None, Some("t0"), Some("t1")];
const PATHS: [&str; 4] = ["/api/a", "/other", "/api/../x", "/api//a/"];
const METHODS: [Method; 3] = [Method::GET, Method::POST, Method::HEAD];

#[derive(Clone, Debug)]
struct RuleGen {
    algorithm: usize,
    scope: usize,
    /// Capacity and window index of each band.
    bands: Vec<(u64, usize)>,
    permits: u64,
    shadow: bool,
    paths: bool,
    methods: bool,
    /// Its own wait for the refill (enforced rules only).
    wait: bool,
    disabled: bool,
}

#[derive(Clone, Debug)]
struct Step {
    advance_ms: u64,
    client: usize,
    user: usize,
    api_key: usize,
    tenant: usize,
    path: usize,
    method: usize,
}

#[derive(Clone, Debug)]
struct Case {
    rules: Vec<RuleGen>,
    /// The engine's wait for the refill (`wait_on_limit`).
    engine_wait: bool,
    steps: Vec<Step>,
}

fn rule_gen() -> impl Strategy<Value = RuleGen> {
    (
        0..ALGORITHMS.len(),
        0..SCOPES.len(),
        prop::collection::vec((1u64..=6, 0..WINDOWS_MS.len()), 1..=2),
        1u64..=2,
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(algorithm, scope, bands, permits, shadow, paths, methods, wait, disabled)| RuleGen {
                algorithm,
                scope,
                bands,
                permits,
                shadow,
                paths,
                methods,
                wait: wait && !shadow,
                disabled,
            },
        )
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop_oneof![3 => Just(0u64), 3 => 1u64..120, 1 => 120u64..3_500],
        0..CLIENTS.len(),
        0..USERS.len(),
        0..API_KEYS.len(),
        0..TENANTS.len(),
        0..PATHS.len(),
        0..METHODS.len(),
    )
        .prop_map(|(advance_ms, client, user, api_key, tenant, path, method)| Step {
            advance_ms,
            client,
            user,
            api_key,
            tenant,
            path,
            method,
        })
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(rule_gen(), 1..=3),
        prop::bool::weighted(0.15),
        prop::collection::vec(step(), 1..60),
    )
        .prop_map(|(rules, engine_wait, steps)| Case {
            rules,
            engine_wait,
            steps,
        })
}

/// The rule file of `rules`, with the neutral shadow rule of `neutral` (an algorithm) last.
fn yaml(rules: &[RuleGen], neutral: Option<&str>) -> String {
    let mut out = String::from("rule_sets:\n  - id: default\n    rules:\n");
    for (i, r) in rules.iter().enumerate() {
        // Every band admits a request's cost (a cost beyond a band is refused at load).
        let bands: Vec<String> = r
            .bands
            .iter()
            .map(|&(capacity, window)| {
                format!(
                    "{{ capacity: {}, window: {}ms }}",
                    capacity.max(r.permits),
                    WINDOWS_MS[window]
                )
            })
            .collect();
        out.push_str(&format!(
            "      - {{ id: r{i}, algorithm: {}, {}, permits: {}, bands: [{}]",
            ALGORITHMS[r.algorithm],
            SCOPES[r.scope],
            r.permits,
            bands.join(", ")
        ));
        if r.shadow {
            out.push_str(", mode: shadow");
        }
        match (r.paths, r.methods) {
            (true, true) => out.push_str(", match: { paths: [\"/api/*\"], methods: [GET] }"),
            (true, false) => out.push_str(", match: { paths: [\"/api/*\"] }"),
            (false, true) => out.push_str(", match: { methods: [GET] }"),
            (false, false) => {}
        }
        if r.wait {
            out.push_str(", on_limit: { wait: { max_wait: 2s, max_waiters: 1000 } }");
        }
        if r.disabled {
            out.push_str(", enabled: false");
        }
        out.push_str(" }\n");
    }
    if let Some(algorithm) = neutral {
        out.push_str(&format!(
            "      - {{ id: {NEUTRAL}, algorithm: {algorithm}, scope: global, mode: shadow, priority: -1000, \
             bands: [{{ capacity: 1000000000, window: 1h }}] }}\n"
        ));
    }
    out
}

fn context(step: &Step) -> RequestContext {
    let mut ctx = RequestContext::builder()
        .path(PATHS[step.path])
        .method(METHODS[step.method].clone());
    if let Some(ip) = CLIENTS[step.client] {
        ctx = ctx.client_ip(ip.parse::<IpAddr>().expect("an address"));
    }
    if let Some(user) = USERS[step.user] {
        ctx = ctx.user_id(user);
    }
    if let Some(key) = API_KEYS[step.api_key] {
        ctx = ctx.api_key(key);
    }
    if let Some(tenant) = TENANTS[step.tenant] {
        ctx = ctx.attribute("tenant", tenant);
    }
    ctx.build()
}

/// What a decision says, the neutral rule's shadow bands left out (and a request only it
/// applied to matched no rule).
fn view(d: &Decision) -> impl PartialEq + std::fmt::Debug {
    let shadow: Vec<_> = d.shadow_bands.iter().filter(|b| &*b.rule != NEUTRAL).cloned().collect();
    let outcome = match &d.outcome {
        Outcome::Admitted if d.bands.is_empty() && shadow.is_empty() => Outcome::NoMatchingRule,
        outcome => outcome.clone(),
    };
    (
        outcome,
        d.retry_after,
        d.binding_index,
        d.bands.iter().cloned().collect::<Vec<_>>(),
        shadow,
        d.shadow_rejected_by.clone(),
    )
}

/// Decisions of the fast engine over every case: admitted at once, refused, admitted after
/// a wait for the refill.
static SEEN: [AtomicUsize; 3] = [AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)];

/// Decisions `Engine::check_address` made (an engine of its own asks it first, and builds
/// on the context only when it gives way).
static BY_ADDRESS: AtomicUsize = AtomicUsize::new(0);

/// The decision `check_address` made, as `check` gives it: an admission by one band is a
/// decision of that band alone.
/// The figures the admitted band gives by itself must be its report's.
fn by_address(decision: AddressDecision<'_>, ctx: &RequestContext) -> Decision {
    match decision {
        AddressDecision::Admitted(band) => {
            let report = band.report();
            assert_eq!(
                (
                    band.limit(),
                    band.remaining(),
                    band.reset_after(),
                    band.reset_unix_secs()
                ),
                (
                    report.limit,
                    report.remaining,
                    report.reset_after,
                    report.reset_unix_secs()
                ),
                "{report:?}"
            );
            assert_eq!((band.rule().id(), band.band().name()), (&report.rule, &report.band));
            let mut decision = Decision::without_bands(ctx.rule_set_id().into(), Outcome::Admitted);
            decision.bands = Bands::from(vec![report]);
            decision.binding_index = Some(0);
            decision
        }
        AddressDecision::Decided(decision) => decision,
    }
}

/// Runs `case` through every engine; the first difference, if any.
fn run(case: &Case) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(1_700_000_000_000_000_000);
    let memory = || MemoryLimiter::builder().clock(clock.clone()).build();
    let rules = |neutral| RuleSets::from_yaml_str(&yaml(&case.rules, neutral)).expect("valid rules");
    let wait = WaitPolicy::new(Duration::from_secs(2), 1000).expect("a wait policy");
    let engine = |rules: RuleSets, limiter: Option<Arc<dyn RateLimiter>>| {
        let mut builder = Engine::builder(rules);
        builder = match limiter {
            Some(limiter) => builder.shared_limiter(limiter),
            None => builder.limiter(memory()),
        };
        if case.engine_wait {
            builder = builder.wait_on_limit(wait);
        }
        builder.build().expect("an engine")
    };
    let waits = case.engine_wait || case.rules.iter().any(|r| r.wait);
    let mut engines = vec![
        ("fast", engine(rules(None), None)),
        ("general", engine(rules(Some("fixed_window")), None)),
    ];
    if !waits {
        // A request refused that may wait leaves the one pass for the general path, where a
        // token bucket that has not reached the instant the request waits for takes no
        // place then: a shadow one of them keeps every shadow band from taking one, so
        // such a neutral rule is neutral only without waits.
        engines.push(("one pass", engine(rules(Some("token_bucket")), None)));
        // Keys by their text: the general path, without typed keys.
        engines.push((
            "by text",
            engine(rules(None), Some(Arc::new(crate::typed_keys::ByText(memory())))),
        ));
    }
    // Asked by `check_address` first (which decides a rule set of one address or global
    // rule of one band), by `check` when it gives way.
    let addressed = engine(rules(None), None);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    for (i, step) in case.steps.iter().enumerate() {
        clock.advance(Duration::from_millis(step.advance_ms));
        let ctx = context(step);
        let started = runtime.block_on(async { tokio::time::Instant::now() });
        let mut decisions: Vec<Decision> = engines
            .iter()
            .map(|(_, engine)| runtime.block_on(engine.check(&ctx)).expect("decided"))
            .collect();
        let address = ctx.client_ip();
        decisions.push(
            match addressed.check_address(ctx.rule_set_id(), ctx.method(), address, |d| by_address(d, &ctx)) {
                Some(decision) => {
                    BY_ADDRESS.fetch_add(1, Ordering::Relaxed);
                    decision
                }
                None => runtime.block_on(addressed.check(&ctx)).expect("decided"),
            },
        );
        let waited = runtime.block_on(async { started.elapsed() > Duration::ZERO });
        let seen = match (decisions[0].allowed(), waited) {
            (true, false) => 0,
            (false, _) => 1,
            (true, true) => 2,
        };
        SEEN[seen].fetch_add(1, Ordering::Relaxed);
        let names = engines.iter().map(|(name, _)| *name).chain(["by address"]);
        for (name, decision) in names.zip(&decisions).skip(1) {
            prop_assert_eq!(
                view(&decisions[0]),
                view(decision),
                "step {}: the fast path and the {} path disagree on {:?}\n{}",
                i,
                name,
                step,
                yaml(&case.rules, None)
            );
        }
    }
    Ok(())
}

#[test]
fn every_path_decides_as_the_general_one() {
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    if let Err(error) = runner.run(&case(), |case| run(&case)) {
        panic!("{error}");
    }
    // Every kind of decision was compared.
    let seen = SEEN.each_ref().map(|n| n.load(Ordering::Relaxed));
    assert!(seen.iter().all(|&n| n > 20), "admitted, refused, waited: {seen:?}");
}

/// Rule sets `Engine::check_address` decides (one enforced rule of one band, keyed by the
/// address or global, no path pattern, no wait), which few of the cases above are: decided
/// by every path as well.
#[test]
fn rule_sets_decided_by_address_decide_as_the_general_one() {
    let one = (rule_gen(), 0..2usize, prop::collection::vec(step(), 1..60)).prop_map(|(mut rule, scope, steps)| {
        rule.scope = scope; // `scope: ip` or `scope: global`
        rule.bands.truncate(1);
        (rule.shadow, rule.paths, rule.wait) = (false, false, false);
        Case {
            rules: vec![rule],
            engine_wait: false,
            steps,
        }
    });
    let before = BY_ADDRESS.load(Ordering::Relaxed);
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    if let Err(error) = runner.run(&one, |case| run(&case)) {
        panic!("{error}");
    }
    let by_address = BY_ADDRESS.load(Ordering::Relaxed) - before;
    assert!(by_address > 100, "only {by_address} decisions by address");
}
