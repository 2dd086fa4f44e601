//! The algorithm conformance suite (`tests/support/conformance.rs`) on Redis, in real time
//! (Redis `TIME` runs on this machine's clock), with the deny cache off: the suite checks
//! what the scripts decide.

/// On a 3-primary Redis Cluster, shared by these tests. Rules of a case sit in different
/// hash slots, so a rejection in one slot is refunded in the others, for every algorithm.
mod cluster {
    use crate::support::conformance::conformance_tests;
    use crate::support::redis::{Redis, Servers};

    conformance_tests!(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        Redis::scripts_only(Servers::shared_cluster()).await
    );
}

/// On a standalone server per case.
mod standalone {
    use crate::support::conformance::conformance_tests;
    use crate::support::redis::{Redis, Servers};

    conformance_tests!(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        Redis::scripts_only(Servers::standalone()).await
    );
}

/// On a standalone server per case, deciding in batches: each request decided by the batch
/// script as its own call would decide it.
mod batched {
    use crate::support::conformance::conformance_tests;
    use crate::support::redis::{Redis, Servers};

    conformance_tests!(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        Redis::batched(Servers::standalone()).await
    );
}

/// On the shared cluster, deciding in batches: one batch per hash slot, and the requests
/// across slots refunded as without batches.
mod batched_cluster {
    use crate::support::conformance::conformance_tests;
    use crate::support::redis::{Redis, Servers};

    conformance_tests!(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        Redis::batched(Servers::shared_cluster()).await
    );
}
