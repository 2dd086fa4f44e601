//! Hot reload: rule sets replaced while engines use them.
//!
//! - [`ReloadingRuleSetProvider`]: a [`RuleSetProvider`] whose rule sets can be replaced at
//!   any time. A replacement is checked first with the validation of every engine built on
//!   the provider; it swaps in only the rule sets whose content changed, and a bad one
//!   changes nothing.
//! - [`RuleSource`]: where new rules come from; [`FileRuleSource`] reads one rule file or
//!   every rule file of a directory.
//! - [`spawn_polling`]: reloads from a source on a period.
//! - `spawn_watching` (feature `watch`): reloads a [`FileRuleSource`] when its files
//!   change, with a short debounce.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use fluxgate_core::reload::{spawn_polling, FileRuleSource, ReloadingRuleSetProvider};
//! use fluxgate_core::Engine;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let source = FileRuleSource::new("/etc/myapp/rules");
//! let provider = Arc::new(ReloadingRuleSetProvider::new(source.read()?));
//! let engine = Engine::builder(provider.clone()).build()?;
//! // Every 10 s: read the files again and swap in the rule sets that changed.
//! let polling = spawn_polling(provider.clone(), Arc::new(source), Duration::from_secs(10));
//! # drop((engine, polling));
//! # Ok(())
//! # }
//! ```
//!
//! What a swap resets: nothing that did not change. The in-memory limiter keys a band's
//! counters by the band's [identity](crate::Band::ident) (rule set, rule, band name,
//! algorithm, capacity and window), so a band whose capacity, window or algorithm changed
//! starts with fresh counters, while the bands of unchanged rules, in a changed rule set or
//! not, keep theirs.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::{BoxError, RuleError};
use crate::future::{BoxFuture, MaybeReady};
use crate::provider::{local_copy, Checks, RuleCheck, RuleSetLookup, RuleSetProvider};
use crate::rule::{Format, RuleSet, RuleSets};

#[cfg(feature = "watch")]
mod watch;
#[cfg(feature = "watch")]
pub use watch::{spawn_watching, Watch, WatchBuilder, WatchError, DEFAULT_DEBOUNCE};

/// A [`RuleSetProvider`] whose rule sets can be replaced while engines use them.
///
/// Lookups read the rule sets in force from a per-thread snapshot, taken again under a
/// read lock when a swap raised the provider's version since; a
/// [`replace`](Self::replace) builds the new map aside and swaps it in under the write lock.
/// A rule set is handed out as an `Arc<RuleSet>` (the looking thread's own copy, see
/// [`RuleSetProvider::rule_set`]): a request being decided keeps the rule set it looked
/// up, the next request sees the new one. (A standard `RwLock` and a version counter rather
/// than an `arc-swap`: no added dependency, and the lock is taken once per thread and swap.)
///
/// Content is compared with `RuleSet`'s [`PartialEq`]: same id and equal rules in the same
/// order, every field compared (path patterns by their text). An unchanged rule set keeps
/// its `Arc`, so a reload of the same rules changes nothing at all.
///
/// The provider keeps the [`RuleCheck`] of every engine built on it
/// ([`RuleSetProvider::validate`]) and runs them on every replacement: a rule set one of
/// the engines' limiters cannot decide refuses the whole replacement.
///
/// ```
/// use fluxgate_core::reload::ReloadingRuleSetProvider;
/// use fluxgate_core::{Engine, RequestContext, RuleSets};
///
/// let rules = |capacity: u64| {
///     RuleSets::from_yaml_str(&format!(
///         "rule_sets: [{{id: default, rules: [{{id: all, scope: global, bands: [{{capacity: {capacity}, window: 1m}}]}}]}}]"
///     ))
/// };
/// let provider = std::sync::Arc::new(ReloadingRuleSetProvider::new(rules(10)?));
/// let engine = Engine::builder(provider.clone()).build()?;
/// let ctx = RequestContext::builder().build();
/// let remaining = || engine.check(&ctx).into_ready().expect("in memory").expect("decided").remaining();
/// assert_eq!(remaining(), Some(9));
///
/// let report = provider.replace(rules(10)?)?;
/// assert!(report.is_empty(), "same rules: nothing swapped");
/// assert_eq!(remaining(), Some(8));
///
/// let report = provider.replace(rules(3)?)?;
/// assert_eq!(report.changed, ["default".into()]);
/// assert_eq!(remaining(), Some(2), "a new capacity: fresh counters");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ReloadingRuleSetProvider {
    current: RwLock<Arc<RuleSets>>,
    /// This provider among all, for the per-thread snapshots.
    uid: u64,
    /// Raised after every swap of `current`: a thread's snapshot of an older version is
    /// read again.
    version: AtomicU64,
    /// The checks of the engines built on this provider.
    checks: Checks,
    /// Makes replacements one at a time: each compares with the rule sets the previous
    /// one left.
    update: Mutex<Update>,
    /// Tickets handed to loads as they start: a load that finishes after a later one was
    /// applied is dropped, so that an older read never replaces a newer one.
    tickets: AtomicU64,
    reloads: AtomicU64,
    failures: AtomicU64,
}

