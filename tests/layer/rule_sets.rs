//! Rule sets chosen by the request (a customizer reading `X-Tenant`). Most tests look them
//! up through a `CachingRuleSetProvider` in front of a store that is what a real one is: a
//! pool of a few connections, a deadline to get one (a lookup that cannot get a connection
//! in time fails, as the pools of fred, sqlx or the MongoDB driver do), and some latency per
//! lookup. The engine refuses unknown ids (`UnknownRuleSet::Deny`) and the layer keeps its
//! default `on_error`, `fail_open`. These tests run on a paused clock: the store's latency,
//! its pool's deadline and the provider's lookup timeout are tokio timers.
//!
//! The last tests, on tokio's own clock, take an id the rules do not have under either
//! `UnknownRuleSet`, and under either `on_error` while a store that can be cut off is down;
//! and a layer whose own `rule_set` its engine does not have.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use fluxgate::core::{
    CachingRuleSetProvider, Engine, MaybeReady, RuleSetLookup, RuleSetProvider, RuleSets, UnknownRuleSet,
};
use fluxgate::FailurePolicy;
use http::{Request, StatusCode};

use crate::support::app::{app, layer, request, send, Reply};
use crate::{builder, engine, support};

/// Two tenants, each 5 requests per hour per client address.
const TENANTS: &str = r#"
rule_sets:
  - id: acme
    rules: [{ id: per-ip, bands: [{ capacity: 5, window: 1h }] }]
  - id: globex
    rules: [{ id: per-ip, bands: [{ capacity: 5, window: 1h }] }]
"#;

/// The store's connections, how long a lookup waits for one, and how long a lookup takes.
const POOL: usize = 4;
const CHECKOUT: Duration = Duration::from_millis(50);
const LATENCY: Duration = Duration::from_millis(5);

/// A rule store with a pool of [`POOL`] connections, that can be made slower or to hang.
/// Counts its lookups (by id), those that failed, and the most under way at once.
#[derive(Debug)]
struct Store {
    sets: Mutex<RuleSets>,
    pool: Arc<tokio::sync::Semaphore>,
    /// A lookup's latency in ms beyond [`LATENCY`].
    slower_ms: AtomicU64,
    hang: Arc<AtomicBool>,
    lookups: Arc<Mutex<HashMap<String, usize>>>,
    under_way: Arc<AtomicUsize>,
    most_under_way: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
}

impl Store {
    fn new() -> Self {
        Self {
            sets: Mutex::new(RuleSets::from_yaml_str(TENANTS).expect("rules")),
            pool: Arc::new(tokio::sync::Semaphore::new(POOL)),
            slower_ms: AtomicU64::new(0),
            hang: Arc::default(),
            lookups: Arc::default(),
            under_way: Arc::default(),
            most_under_way: Arc::default(),
            failed: Arc::default(),
        }
    }

    fn lookups_of(&self, id: &str) -> usize {
        self.lookups.lock().expect("lock").get(id).copied().unwrap_or(0)
    }
}

/// The store's `acme` tightened to 1 per hour (a rule of its own, a counter of its own), and
/// the provider's entry of it dropped (as its time to live would).
fn tighten_acme(store: &Store, provider: &CachingRuleSetProvider<Arc<Store>>) {
    *store.sets.lock().expect("lock") =
        RuleSets::from_yaml_str("rule_sets: [{id: acme, rules: [{id: strict, bands: [{capacity: 1, window: 1h}]}]}]")
            .expect("rules");
    provider.invalidate("acme");
}

