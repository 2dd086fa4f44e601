//! [`Redis`], the backend the decision tests run on, over the servers of [`super::servers`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fluxgate::core::{Engine, FailurePolicy, RateLimiter};
use fluxgate::redis::{Batching, RedisLimiter, RedisLimiterBuilder};

use super::backend::{Backend, Waiting};
use super::servers::{RedisCluster, RedisServer};

/// An engine of one per-IP token-bucket rule, `per-ip`, of `capacity` per hour in the rule
/// set `default`, over `limiter`, whose failures `policy` answers.
pub(crate) fn per_ip_engine(limiter: RedisLimiter, capacity: u64, policy: FailurePolicy) -> Engine {
    let yaml = format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{{ capacity: {capacity}, window: 1h }}]\n"
    );
    Engine::builder(super::app::rules(&yaml))
        .limiter(limiter)
        .on_backend_failure(policy)
        .build()
        .expect("Redis decides the rule")
}

/// What [`until_decided_after_promotion`] saw.
pub(crate) struct Failover {
    /// How long after the call the replica was seen to have taken over.
    pub(crate) promoted: Option<Duration>,
    /// How long after the call a decision after that came from Redis.
    pub(crate) resumed: Option<Duration>,
    /// How much later than asked the checker's own 100 ms pauses ended after the takeover:
    /// how busy the machine was while the client reconnected.
    pub(crate) late: Duration,
}

impl Failover {
    /// Asserts that decisions resumed within `bound` of the takeover, plus the checker's
    /// own lateness (the reconnection runs on the same busy cores); `what` names the setup.
    pub(crate) fn assert_resumed_within(&self, bound: Duration, what: &str) {
        let promoted = self.promoted.expect("the replica took over within 30 s");
        let resumed = self.resumed.expect("decisions resumed on the promoted replica");
        eprintln!(
            "{what}: the replica took over {promoted:?} after the primary froze; decisions resumed {resumed:?} \
             after (the checker's pauses {:?} late meanwhile)",
            self.late
        );
        // At most a second of the checker's lateness is allowed: a runtime stalled for
        // longer is a failure of its own, not an excuse.
        let late = self.late.min(Duration::from_secs(1));
        assert!(
            resumed <= promoted + bound + late,
            "{what}: decisions resumed {resumed:?} after the freeze, the replica took over after {promoted:?}: \
             more than {bound:?} after, with the checker {:?} late",
            self.late
        );
    }
}

/// Checks `ctx` every 100 ms, for 30 s at most, while a primary is frozen: how long after
/// the call `promoted()` first held (its replica taken over), how long until a decision
/// after that came from Redis, not the failure policy (each admitted), and how late the
/// checker's own pauses ended meanwhile. `None` for what did not come.
pub(crate) async fn until_decided_after_promotion(
    engine: &Engine,
    ctx: &fluxgate::core::RequestContext,
    mut promoted_now: impl FnMut() -> bool,
) -> Failover {
    let start = std::time::Instant::now();
    let mut seen = Failover {
        promoted: None,
        resumed: None,
        late: Duration::ZERO,
    };
    while start.elapsed() < Duration::from_secs(30) {
        let d = engine.check(ctx).await.expect("a decision");
        if seen.promoted.is_none() && promoted_now() {
            seen.promoted = Some(start.elapsed());
        }
        if seen.promoted.is_some() && !d.failed_open {
            assert!(d.allowed());
            seen.resumed = Some(start.elapsed());
            return seen;
        }
        let pause = std::time::Instant::now();
        tokio::time::sleep(Duration::from_millis(100)).await;
        if seen.promoted.is_some() {
            seen.late += pause.elapsed().saturating_sub(Duration::from_millis(100));
        }
    }
    seen
}