/// What replacements carry from one to the next.
#[derive(Default)]
struct Update {
    /// The ticket of the last load applied.
    last: u64,
    /// The counters' generation of each rule set reset at least once: rule sets loaded
    /// later get it too, so that a reload does not bring back counters a reset dropped.
    generations: HashMap<Arc<str>, u64>,
}

/// What a successful replacement changed. Ids are sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReloadReport {
    /// The rule sets that were not there before.
    pub added: Vec<Arc<str>>,
    /// The rule sets whose content changed.
    pub changed: Vec<Arc<str>>,
    /// The rule sets that are gone.
    pub removed: Vec<Arc<str>>,
}

impl ReloadReport {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }
}

impl fmt::Display for ReloadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |ids: &[Arc<str>]| ids.iter().map(|id| &**id).collect::<Vec<_>>().join(", ");
        write!(
            f,
            "added [{}], changed [{}], removed [{}]",
            list(&self.added),
            list(&self.changed),
            list(&self.removed)
        )
    }
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The rule source could not load rules (a file unreadable or invalid, …).
    #[error("rule source failed, the rules in force are kept: {0}")]
    Source(#[source] BoxError),
    /// A new rule set cannot be decided by the limiter of an engine using the provider.
    #[error("new rules refused, the rules in force are kept: {0}")]
    Refused(#[source] RuleError),
}

impl ReloadingRuleSetProvider {
    /// A provider of these rule sets.
    pub fn new(sets: RuleSets) -> Self {
        static UIDS: AtomicU64 = AtomicU64::new(0);
        Self {
            current: RwLock::new(Arc::new(sets)),
            uid: UIDS.fetch_add(1, Ordering::Relaxed),
            version: AtomicU64::new(0),
            checks: Checks::default(),
            update: Mutex::new(Update::default()),
            tickets: AtomicU64::new(0),
            reloads: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    /// The rule sets in force now.
    pub fn rule_sets(&self) -> Arc<RuleSets> {
        self.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Replaces the rule sets with `new`.
    ///
    /// Every rule set of `new` is checked first with the validation of every engine built
    /// on the provider; if one fails, nothing changes and the error is returned, logged
    /// and counted in [`failures`](Self::failures). Otherwise the rule sets whose content
    /// changed (see [`ReloadingRuleSetProvider`]) and the new ones are swapped in, the
    /// unchanged ones stay as they are (the same `Arc`), and those `new` lacks are removed.
    ///
    /// # Errors
    ///
    /// [`ReloadError::Refused`] with the first rule set, by id, that a check refuses.
    pub fn replace(&self, new: RuleSets) -> Result<ReloadReport, ReloadError> {
        self.apply(self.ticket(), new)
    }

    fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Replaces the rule sets with `new`, read by the load holding `ticket`, unless a load
    /// that started later was applied first.
    fn apply(&self, ticket: u64, new: RuleSets) -> Result<ReloadReport, ReloadError> {
        let mut update = self.update.lock().unwrap_or_else(PoisonError::into_inner);
        if ticket < update.last {
            tracing::debug!("rule sets read before the ones in force: dropped");
            return Ok(ReloadReport::default());
        }
        // The generation a reset gave each rule set first: the checks see the rule sets
        // as they will be in force (an engine's leases keep to their generation, see
        // `LeaseWatch::rules_changed`).
        let mut loaded = RuleSets::default();
        for set in new.iter() {
            loaded.insert_shared(match update.generations.get(&**set.id()) {
                Some(&generation) if generation != set.generation() => Arc::new(set.with_generation(generation)),
                _ => set.clone(),
            });
        }
        let new = loaded;
        if let Err(error) = self.check(&new) {
            return Err(self.failed(ReloadError::Refused(error)));
        }
        let old = self.rule_sets();
        let mut report = ReloadReport::default();
        let mut next = RuleSets::default();
        for set in new.iter() {
            match old.get(set.id()) {
                Some(kept) if kept == set => next.insert_shared(kept.clone()),
                Some(_) => {
                    report.changed.push(set.id().clone().into());
                    next.insert_shared(set.clone());
                }
                None => {
                    report.added.push(set.id().clone().into());
                    next.insert_shared(set.clone());
                }
            }
        }
        report.removed = old
            .iter()
            .filter(|set| new.get(set.id()).is_none())
            .map(|set| set.id().clone().into())
            .collect();
        report.added.sort();
        report.changed.sort();
        report.removed.sort();
        update.last = ticket;
        if !report.is_empty() {
            self.swap_in(next);
            tracing::info!(%report, "rule sets reloaded");
        } else {
            tracing::debug!("rule sets reloaded: unchanged");
        }
        self.reloads.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        crate::metrics::reloaded(true);
        Ok(report)
    }

    /// Loads rules from `source` and [`replace`](Self::replace)s the rule sets with them.
    ///
    /// Loads may run side by side (a poll and a file watch, say): the result of a load is
    /// dropped, and an empty report returned, when a load that started after it has
    /// already been applied, so that an older read never replaces a newer one.
    ///
    /// # Errors
    ///
    /// [`ReloadError::Source`] when the source fails (logged and counted as a failure, the
    /// rules in force are kept), or the errors of [`replace`](Self::replace).
    pub async fn reload_from(&self, source: &dyn RuleSource) -> Result<ReloadReport, ReloadError> {
        let ticket = self.ticket();
        // A source that panics fails the load like one that returns an error: the task
        // reloading (a poll, a watch, a listener) goes on.
        let loaded = match std::panic::catch_unwind(AssertUnwindSafe(|| source.load())) {
            Ok(load) => CatchPanic(load).await,
            Err(panic) => Err(panic),
        };
        match loaded {
            Ok(Ok(sets)) => self.apply(ticket, sets),
            Ok(Err(error)) => Err(self.failed(ReloadError::Source(error))),
            Err(panic) => {
                let message = panic_message(&*panic);
                let error = format!("the rule source {source:?} panicked: {message}");
                Err(self.failed(ReloadError::Source(error.into())))
            }
        }
    }

    /// Resets the counters of the rule set `id` in every in-memory limiter of the engines
    /// built on this provider (a [`MemoryLimiter`](crate::MemoryLimiter) backend and the
    /// failure fallbacks): its requests start with full buckets. Answers whether the
    /// provider holds that rule set.
    ///
    /// The rule set is swapped for one of the next [generation](RuleSet::generation),
    /// whose bands have new identities; the old counters are dropped as they go idle.
    /// Rule sets loaded later for the same id keep the new generation, so a reload does
    /// not bring the old counters back. Keys in Redis do not depend on the generation:
    /// `RedisLimiter::reset_buckets` (crate `fluxgate-redis`) resets those, once for all
    /// instances.
    pub fn reset_buckets(&self, id: &str) -> bool {
        self.reset_where(|set| &**set.id() == id) > 0
    }

    /// Resets the counters of every rule set held, as [`reset_buckets`](Self::reset_buckets)
    /// does for one; answers how many rule sets there are.
    pub fn reset_all_buckets(&self) -> usize {
        self.reset_where(|_| true)
    }

    fn reset_where(&self, wanted: impl Fn(&RuleSet) -> bool) -> usize {
        let mut update = self.update.lock().unwrap_or_else(PoisonError::into_inner);
        let old = self.rule_sets();
        let mut next = RuleSets::default();
        let mut reset: Vec<Arc<str>> = Vec::new();
        for set in old.iter() {
            if wanted(set) {
                let generation = set.generation().wrapping_add(1);
                update.generations.insert(set.id().clone().into(), generation);
                let set = Arc::new(set.with_generation(generation));
                // The engines' leases of the rule set end with its counters (see
                // `LeaseWatch::rules_changed`).
                self.checks.run_each(&set);
                reset.push(set.id().clone().into());
                next.insert_shared(set);
            } else {
                next.insert_shared(set.clone());
            }
        }
        if !reset.is_empty() {
            reset.sort();
            self.swap_in(next);
            tracing::info!(rule_sets = ?reset, "in-memory counters reset");
        }
        reset.len()
    }

    /// Successful replacements, whether they changed anything or not. With the `metrics`
    /// feature, each one also counts in `fluxgate_reloads_total{result="ok"}`.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Failed reloads: a source that failed, or new rules an engine's limiter refused.
    /// With the `metrics` feature, each one also counts in
    /// `fluxgate_reloads_total{result="failed"}`.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Runs every stored check on every rule set of `sets`, by id (the same error first
    /// whatever the map's order).
    fn check(&self, sets: &RuleSets) -> Result<(), RuleError> {
        if self.checks.len() == 0 {
            return Ok(());
        }
        let mut sorted: Vec<&Arc<RuleSet>> = sets.iter().collect();
        sorted.sort_by(|a, b| a.id().cmp(b.id()));
        sorted.into_iter().try_for_each(|set| self.checks.run(set))
    }

    fn failed(&self, error: ReloadError) -> ReloadError {
        self.failures.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        crate::metrics::reloaded(false);
        tracing::warn!(%error, "rule reload failed");
        error
    }
}

impl Default for ReloadingRuleSetProvider {
    fn default() -> Self {
        Self::new(RuleSets::default())
    }
}

thread_local! {
    /// Per thread and provider: the provider's version, and the rule sets in force then.
    static SNAPSHOTS: RefCell<Vec<(u64, u64, Arc<RuleSets>)>> = const { RefCell::new(Vec::new()) };
}

/// The most providers of which each thread keeps a snapshot.
const SNAPSHOTS_KEPT: usize = 8;

impl ReloadingRuleSetProvider {
    /// The rule sets in force, from this thread's snapshot while no swap happened since it
    /// was taken: a lookup then reads one shared counter and writes nothing shared.
    fn with_current<R>(&self, f: impl FnOnce(&RuleSets) -> R) -> R {
        let version = self.version.load(Ordering::Acquire);
        let mut f = Some(f);
        // Used in place: a clone of the snapshot's `Arc` would write its shared count.
        let done = SNAPSHOTS.try_with(|snapshots| {
            let mut snapshots = snapshots.try_borrow_mut().ok()?;
            let at = match snapshots.iter().position(|(uid, _, _)| *uid == self.uid) {
                Some(at) if snapshots[at].1 == version => at,
                Some(at) => {
                    snapshots[at] = (self.uid, version, self.rule_sets());
                    at
                }
                None => {
                    if snapshots.len() >= SNAPSHOTS_KEPT {
                        snapshots.remove(0);
                    }
                    snapshots.push((self.uid, version, self.rule_sets()));
                    snapshots.len() - 1
                }
            };
            let f = f.take()?;
            Some(f(&snapshots[at].2))
        });
        match (done, f) {
            (Ok(Some(result)), _) => result,
            (_, Some(f)) => f(&self.rule_sets()),
            (_, None) => unreachable!("the lookup ran, so it answered"),
        }
    }

    /// Puts `next` in force.
    fn swap_in(&self, next: RuleSets) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(next);
        self.version.fetch_add(1, Ordering::Release);
    }
}

impl RuleSetProvider for ReloadingRuleSetProvider {
    /// Hands out the looking thread's own copy of the rule set (see [`RuleSetProvider`]).
    fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
        MaybeReady::ready(Ok(self.with_current(|current| current.get(id).map(local_copy))))
    }

    /// Checks the rule sets in force with `check`, and keeps it for every later
    /// replacement.
    fn validate(&self, check: RuleCheck) -> Result<(), RuleError> {
        // No replacement between the check and the push.
        let _update = self.update.lock().unwrap_or_else(PoisonError::into_inner);
        self.rule_sets().validate(check.clone())?;
        self.checks.push(&check);
        Ok(())
    }
}

impl fmt::Debug for ReloadingRuleSetProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingRuleSetProvider")
            .field("rule_sets", &self.rule_sets().len())
            .field("checks", &self.checks.len())
            .field("reloads", &self.reloads())
            .field("failures", &self.failures())
            .finish()
    }
}