impl RuleSetProvider for Store {
    fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
        *self.lookups.lock().expect("lock").entry(id.to_owned()).or_default() += 1;
        if self.hang.load(Ordering::SeqCst) {
            return MaybeReady::boxed(std::future::pending());
        }
        let found = self.sets.lock().expect("lock").get(id).cloned();
        let latency = LATENCY + Duration::from_millis(self.slower_ms.load(Ordering::SeqCst));
        let (pool, under_way, most, failed) = (
            self.pool.clone(),
            self.under_way.clone(),
            self.most_under_way.clone(),
            self.failed.clone(),
        );
        MaybeReady::boxed(async move {
            most.fetch_max(under_way.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            let answer = match tokio::time::timeout(CHECKOUT, pool.acquire()).await {
                Ok(Ok(_connection)) => {
                    tokio::time::sleep(latency).await;
                    Ok(found)
                }
                _ => {
                    failed.fetch_add(1, Ordering::SeqCst);
                    Err("rule store: timed out waiting for a connection of its pool".into())
                }
            };
            under_way.fetch_sub(1, Ordering::SeqCst);
            answer
        })
    }
}

/// The app (the layer with `on_error` around the shared test routes) and the store behind
/// its provider.
fn tenant_app(provider: impl RuleSetProvider, on_error: FailurePolicy) -> axum::Router {
    let engine = Engine::builder(provider)
        .unknown_rule_set(UnknownRuleSet::Deny)
        .build()
        .expect("an engine");
    app(layer(engine)
        .on_error(on_error)
        .customizer(|ctx, parts| {
            if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                ctx.set_rule_set_id(tenant);
            }
        })
        .build()
        .expect("a layer"))
}

