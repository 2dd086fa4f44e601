//! The algorithm conformance suite (`tests/support/conformance.rs`), run unchanged against
//! the in-memory limiter on a controlled clock, a real `redis-server` and a real 3-primary
//! Redis Cluster, both in real time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::conformance::{self, Harness, OnManualClock};
use crate::support::redis::{RedisCluster, RedisServer};
use fluxgate::core::{MemoryLimiter, RateLimiter};
use fluxgate_redis::RedisLimiter;

/// The in-memory limiter on a clock that moves only when a step says so.
fn memory() -> OnManualClock {
    OnManualClock::new(|clock| Arc::new(MemoryLimiter::builder().clock(clock).build()))
}

fn wall_clock() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_nanos() as u64
}

async fn sleep_until(t: u64) {
    let now = wall_clock();
    if t > now {
        tokio::time::sleep(Duration::from_nanos(t - now)).await;
    }
}

/// A Redis limiter in real time (Redis `TIME` runs on this machine's clock). The deny
/// cache is off: the suite checks what the scripts decide.
struct Redis<S> {
    _servers: S,
    base: RedisLimiter,
    next: AtomicUsize,
}

impl<S> Redis<S> {
    async fn connect(servers: S, url: String) -> Self {
        let base = RedisLimiter::builder(url)
            .timeout(Duration::from_secs(2))
            .deny_cache(false)
            .connect()
            .await
            .expect("connect to the test Redis");
        Self {
            _servers: servers,
            base,
            next: AtomicUsize::new(0),
        }
    }
}

impl<S> Harness for Redis<S> {
    fn limiter(&self) -> Arc<dyn RateLimiter> {
        let n = self.next.fetch_add(1, Ordering::SeqCst);
        Arc::new(self.base.with_prefix(format!("conformance{n}")))
    }
    fn now(&self) -> u64 {
        wall_clock()
    }
    async fn wait_until(&self, t: u64) {
        sleep_until(t).await;
    }
    fn tolerance_ms(&self) -> u64 {
        // Redis counts microseconds; expected figures are whole milliseconds.
        1
    }
}

async fn standalone() -> Redis<RedisServer> {
    let server = RedisServer::start();
    let url = server.url();
    Redis::connect(server, url).await
}

macro_rules! cases {
    ($($test:ident => $case:ident,)*) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test]
                async fn $test() {
                    conformance::run(&memory(), &conformance::$case).await;
                }
            )*
        }
        mod redis {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    conformance::run(&standalone().await, &conformance::$case).await;
                }
            )*
        }
    };
}

cases! {
    token_bucket => TOKEN_BUCKET,
    token_bucket_permits => TOKEN_BUCKET_PERMITS,
    leaky_bucket => LEAKY_BUCKET,
    leaky_bucket_permits => LEAKY_BUCKET_PERMITS,
    fixed_window => FIXED_WINDOW,
    fixed_window_boundary_burst => FIXED_WINDOW_BOUNDARY,
    fixed_window_permits => FIXED_WINDOW_PERMITS,
    sliding_window_log => SLIDING_WINDOW_LOG,
    sliding_window_log_one_instant => SLIDING_WINDOW_LOG_ONE_INSTANT,
    sliding_window_log_permits => SLIDING_WINDOW_LOG_PERMITS,
    sliding_window_counter => SLIDING_WINDOW_COUNTER,
    sliding_window_counter_seed_examples => SLIDING_WINDOW_COUNTER_SEED,
    sliding_window_counter_boundary => SLIDING_WINDOW_COUNTER_BOUNDARY,
    sliding_window_counter_permits => SLIDING_WINDOW_COUNTER_PERMITS,
    leaky_bucket_two_bands => LEAKY_BUCKET_TWO_BANDS,
    fixed_window_two_bands => FIXED_WINDOW_TWO_BANDS,
    sliding_window_log_two_bands => SLIDING_WINDOW_LOG_TWO_BANDS,
    sliding_window_counter_two_bands => SLIDING_WINDOW_COUNTER_TWO_BANDS,
    mixed_algorithms => MIXED,
}

/// Every case on one cluster, concurrently. Rules of a case sit in different hash slots,
/// so a rejection in one slot is refunded in the others, for every algorithm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_on_a_cluster() {
    let cluster = RedisCluster::start();
    let url = cluster.url();
    let harness = Arc::new(Redis::connect(cluster, url).await);
    let mut runs = tokio::task::JoinSet::new();
    for case in conformance::ALL {
        let harness = harness.clone();
        runs.spawn(async move { conformance::run(&*harness, case).await });
    }
    while let Some(run) = runs.join_next().await {
        if let Err(e) = run {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}