/// Polls a future, turning a panic into an `Err` with its payload.
struct CatchPanic<F>(F);

impl<F: Future + Unpin> Future for CatchPanic<F> {
    type Output = Result<F::Output, Box<dyn std::any::Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(inner).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

/// The message of a panic's payload, when it has one.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Where new rules come from.
///
/// Object safe: [`spawn_polling`] holds an `Arc<dyn RuleSource>`.
pub trait RuleSource: Send + Sync + fmt::Debug + 'static {
    /// Loads every rule set of the source, validated.
    ///
    /// # Errors
    ///
    /// Whatever keeps the source from giving complete, valid rules: a reload then keeps
    /// the rules in force.
    fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>>;
}

/// Rules from one rule file, or from every rule file of a directory.
///
/// A directory's rule files are those named `*.yaml`, `*.yml`, `*.toml` or `*.json`
/// (the extension picks the format), read in name order; names starting with `.` (editor
/// and lock files), subdirectories and other files are skipped. Their rule sets are
/// merged: a rule set id found in two files is an error naming both, and so is a
/// directory without rule files (more likely a mount not ready than a wish to drop every
/// rule). Rules that hold no rule set at all (`rule_sets: []` in every file) are an error
/// too unless [`allow_empty`](Self::allow_empty) is set: a reload would otherwise remove
/// every rule set in force.
///
/// Whether the path is a file or a directory is decided at each load.
#[derive(Debug, Clone)]
pub struct FileRuleSource {
    path: PathBuf,
    allow_empty: bool,
}

