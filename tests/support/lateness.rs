//! How late the machine is: what a test that waits in real time compares its figures with,
//! so that a busy machine is reported as such rather than blamed on the code.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `run`, and how late at worst a thread of the test's own woke from 5 ms sleeps meanwhile:
/// a stall of the process or of the machine, in which calls miss their deadline whatever
/// the limiter does. A thread, not a task, so that a runtime kept busy by the test's own
/// requests does not count as a stall.
pub(crate) async fn with_lateness<T>(run: impl Future<Output = T>) -> (T, Duration) {
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut late = Duration::ZERO;
            while !stop.load(Ordering::SeqCst) {
                let start = Instant::now();
                std::thread::sleep(Duration::from_millis(5));
                late = late.max(start.elapsed().saturating_sub(Duration::from_millis(5)));
            }
            late
        })
    };
    let result = run.await;
    stop.store(true, Ordering::SeqCst);
    (result, watcher.join().expect("the lateness watcher"))
}