/// Sends one request per tenant of `tenants` at once, from `peer`: their statuses, in
/// order.
async fn burst(app: &axum::Router, tenants: Vec<String>, peer: &'static str) -> Vec<StatusCode> {
    let tasks: Vec<_> = tenants
        .into_iter()
        .map(|tenant| {
            let app = app.clone();
            tokio::spawn(async move {
                send(
                    &app,
                    request("GET", "/api/orders", peer, &[("x-tenant", tenant.as_str())]),
                )
                .await
                .status
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.expect("the request's task"));
    }
    statuses
}

/// `n` requests of made-up rule set ids (`flood-00000`, …) sent at once from one address, in
/// a task of their own: their statuses, in order.
fn spawn_flood(app: &axum::Router, n: usize) -> tokio::task::JoinHandle<Vec<StatusCode>> {
    let app = app.clone();
    tokio::spawn(async move {
        let ids = (0..n).map(|i| format!("flood-{i:05}")).collect();
        burst(&app, ids, "198.51.100.66").await
    })
}

fn count(statuses: &[StatusCode], status: StatusCode) -> usize {
    statuses.iter().filter(|&&s| s == status).count()
}

/// Requests naming made-up rule set ids, refused one at a time by `UnknownRuleSet::Deny`,
/// stay refused when they come at once. Each was a lookup of its own, at once: the store's
/// pool ran out, its lookups failed, and a failure for an id never found before follows
/// `on_error`, which admitted them (360 of 400). The provider now asks the store at most
/// its `max_lookups` at once (4, the store's pool), so that the store never fails for the
/// flood; the requests that wait longer than its lookup timeout for their turn are refused
/// (`503`) whatever the failure policy.
#[tokio::test(start_paused = true)]
async fn made_up_rule_set_ids_sent_at_once_stay_refused() {
    let store = Arc::new(Store::new());
    let app = tenant_app(
        CachingRuleSetProvider::builder(store.clone()).build(),
        FailurePolicy::FailOpen,
    );
    for i in 0..3 {
        let statuses = burst(&app, vec![format!("made-up-{i}")], "198.51.100.7").await;
        assert_eq!(statuses, [StatusCode::TOO_MANY_REQUESTS], "one at a time, Deny refuses");
    }
    // 1,000 at once, each a new id: the store answers 4 at a time, 5 ms each, so that
    // those past the provider's 1 s wait for a turn go unasked.
    let ids: Vec<String> = (0..1_000).map(|i| format!("flood-{i:05}")).collect();
    let statuses = burst(&app, ids, "198.51.100.7").await;
    let (refused, unavailable) = (
        count(&statuses, StatusCode::TOO_MANY_REQUESTS),
        count(&statuses, StatusCode::SERVICE_UNAVAILABLE),
    );
    assert_eq!(
        refused + unavailable,
        1_000,
        "none admitted: {} admitted",
        count(&statuses, StatusCode::OK)
    );
    assert!(
        refused > 0 && unavailable > 0,
        "{refused} refused by Deny, {unavailable} unasked"
    );
    assert_eq!(store.failed.load(Ordering::SeqCst), 0, "the store never failed");
    assert!(store.most_under_way.load(Ordering::SeqCst) <= POOL);
}

/// A real tenant not looked up yet (the instance just started, or the tenant is new) whose
/// requests come during a flood of made-up ids is counted, or refused, never admitted past
/// its limit. Its lookups queued behind the flood's and failed, and `fail_open` admitted
/// all 20 of its requests under a limit of 5.
#[tokio::test(start_paused = true)]
async fn a_tenant_first_seen_during_a_flood_is_not_admitted_past_its_limit() {
    for flood_size in [300, 3_000] {
        let store = Arc::new(Store::new());
        let app = tenant_app(
            CachingRuleSetProvider::builder(store.clone()).build(),
            FailurePolicy::FailOpen,
        );
        let flood = spawn_flood(&app, flood_size);
        tokio::time::sleep(Duration::from_millis(2)).await;
        let statuses = burst(&app, vec!["globex".to_owned(); 20], "198.51.100.8").await;
        let flood = flood.await.expect("the flood");
        assert_eq!(count(&flood, StatusCode::OK), 0, "a flood of {flood_size}");
        let admitted = count(&statuses, StatusCode::OK);
        assert!(
            admitted <= 5,
            "a flood of {flood_size}: {admitted} of 20 admitted under a limit of 5: {statuses:?}"
        );
        assert_eq!(
            admitted
                + count(&statuses, StatusCode::TOO_MANY_REQUESTS)
                + count(&statuses, StatusCode::SERVICE_UNAVAILABLE),
            20
        );
        if flood_size == 300 {
            // The store answers a flood of 300 within the wait: globex is looked up and
            // counted.
            assert_eq!(admitted, 5, "{statuses:?}");
        }
    }
}

/// A burst of one tenant's requests on a cold cache asks the store for it once per turn at
/// most (the requests that waited for a turn find it cached), and admits its limit.
#[tokio::test(start_paused = true)]
async fn a_burst_of_one_tenant_on_a_cold_cache_is_looked_up_once_per_turn() {
    let store = Arc::new(Store::new());
    let app = tenant_app(
        CachingRuleSetProvider::builder(store.clone()).build(),
        FailurePolicy::FailOpen,
    );
    let statuses = burst(&app, vec!["acme".to_owned(); 100], "198.51.100.9").await;
    assert_eq!(count(&statuses, StatusCode::OK), 5);
    assert_eq!(count(&statuses, StatusCode::TOO_MANY_REQUESTS), 95);
    assert!(store.lookups_of("acme") <= POOL, "{} lookups", store.lookups_of("acme"));
    assert_eq!(store.failed.load(Ordering::SeqCst), 0);
}

/// A store that hangs holds no request past the provider's lookup timeout: a tenant whose
/// entry is gone (expired, or invalidated as here) is decided by the rule set found last,
/// and counted; an id never found is decided by the failure policy, as when the store
/// fails. Before, the lookup had no deadline, and every such request waited for as long
/// as the store hung.
#[tokio::test(start_paused = true)]
async fn a_hanging_store_holds_no_request_past_the_lookup_timeout() {
    let store = Arc::new(Store::new());
    let provider = Arc::new(
        CachingRuleSetProvider::builder(store.clone())
            .lookup_timeout(Duration::from_millis(200))
            .build(),
    );
    let open = tenant_app(provider.clone(), FailurePolicy::FailOpen);
    let closed = tenant_app(provider.clone(), FailurePolicy::FailClosed);
    assert_eq!(
        burst(&open, vec!["acme".to_owned(); 2], "198.51.100.20").await,
        [StatusCode::OK; 2]
    );
    store.hang.store(true, Ordering::SeqCst);
    provider.invalidate("acme");
    let started = tokio::time::Instant::now();
    // Four requests take the four lookups at once, which hang until they time out; six
    // more come 50 ms later and wait for a turn.
    let first = {
        let closed = closed.clone();
        tokio::spawn(async move { burst(&closed, vec!["acme".to_owned(); 4], "198.51.100.20").await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut statuses = burst(&closed, vec!["acme".to_owned(); 6], "198.51.100.20").await;
    statuses.extend(first.await.expect("the first requests"));
    // Decided by the rule set found last (`closed` has an engine and limiter of its own):
    // the client's 5, then refused; none failed, which `fail_closed` would refuse.
    assert_eq!(count(&statuses, StatusCode::OK), 5, "{statuses:?}");
    assert_eq!(count(&statuses, StatusCode::TOO_MANY_REQUESTS), 5, "{statuses:?}");
    // The first four take the four turns, and their lookups time out after 200 ms; the six
    // find none free and are served the rule set found last at once.
    assert_eq!(started.elapsed(), Duration::from_millis(200));
    // An id never found: the failure policy, within the timeout.
    let statuses = burst(&closed, vec!["globex".to_owned()], "198.51.100.21").await;
    assert_eq!(statuses, [StatusCode::SERVICE_UNAVAILABLE]);
    let statuses = burst(&open, vec!["globex".to_owned()], "198.51.100.21").await;
    assert_eq!(statuses, [StatusCode::OK]);
}

/// Requests whose rule sets are not looked up within the lookup timeout of their arrival,
/// for the time they waited for a turn, are refused whatever the failure policy
/// (`fail_open` included), with the layer's unavailable status; a shadow layer admits
/// them, as it admits every request. Before, a request that waited for its turn had the
/// whole timeout again for its lookup, and one that then timed out followed the policy:
/// a service whose answers came later than its gateways' deadline let them through.
#[tokio::test(start_paused = true)]
async fn a_request_that_waits_too_long_for_a_lookup_is_refused_under_every_policy() {
    let store = Arc::new(Store::new());
    // One lookup at a time, 40 ms each, each request within 100 ms of its arrival: of four
    // requests sent at once, the first is asked at once, the second after 40 ms (both
    // refused by Deny); the third gets its turn after 80 ms, and its lookup would end
    // after its 100 ms; the fourth's turn would come after 120 ms. Both refused, their
    // time gone in the queue.
    store.slower_ms.store(35, Ordering::SeqCst);
    let provider = Arc::new(
        CachingRuleSetProvider::builder(store.clone())
            .max_lookups(1)
            .lookup_timeout(Duration::from_millis(100))
            .build(),
    );
    for policy in [FailurePolicy::FailOpen, FailurePolicy::FailClosed] {
        let app = tenant_app(provider.clone(), policy);
        let ids = ["a1", "a2", "a3", "a4"].map(|id| format!("{id}-{policy:?}")).to_vec();
        let statuses = burst(&app, ids, "198.51.100.30").await;
        use StatusCode as S;
        assert_eq!(
            statuses,
            [
                S::TOO_MANY_REQUESTS,
                S::TOO_MANY_REQUESTS,
                S::SERVICE_UNAVAILABLE,
                S::SERVICE_UNAVAILABLE
            ],
            "{policy:?}"
        );
    }
    let engine = Engine::builder(provider.clone()).build().expect("an engine");
    let shadow = app(layer(engine)
        .shadow(true)
        .customizer(|ctx, parts| {
            if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                ctx.set_rule_set_id(tenant);
            }
        })
        .build()
        .expect("a layer"));
    let ids = ["b1", "b2", "b3"].map(str::to_owned).to_vec();
    assert_eq!(burst(&shadow, ids, "198.51.100.31").await, [StatusCode::OK; 3]);
    assert_eq!(store.failed.load(Ordering::SeqCst), 0);
}

/// A tenant found before stays in force while a flood of made-up ids holds every lookup:
/// once its entry is gone (expired, or invalidated as here), its requests find no turn
/// free and are decided by the rule set found last, at once, rather than queued behind the
/// flood. Before, they waited out the lookup timeout and were refused (`503`): a flood of
/// about a thousand made-up ids a second refused every tenant whose entry expired.
#[tokio::test(start_paused = true)]
async fn a_flood_of_made_up_ids_leaves_a_tenant_found_before_in_force() {
    let store = Arc::new(Store::new());
    store.slower_ms.store(15, Ordering::SeqCst);
    let provider = Arc::new(CachingRuleSetProvider::builder(store.clone()).build());
    let app = tenant_app(provider.clone(), FailurePolicy::FailClosed);
    assert_eq!(
        burst(&app, vec!["acme".to_owned()], "198.51.100.40").await,
        [StatusCode::OK]
    );
    provider.invalidate("acme");
    let flood = spawn_flood(&app, 2_000);
    tokio::time::sleep(Duration::from_millis(2)).await;
    let started = tokio::time::Instant::now();
    let statuses = burst(&app, vec!["acme".to_owned(); 10], "198.51.100.41").await;
    // One of them looks acme up again in the turn kept for ids found before (waiting for
    // one of the store's connections, which the flood holds); the others are answered at
    // once. None waits out the lookup timeout.
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(count(&statuses, StatusCode::OK), 5, "{statuses:?}");
    assert_eq!(count(&statuses, StatusCode::TOO_MANY_REQUESTS), 5, "{statuses:?}");
    let flood = flood.await.expect("the flood");
    assert_eq!(count(&flood, StatusCode::OK), 0);
}

/// A rule set in force follows its changes while a flood of made-up ids holds every
/// lookup: ids found before are looked up again, one at a time, in a turn of their own.
/// Served only as found last, a tightened rule set stayed loose for as long as the flood
/// lasted.
#[tokio::test(start_paused = true)]
async fn a_rule_set_in_force_follows_its_change_during_a_flood() {
    let store = Arc::new(Store::new());
    store.slower_ms.store(15, Ordering::SeqCst);
    let provider = Arc::new(CachingRuleSetProvider::builder(store.clone()).build());
    let app = tenant_app(provider.clone(), FailurePolicy::FailClosed);
    assert_eq!(
        burst(&app, vec!["acme".to_owned()], "198.51.100.50").await,
        [StatusCode::OK]
    );
    // acme is tightened to 1 per hour (a rule of its own, a counter of its own).
    tighten_acme(&store, &provider);
    let flood = spawn_flood(&app, 2_000);
    tokio::time::sleep(Duration::from_millis(2)).await;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.extend(burst(&app, vec!["acme".to_owned()], "198.51.100.50").await);
    }
    use StatusCode as S;
    assert_eq!(
        statuses,
        [
            S::OK,
            S::TOO_MANY_REQUESTS,
            S::TOO_MANY_REQUESTS,
            S::TOO_MANY_REQUESTS,
            S::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(count(&flood.await.expect("the flood"), StatusCode::OK), 0);
}

/// Tenants found before, looked up again during a flood, take no more lookups at once than
/// `max_lookups` (the store's pool): one of the turns is theirs, and the flood's ids hold
/// the others. With a turn of their own added on top, a lookup of the flood waited for a
/// connection that a tenant's lookup held, past the store's checkout deadline, failed, and
/// `fail_open` admitted its made-up id.
#[tokio::test(start_paused = true)]
async fn tenants_looked_up_again_during_a_flood_keep_within_the_pool() {
    let store = Arc::new(Store::new());
    store.slower_ms.store(55, Ordering::SeqCst); // 60 ms a lookup, past the pool's 50 ms checkout
    let provider = Arc::new(CachingRuleSetProvider::builder(store.clone()).build());
    let app = tenant_app(provider.clone(), FailurePolicy::FailOpen);
    for tenant in ["acme", "globex"] {
        assert_eq!(
            burst(&app, vec![tenant.to_owned()], "198.51.100.1").await,
            [StatusCode::OK]
        );
    }
    provider.invalidate_all();
    let flood = spawn_flood(&app, 400);
    tokio::time::sleep(Duration::from_millis(20)).await;
    for tenant in ["acme", "globex", "acme", "globex"] {
        burst(&app, vec![tenant.to_owned()], "198.51.100.2").await;
    }
    let flood = flood.await.expect("the flood");
    assert_eq!(count(&flood, StatusCode::OK), 0, "made-up ids admitted");
    assert_eq!(store.failed.load(Ordering::SeqCst), 0, "the store never fails");
    assert!(store.most_under_way.load(Ordering::SeqCst) <= POOL);
}

/// A lookup that fails serves the rule set found last without caching it: once the source
/// answers again, the next request looks the rule set up, and a change made meanwhile is in
/// force at once. Cached, the rule set found last stayed in force for a whole time to live
/// (60 s by default) after the failure.
#[tokio::test(start_paused = true)]
async fn a_failed_lookup_leaves_no_stale_rule_set_cached() {
    let store = Arc::new(Store::new());
    let provider = Arc::new(CachingRuleSetProvider::builder(store.clone()).build());
    let app = tenant_app(provider.clone(), FailurePolicy::FailClosed);
    assert_eq!(
        burst(&app, vec!["acme".to_owned()], "198.51.100.50").await,
        [StatusCode::OK]
    );
    // acme is tightened to 1 per hour while the store fails (it hangs, past the timeout).
    tighten_acme(&store, &provider);
    store.hang.store(true, Ordering::SeqCst);
    assert_eq!(
        burst(&app, vec!["acme".to_owned()], "198.51.100.50").await,
        [StatusCode::OK],
        "found last"
    );
    store.hang.store(false, Ordering::SeqCst);
    let mut after = Vec::new();
    for _ in 0..3 {
        after.extend(burst(&app, vec!["acme".to_owned()], "198.51.100.50").await);
    }
    use StatusCode as S;
    assert_eq!(
        after,
        [S::OK, S::TOO_MANY_REQUESTS, S::TOO_MANY_REQUESTS],
        "the tightened rule set"
    );
}

/// What two lookups of one id that end together leave as the rule set found last is what
/// they leave cached: the cache and the rule set found last change in one step. In two
/// steps, the older lookup could write the rule set found last after the newer one, and a
/// looser or deleted rule set be served in place of the newer one on the next failure.
#[test]
fn the_rule_set_found_last_is_the_one_cached_last() {
    /// A source answering, alternately, two versions of one rule set; or failing.
    #[derive(Debug, Default)]
    struct Versions {
        calls: std::sync::atomic::AtomicUsize,
        fail: AtomicBool,
    }
    impl RuleSetProvider for Versions {
        fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
            if self.fail.load(Ordering::SeqCst) {
                return MaybeReady::ready(Err("the source fails".into()));
            }
            let capacity = 1 + self.calls.fetch_add(1, Ordering::SeqCst) % 2;
            let yaml =
                format!("rule_sets: [{{id: {id}, rules: [{{id: r, bands: [{{capacity: {capacity}, window: 1h}}]}}]}}]");
            MaybeReady::ready(Ok(RuleSets::from_yaml_str(&yaml).expect("rules").get(id).cloned()))
        }
    }
    let provider = CachingRuleSetProvider::builder(Versions::default())
        .max_capacity(1_000_000)
        .build();
    let capacity = |set: &fluxgate::core::RuleSet| set.rules()[0].bands()[0].capacity();
    let barrier = std::sync::Barrier::new(2);
    for i in 0..5_000 {
        let id = format!("k{i}");
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    barrier.wait();
                    let _ = provider.rule_set(&id).into_ready();
                });
            }
        });
        let cached = provider
            .rule_set(&id)
            .into_ready()
            .expect("ready")
            .expect("found")
            .expect("a set");
        provider.invalidate(&id);
        provider.get_ref().fail.store(true, Ordering::SeqCst);
        let last = provider
            .rule_set(&id)
            .into_ready()
            .expect("ready")
            .expect("found last")
            .expect("a set");
        provider.get_ref().fail.store(false, Ordering::SeqCst);
        assert_eq!(capacity(&cached), capacity(&last), "round {i}");
    }
}