/// Why a [`FileRuleSource`] could not load rules.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileSourceError {
    /// A rule file is unreadable or invalid: a [`RuleError::File`] naming it.
    #[error(transparent)]
    Rules(#[from] RuleError),
    /// The path, or the directory's listing, cannot be read.
    #[error("rule path `{}`: cannot read: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Two files of the directory define the same rule set.
    #[error("rule set `{id}` is defined in `{}` and again in `{}`", first.display(), second.display())]
    DuplicateRuleSet {
        /// The rule set's id.
        id: String,
        /// The file that defines it first, in name order.
        first: PathBuf,
        /// The other file.
        second: PathBuf,
    },
    /// The directory holds no rule file.
    #[error("rule directory `{}` holds no .yaml, .yml, .toml or .json file", path.display())]
    NoRuleFiles {
        /// The directory.
        path: PathBuf,
    },
    /// The file, or every rule file of the directory, holds no rule set (`rule_sets: []`),
    /// and [`FileRuleSource::allow_empty`] is not set.
    #[error("rule path `{}` holds no rule set; the rules in force are kept (allow_empty allows this)", path.display())]
    NoRuleSets {
        /// The file or directory.
        path: PathBuf,
    },
    /// The blocking read was cancelled (the runtime is shutting down).
    #[error("rule files read cancelled: {0}")]
    Cancelled(String),
}