/// Requests of other clients than the tests' (`198.51.100.0` to `.199` in turn), one every
/// 5 ms or so until the task is aborted: with a pool of a few connections, each connection
/// is written to every 20 ms or so, as under load.
pub(crate) fn other_clients(engine: &Engine) -> tokio::task::JoinHandle<()> {
    let engine = engine.clone();
    tokio::spawn(async move {
        for n in 0u32.. {
            let other = crate::support::backend::ctx(&format!("198.51.100.{}", n % 200));
            let _ = engine.check(&other).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// Where a [`Redis`] backend runs.
pub(crate) enum Servers {
    /// A standalone server of its own.
    Standalone(RedisServer),
    /// A cluster, its own or shared (see [`Servers::shared_cluster`]).
    Cluster(Arc<RedisCluster>),
}

impl Servers {
    /// A standalone server of its own.
    pub(crate) fn standalone() -> Self {
        Self::Standalone(RedisServer::start())
    }

    /// A cluster of its own, for a test that looks at or disturbs the servers.
    pub(crate) fn cluster() -> Self {
        Self::Cluster(Arc::new(RedisCluster::start()))
    }

    /// The cluster that the tests of this binary running at the same time share (each with
    /// its own client and key prefixes): started by the first, stopped when the last one
    /// still running drops it.
    pub(crate) fn shared_cluster() -> Self {
        static SHARED: Mutex<Weak<RedisCluster>> = Mutex::new(Weak::new());
        let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        let cluster = shared.upgrade().unwrap_or_else(|| {
            let cluster = Arc::new(RedisCluster::start());
            *shared = Arc::downgrade(&cluster);
            cluster
        });
        Self::Cluster(cluster)
    }

    fn url(&self) -> String {
        match self {
            Self::Standalone(server) => server.url(),
            Self::Cluster(cluster) => cluster.url(),
        }
    }
}

/// Redis as a backend under test: its servers, a client configured for the test, and a
/// fresh key prefix for every limiter (`test0`, `test1`… on a standalone server).
pub(crate) struct Redis {
    servers: Servers,
    base: RedisLimiter,
    prefix: String,
    next: AtomicUsize,
}

impl Redis {
    /// On `servers`, with the library's default client options and a 2 s timeout.
    pub(crate) async fn start(servers: Servers) -> Self {
        Self::connect(servers, |builder| builder).await
    }

    /// On `servers`, with the deny cache off: every decision is the scripts' own.
    pub(crate) async fn scripts_only(servers: Servers) -> Self {
        Self::connect(servers, |builder| builder.deny_cache(false)).await
    }

    /// On `servers`, deciding in batches ([`Batching`]'s defaults), with the deny cache off:
    /// every decision is the batch script's own.
    pub(crate) async fn batched(servers: Servers) -> Self {
        Self::connect(servers, |builder| builder.deny_cache(false).batching(Batching::new())).await
    }

    async fn connect(servers: Servers, configure: fn(RedisLimiterBuilder) -> RedisLimiterBuilder) -> Self {
        static SHARED_CLIENTS: AtomicUsize = AtomicUsize::new(0);
        // A cluster may be shared: the prefixes of every client on it differ.
        let prefix = match &servers {
            Servers::Standalone(_) => "test".to_owned(),
            Servers::Cluster(_) => format!("test{}-", SHARED_CLIENTS.fetch_add(1, Ordering::SeqCst)),
        };
        let base = configure(RedisLimiter::builder(servers.url()).timeout(Duration::from_secs(2)))
            .connect()
            .await
            .expect("connect to the test Redis");
        Self {
            servers,
            base,
            prefix,
            next: AtomicUsize::new(0),
        }
    }

    /// The URL of its servers.
    pub(crate) fn url(&self) -> String {
        self.servers.url()
    }

    /// Its standalone server.
    pub(crate) fn server(&self) -> &RedisServer {
        match &self.servers {
            Servers::Standalone(server) => server,
            Servers::Cluster(_) => panic!("a cluster, not a standalone server"),
        }
    }

    /// The instant, in µs, stored for the last band of the token-bucket rule in `key` of
    /// its standalone server (the bucket is full again then); `None` without one.
    pub(crate) fn stored_instant_us(&self, key: &str) -> Option<i64> {
        let value = self.server().cli(&["GET", key]);
        let state = value.trim().rsplit('|').next().unwrap_or_default();
        i64::from_str_radix(state.split(':').next().unwrap_or_default(), 16).ok()
    }

    /// Its standalone server, to stop it.
    pub(crate) fn server_mut(&mut self) -> &mut RedisServer {
        match &mut self.servers {
            Servers::Standalone(server) => server,
            Servers::Cluster(_) => panic!("a cluster, not a standalone server"),
        }
    }

    /// Its cluster.
    pub(crate) fn cluster(&self) -> &RedisCluster {
        match &self.servers {
            Servers::Cluster(cluster) => cluster,
            Servers::Standalone(_) => panic!("a standalone server, not a cluster"),
        }
    }
}

impl Backend for Redis {
    fn name(&self) -> &'static str {
        match self.servers {
            Servers::Standalone(_) => "redis",
            Servers::Cluster(_) => "redis cluster",
        }
    }
    fn limiter(&self) -> Arc<dyn RateLimiter> {
        let n = self.next.fetch_add(1, Ordering::SeqCst);
        Arc::new(self.base.with_prefix(format!("{}{n}", self.prefix)))
    }
    /// Redis `TIME`, which runs on this machine's clock.
    fn now_nanos(&self) -> u64 {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("a clock after 1970");
        u64::try_from(since.as_nanos()).expect("nanoseconds within u64")
    }
    fn wait_until(&self, t: u64) -> Waiting<'_> {
        let now = self.now_nanos();
        Box::pin(tokio::time::sleep(Duration::from_nanos(t.saturating_sub(now))))
    }
    fn refill_tolerance(&self) -> usize {
        2
    }
    fn atomic_across_rules(&self) -> bool {
        matches!(self.servers, Servers::Standalone(_))
    }
}