/// Out-of-range options are taken within range rather than panicking or refusing every
/// lookup: `max_lookups(usize::MAX)` is tokio's most permits, a zero `lookup_timeout` 1 ms.
#[test]
fn out_of_range_lookup_options_are_taken_within_range() {
    let _ = CachingRuleSetProvider::builder(RuleSets::default())
        .max_lookups(usize::MAX)
        .lookup_timeout(Duration::ZERO)
        .build();
}

/// A customizer that picks the rule set from the request lets the client name one that
/// does not exist: with the engine's default (`UnknownRuleSet::Allow`) such a request is
/// admitted by no rule at all, so a client escapes every limit by sending a new tenant id;
/// `UnknownRuleSet::Deny` refuses it.
#[tokio::test]
async fn a_rule_set_chosen_from_the_request_must_exist() {
    const TENANTS: &str = "rule_sets: [{id: acme, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]";
    let app_with = |unknown: fluxgate::UnknownRuleSet| {
        let engine = builder(TENANTS).unknown_rule_set(unknown).build().unwrap();
        app(layer(engine)
            .customizer(|ctx, parts| {
                if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                    ctx.set_rule_set_id(tenant);
                }
            })
            .build()
            .unwrap())
    };
    let tenant = |app: &axum::Router, name: &'static str| {
        send_owned(
            app.clone(),
            request("GET", "/api/users", "192.0.2.99", &[("x-tenant", name)]),
        )
    };
    let allow = app_with(fluxgate::UnknownRuleSet::Allow);
    assert_eq!(tenant(&allow, "acme").await.status, StatusCode::OK);
    assert_eq!(tenant(&allow, "acme").await.status, StatusCode::TOO_MANY_REQUESTS);
    for _ in 0..5 {
        let r = tenant(&allow, "no-such-tenant").await;
        assert_eq!(r.status, StatusCode::OK, "admitted: no rule set, no rule");
        assert_eq!(r.header("x-ratelimit-limit"), None);
    }
    let deny = app_with(fluxgate::UnknownRuleSet::Deny);
    assert_eq!(tenant(&deny, "acme").await.status, StatusCode::OK);
    assert_eq!(
        tenant(&deny, "no-such-tenant").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// `UnknownRuleSet::Deny` needs the rule source to answer. With a provider that looks rule
/// sets up when asked (a store, here behind `CachingRuleSetProvider`, which serves the rule
/// sets it found while the store fails), a rule set id chosen from the request that was not
/// found before fails while the store is unreachable, and the failure follows the layer's
/// `on_error`: `fail_open` (the default) admits each request naming a new id uncounted,
/// `fail_closed` refuses it. A customizer that keeps to a fixed list, and sends the other
/// ids to a rule set of the list, counts them whatever the store does.
#[tokio::test]
async fn a_rule_set_chosen_from_the_request_follows_on_error_while_its_store_is_down() {
    use std::sync::atomic::AtomicBool;
    /// A store of rule sets that can be cut off.
    #[derive(Debug)]
    struct Store {
        rules: fluxgate::core::RuleSets,
        down: Arc<AtomicBool>,
    }
    impl fluxgate::core::RuleSetProvider for Store {
        fn rule_set(&self, id: &str) -> fluxgate::core::MaybeReady<fluxgate::core::RuleSetLookup> {
            if self.down.load(Ordering::SeqCst) {
                return fluxgate::core::MaybeReady::ready(Err("the store is unreachable".into()));
            }
            self.rules.rule_set(id)
        }
    }
    const TENANTS: &str = "rule_sets: [{id: acme, rules: [{id: per-ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let down = Arc::new(AtomicBool::new(false));
    let store = Store {
        rules: fluxgate::core::RuleSets::from_yaml_str(TENANTS).expect("rules"),
        down: down.clone(),
    };
    let engine = Engine::builder(fluxgate::core::CachingRuleSetProvider::builder(store).build())
        .unknown_rule_set(fluxgate::UnknownRuleSet::Deny)
        .build()
        .expect("an engine");
    let app_with = |on_error: FailurePolicy, fixed_list: bool| {
        app(layer(engine.clone())
            .on_error(on_error)
            .customizer(move |ctx, parts| {
                if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                    ctx.set_rule_set_id(if fixed_list && tenant != "acme" { "acme" } else { tenant });
                }
            })
            .build()
            .expect("a layer"))
    };
    let tenant = |app: &axum::Router, name: String, peer: &str| {
        send_owned(
            app.clone(),
            request("GET", "/api/users", peer, &[("x-tenant", name.as_str())]),
        )
    };
    let (open, closed, listed) = (
        app_with(FailurePolicy::FailOpen, false),
        app_with(FailurePolicy::FailClosed, false),
        app_with(FailurePolicy::FailOpen, true),
    );
    // The store answers: an unknown id is refused, a known one found (and kept).
    assert_eq!(
        tenant(&open, "new".into(), "192.0.2.97").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(tenant(&open, "acme".into(), "192.0.2.97").await.status, StatusCode::OK);
    down.store(true, Ordering::SeqCst);
    for i in 0..3 {
        let r = tenant(&open, format!("new-{i}"), "192.0.2.98").await;
        assert_eq!(r.status, StatusCode::OK, "fail_open: admitted, counted by no rule");
        assert_eq!(r.header("x-ratelimit-limit"), None);
        let r = tenant(&closed, format!("new-{i}"), "192.0.2.98").await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "fail_closed");
    }
    // The fixed list sends every other id to `acme`, found before: counted there.
    let statuses: Vec<StatusCode> = {
        let mut out = Vec::new();
        for i in 0..3 {
            out.push(tenant(&listed, format!("new-{i}"), "192.0.2.99").await.status);
        }
        out
    };
    use StatusCode as S;
    assert_eq!(statuses, [S::OK, S::OK, S::TOO_MANY_REQUESTS]);
}