impl FileRuleSource {
    /// A source reading this rule file or directory.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            allow_empty: false,
        }
    }

    /// Whether a load may find no rule set at all. Default `false`: a file with
    /// `rule_sets: []` (a template rendered without its data, a list emptied by mistake),
    /// or a directory whose rule files all hold none, fails the load with
    /// [`FileSourceError::NoRuleSets`], so that a reload keeps the rules in force, as the
    /// Redis and MongoDB sources do with an empty store.
    #[must_use]
    pub fn allow_empty(mut self, allow: bool) -> Self {
        self.allow_empty = allow;
        self
    }

    /// The file or directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the rules now, blocking the thread: for the first load, before a runtime runs.
    ///
    /// # Errors
    ///
    /// See [`FileSourceError`]; each names the file or directory at fault.
    pub fn read(&self) -> Result<RuleSets, FileSourceError> {
        let sets = self.read_all()?;
        if sets.is_empty() && !self.allow_empty {
            return Err(FileSourceError::NoRuleSets {
                path: self.path.clone(),
            });
        }
        Ok(sets)
    }

    fn read_all(&self) -> Result<RuleSets, FileSourceError> {
        let io = |source| FileSourceError::Io {
            path: self.path.clone(),
            source,
        };
        if !std::fs::metadata(&self.path).map_err(io)?.is_dir() {
            return Ok(RuleSets::from_file(&self.path)?);
        }
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&self.path).map_err(io)? {
            let entry = entry.map_err(io)?;
            let path = entry.path();
            let hidden = entry.file_name().to_string_lossy().starts_with('.');
            if hidden || Format::from_path(&path).is_none() {
                continue;
            }
            // Follows symbolic links (as mounted configuration often uses them).
            let metadata = std::fs::metadata(&path).map_err(|source| FileSourceError::Io {
                path: path.clone(),
                source,
            })?;
            if metadata.is_file() {
                files.push(path);
            }
        }
        if files.is_empty() {
            return Err(FileSourceError::NoRuleFiles {
                path: self.path.clone(),
            });
        }
        files.sort();
        let mut merged = RuleSets::default();
        let mut origin: Vec<(Arc<str>, usize)> = Vec::new();
        for (i, file) in files.iter().enumerate() {
            let sets = RuleSets::from_file(file)?;
            let mut ids: Vec<&Arc<RuleSet>> = sets.iter().collect();
            ids.sort_by(|a, b| a.id().cmp(b.id()));
            for set in ids {
                if let Some((_, first)) = origin.iter().find(|(id, _)| **id == **set.id()) {
                    return Err(FileSourceError::DuplicateRuleSet {
                        id: set.id().to_string(),
                        first: files[*first].clone(),
                        second: file.clone(),
                    });
                }
                origin.push((set.id().clone().into(), i));
                merged.insert_shared(set.clone());
            }
        }
        Ok(merged)
    }
}

