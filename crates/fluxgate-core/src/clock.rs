//! Clocks for the in-memory limiter.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A monotonic clock that reads as nanoseconds since the Unix epoch.
///
/// It never goes backwards, so bucket arithmetic stays valid when the wall clock is
/// adjusted; it starts at the wall clock so that reset times are Unix timestamps.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Nanoseconds since the Unix epoch, monotonic. (The in-memory limiter tolerates a
    /// clock whose readings on two threads disagree: see [`SystemClock`].)
    fn now_nanos(&self) -> u64;
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The default clock: the system clock at start, advanced by a monotonic clock read
/// from the CPU's time-stamp counter where it is reliable ([quanta]), which costs a few
/// nanoseconds instead of a `clock_gettime` call.
///
/// On some machines the counters of two cores disagree, which quanta does not detect: a
/// reading on one core may then lie before an earlier reading on another. The in-memory
/// limiter never decides a request in a shard at an instant before one it has decided
/// there already, so such a clock cannot make a bucket count anew.
#[derive(Debug, Clone)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin: quanta::Instant,
    origin_unix: u64,
}

impl SystemClock {
    /// A clock starting at the current wall-clock time.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        Self {
            origin: clock.now(),
            clock,
            origin_unix: unix_nanos(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_nanos(&self) -> u64 {
        let elapsed = self.clock.now().saturating_duration_since(self.origin);
        self.origin_unix
            .saturating_add(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
    }
}

/// A clock advanced by [`tokio::time::Instant`]: under `tokio::time::pause()` it only
/// moves when the test calls `tokio::time::advance` (or sleeps on the paused runtime).
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
    origin_unix: u64,
}

impl TokioClock {
    /// A clock starting at the current wall-clock time.
    pub fn new() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
            origin_unix: unix_nanos(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now_nanos(&self) -> u64 {
        let elapsed = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.origin_unix.saturating_add(elapsed)
    }
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use fluxgate_core::{Clock, ManualClock};
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_nanos(5));
/// assert_eq!(clock.now_nanos(), 1_005);
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `unix_nanos`.
    pub fn new(unix_nanos: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(unix_nanos)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.now.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_nanos(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}