/// A layer whose rule set its engine does not have (a misspelt `rule_set`) admits every
/// request: each layer warns once, on its first such request, even when the engine, shared
/// with another layer, warned already; later requests add no warning.
#[tokio::test]
async fn a_layer_whose_rule_set_is_unknown_warns_once() {
    use support::telemetry::trace_async;
    use tracing::Level;
    let engine = engine("rule_sets: [{id: api, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]");
    let typo = app(layer(engine.clone()).rule_set("apii").build().unwrap());
    let other = app(layer(engine.clone()).rule_set("admn").build().unwrap());
    let warnings = |app: axum::Router| async move {
        let (reply, trace) = trace_async(send_owned(app, request("GET", "/api/users", "192.0.2.7", &[]))).await;
        assert_eq!(reply.status, StatusCode::OK);
        trace
            .events_at_least(Level::WARN)
            .iter()
            .map(|e| e.message.clone())
            .collect::<Vec<_>>()
    };
    let first = warnings(typo.clone()).await;
    assert_eq!(first.len(), 2, "the engine's and the layer's: {first:?}");
    assert!(
        first
            .iter()
            .any(|m| m.contains("the layer's rule set is not one of the handler's")),
        "{first:?}"
    );
    assert_eq!(warnings(typo.clone()).await, Vec::<String>::new());
    // Admitted, and no rule counts it.
    for _ in 0..3 {
        let reply = send(&typo, request("GET", "/api/users", "192.0.2.7", &[])).await;
        assert_eq!(
            (reply.status, reply.header("x-ratelimit-limit")),
            (StatusCode::OK, None)
        );
    }
    // The engine warned once already; the second layer still says so, once.
    let second = warnings(other.clone()).await;
    assert_eq!(second.len(), 1, "{second:?}");
    assert!(
        second[0].contains("the layer's rule set is not one of the handler's"),
        "{second:?}"
    );
    assert_eq!(warnings(other).await, Vec::<String>::new());
    // A layer whose rule set exists never says it.
    let right = app(layer(engine).rule_set("api").build().unwrap());
    assert_eq!(warnings(right).await, Vec::<String>::new());
}

async fn send_owned(app: axum::Router, req: Request<Body>) -> Reply {
    send(&app, req).await
}