impl RuleSource for FileRuleSource {
    /// [`read`](Self::read) on tokio's blocking threads when a tokio runtime runs the
    /// caller, on the caller's thread otherwise.
    fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
        let source = self.clone();
        Box::pin(async move {
            let read = match tokio::runtime::Handle::try_current() {
                Ok(runtime) => runtime
                    .spawn_blocking(move || source.read())
                    .await
                    .unwrap_or_else(|e| Err(FileSourceError::Cancelled(e.to_string()))),
                Err(_) => source.read(),
            };
            read.map_err(BoxError::from)
        })
    }
}

/// The polling period to use when none is chosen: 5 s. A change is then in force on every
/// instance within 5 s plus one load (2.5 s on average).
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// Reloads `provider` from `source` every `every` (at least 1 ms; see
/// [`DEFAULT_POLL_INTERVAL`]), on the tokio runtime of
/// the caller, the first time one period after the call.
///
/// A failed load or a refused rule set keeps the rules in force (the failure is logged
/// and counted, see [`ReloadingRuleSetProvider::failures`]), and the next period tries
/// again. Rules are at most one period, plus the time of one load, stale.
///
/// The task holds the provider weakly: it ends once the provider is dropped everywhere
/// else (engines hold it while they live), or when the handle is aborted.
///
/// # Panics
///
/// When called outside a tokio runtime.
pub fn spawn_polling(
    provider: Arc<ReloadingRuleSetProvider>,
    source: Arc<dyn RuleSource>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    let provider: Weak<ReloadingRuleSetProvider> = Arc::downgrade(&provider);
    // At least 1 ms; at most a year, so that the first tick's instant cannot overflow.
    let every = every.clamp(Duration::from_millis(1), Duration::from_secs(365 * 24 * 3600));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(provider) = provider.upgrade() else {
                return;
            };
            // Logged and counted by the provider; the next tick tries again.
            let _ = provider.reload_from(&*source).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    fn sets(yaml: &str) -> RuleSets {
        RuleSets::from_yaml_str(yaml).unwrap()
    }

    const ONE: &str = "rule_sets: [{id: a, rules: [{id: r, bands: [{capacity: 5, window: 1s}]}]}, {id: b, rules: []}]";

    #[test]
    fn replace_reports_added_changed_removed_and_keeps_unchanged_arcs() {
        let provider = ReloadingRuleSetProvider::new(sets(ONE));
        let b = provider.rule_sets().get("b").unwrap().clone();
        // This thread's snapshot is taken by a lookup, and read again after each swap.
        assert!(provider.rule_set("c").into_ready().unwrap().unwrap().is_none());
        let report = provider
            .replace(sets(
                "rule_sets: [{id: a, rules: [{id: r, bands: [{capacity: 6, window: 1s}]}]}, {id: b, rules: []}, {id: c, rules: []}]",
            ))
            .unwrap();
        assert_eq!(
            (report.added.clone(), report.changed.clone(), report.removed.clone()),
            (vec!["c".into()], vec!["a".into()], vec![])
        );
        assert_eq!(report.to_string(), "added [c], changed [a], removed []");
        assert!(Arc::ptr_eq(provider.rule_sets().get("b").unwrap(), &b));
        assert!(provider.rule_set("c").into_ready().unwrap().unwrap().is_some());

        let report = provider.replace(sets("rule_sets: [{id: b, rules: []}]")).unwrap();
        assert_eq!(report.removed, ["a".into(), "c".into()]);
        assert!(Arc::ptr_eq(provider.rule_sets().get("b").unwrap(), &b));
        assert!(provider.rule_set("a").into_ready().unwrap().unwrap().is_none());

        // Equal content written differently is unchanged.
        let snapshot = provider.rule_sets();
        let report = provider.replace(sets("rule_sets:\n  - id: b\n")).unwrap();
        assert!(report.is_empty());
        assert!(
            Arc::ptr_eq(&snapshot, &provider.rule_sets()),
            "an unchanged reload swaps nothing"
        );
        assert_eq!((provider.reloads(), provider.failures()), (3, 0));
    }

    #[test]
    fn every_engines_check_is_run_and_a_refusal_changes_nothing() {
        let provider = ReloadingRuleSetProvider::new(sets(ONE));
        let calls = Arc::new(AtomicUsize::new(0));
        let counting = calls.clone();
        let count: RuleCheck = Arc::new(move |_: &RuleSet| {
            counting.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        provider.validate(count.clone()).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2, "the rule sets in force are checked");
        let refuse_c: RuleCheck = Arc::new(|set: &RuleSet| {
            if &**set.id() == "c" {
                Err(RuleError::UnknownFormat)
            } else {
                Ok(())
            }
        });
        provider.validate(refuse_c.clone()).unwrap();

        let before = provider.rule_sets();
        let error = provider.replace(sets("rule_sets: [{id: c, rules: []}]")).unwrap_err();
        assert!(
            matches!(error, ReloadError::Refused(RuleError::UnknownFormat)),
            "{error:?}"
        );
        assert!(Arc::ptr_eq(&before, &provider.rule_sets()));
        assert_eq!((provider.reloads(), provider.failures()), (0, 1));
        assert_eq!(calls.load(Ordering::SeqCst), 3);

        // The provider holds checks weakly: once their holder (an engine) is gone, they
        // no longer apply and no longer keep what they captured alive.
        drop(refuse_c);
        provider.replace(sets("rule_sets: [{id: c, rules: []}]")).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        let weak = Arc::downgrade(&count);
        drop(count);
        assert!(weak.upgrade().is_none(), "the provider does not keep a check alive");
        provider.replace(sets(ONE)).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn an_engine_dropped_no_longer_checks_and_its_limiter_is_freed() {
        let provider = Arc::new(ReloadingRuleSetProvider::new(sets(ONE)));
        let limiter = Arc::new(crate::MemoryLimiter::default());
        let engine = crate::Engine::builder(provider.clone())
            .shared_limiter(limiter.clone())
            .build()
            .unwrap();
        assert_eq!(Arc::strong_count(&limiter), 3, "the test, the engine and its check");
        drop(engine);
        assert_eq!(Arc::strong_count(&limiter), 1, "nothing else keeps the limiter");
    }

    fn allowed(engine: &crate::Engine, id: &str) -> usize {
        let ctx = crate::RequestContext::builder().rule_set_id(id).build();
        (0..10)
            .filter(|_| engine.check(&ctx).into_ready().unwrap().unwrap().allowed())
            .count()
    }

    const TWO_GLOBAL: &str = "rule_sets:
  - {id: a, rules: [{id: r, scope: global, bands: [{capacity: 3, window: 1h}]}]}
  - {id: b, rules: [{id: r, scope: global, bands: [{capacity: 3, window: 1h}]}]}";

    #[test]
    fn a_reset_starts_one_rule_sets_counters_fresh_and_a_reload_keeps_them_fresh() {
        let provider = Arc::new(ReloadingRuleSetProvider::new(sets(TWO_GLOBAL)));
        let engine = crate::Engine::builder(provider.clone()).build().unwrap();
        let a = |_| allowed(&engine, "a");
        let b = |_| allowed(&engine, "b");
        assert_eq!((a(()), b(())), (3, 3));
        assert_eq!((a(()), b(())), (0, 0));

        assert!(provider.reset_buckets("a"));
        assert!(!provider.reset_buckets("missing"));
        assert_eq!(provider.rule_sets().get("a").unwrap().generation(), 1);
        assert_eq!((a(()), b(())), (3, 0), "only a's counters start fresh");

        // The same rules read again: nothing changes, the old counters do not come back.
        let report = provider.replace(sets(TWO_GLOBAL)).unwrap();
        assert!(report.is_empty(), "{report}");
        assert_eq!((a(()), b(())), (0, 0));

        assert_eq!(provider.reset_all_buckets(), 2);
        assert_eq!((a(()), b(())), (3, 3));
    }

    /// A source that counts its loads (also used by the watch's tests).
    #[derive(Debug, Default)]
    pub(super) struct Counting(pub(super) Arc<AtomicUsize>);

    impl RuleSource for Counting {
        fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(RuleSets::default()) })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn polling_runs_on_its_period_and_ends_with_the_provider() {
        let provider = Arc::new(ReloadingRuleSetProvider::default());
        let loads = Arc::new(AtomicUsize::new(0));
        let task = spawn_polling(
            provider.clone(),
            Arc::new(Counting(loads.clone())),
            Duration::from_secs(10),
        );
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(
            loads.load(Ordering::SeqCst),
            0,
            "the first poll is one period after the call"
        );
        tokio::time::sleep(Duration::from_secs(25)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 3);
        assert_eq!(provider.reloads(), 3);
        drop(provider);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(task.is_finished(), "the task ends once the provider is gone");
        assert_eq!(loads.load(Ordering::SeqCst), 3);
    }

    /// A source that answers `yaml` after `delay`.
    #[derive(Debug)]
    struct Slow {
        yaml: &'static str,
        delay: Duration,
    }

    impl RuleSource for Slow {
        fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
            let (yaml, delay) = (self.yaml, self.delay);
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                Ok(sets(yaml))
            })
        }
    }

    /// A source that panics, when it is called or when its load is polled.
    #[derive(Debug)]
    struct Panicking {
        when_polled: bool,
    }

    impl RuleSource for Panicking {
        fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
            assert!(self.when_polled, "a source that panics when called");
            Box::pin(async { panic!("a source that panics when polled") })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_source_fails_the_load_and_polling_goes_on() {
        let provider = Arc::new(ReloadingRuleSetProvider::new(sets(ONE)));
        let before = provider.rule_sets();
        for when_polled in [false, true] {
            let error = provider.reload_from(&Panicking { when_polled }).await.unwrap_err();
            assert!(error.to_string().contains("panicked: a source that panics"), "{error}");
        }
        assert!(Arc::ptr_eq(&before, &provider.rule_sets()));
        assert_eq!((provider.reloads(), provider.failures()), (0, 2));

        let polling = spawn_polling(
            provider.clone(),
            Arc::new(Panicking { when_polled: true }),
            Duration::from_secs(1),
        );
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert_eq!(provider.failures(), 5, "every poll ran, the task survived");
        assert!(!polling.is_finished());
        polling.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_older_read_never_replaces_a_newer_one() {
        let provider = Arc::new(ReloadingRuleSetProvider::new(sets(ONE)));
        let old = Slow {
            yaml: "rule_sets: [{id: a, rules: [{id: r, bands: [{capacity: 1, window: 1s}]}]}]",
            delay: Duration::from_secs(2),
        };
        let new = Slow {
            yaml: "rule_sets: [{id: a, rules: [{id: r, bands: [{capacity: 9, window: 1s}]}]}]",
            delay: Duration::from_secs(1),
        };
        // The older load starts first and finishes last.
        let (old_report, new_report) = tokio::join!(provider.reload_from(&old), async {
            tokio::task::yield_now().await;
            provider.reload_from(&new).await
        });
        assert_eq!(new_report.unwrap().changed, ["a".into()]);
        assert!(old_report.unwrap().is_empty(), "the older read is dropped");
        let capacity = provider.rule_sets().get("a").unwrap().rules()[0].bands()[0].capacity();
        assert_eq!(capacity, 9);
    }
}
