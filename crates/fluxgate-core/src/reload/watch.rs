//! File watch: reload a [`FileRuleSource`] when its files change (feature `watch`).

use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecursiveMode, Watcher as _};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{FileRuleSource, ReloadError, ReloadReport, ReloadingRuleSetProvider, RuleSource};
use crate::error::BoxError;
use crate::rule::Format;

/// How long a [`Watch`] waits, by default, for the file system to be quiet before it
/// reloads: a save is often several events (truncate, write, close, rename).
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(100);

/// A burst of events holds a reload back at most this many debounce periods.
const MAX_HOLD: u32 = 10;

/// A rule file written in place and not closed yet holds a reload back at most this long
/// (or ten debounce periods, if longer): its writer may pause between two writes.
const OPEN_HOLD: Duration = Duration::from_secs(60);

/// Whether the platform's watch reports that a file written to was closed (inotify's
/// `IN_CLOSE_WRITE`): elsewhere, a file is taken as complete once the debounce is quiet.
const SEES_CLOSE: bool = cfg!(any(target_os = "linux", target_os = "android"));

type OnReload = Arc<dyn Fn(&Result<ReloadReport, ReloadError>) + Send + Sync>;

/// Reloads `provider` from `source` whenever its file, or a rule file of its directory,
/// changes: [`Watch::builder`] with the defaults (a [`DEFAULT_DEBOUNCE`] of 100 ms, no
/// callback).
///
/// See [`WatchBuilder::spawn`] for what is watched, the debounce and the staleness bound.
/// Watching stops when the returned [`Watch`] is dropped.
///
/// ```no_run
/// use std::sync::Arc;
/// use fluxgate_core::reload::{spawn_watching, FileRuleSource, ReloadingRuleSetProvider};
/// use fluxgate_core::Engine;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let source = FileRuleSource::new("/etc/myapp/rules.yaml");
/// let provider = Arc::new(ReloadingRuleSetProvider::new(source.read()?));
/// let engine = Engine::builder(provider.clone()).build()?;
/// // Inside a tokio runtime; keep `watch` alive as long as the rules should follow the file.
/// let watch = spawn_watching(provider.clone(), source)?;
/// # drop((engine, watch));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`WatchError`] when the directory to watch cannot be watched.
///
/// # Panics
///
/// When called outside a tokio runtime.
pub fn spawn_watching(provider: Arc<ReloadingRuleSetProvider>, source: FileRuleSource) -> Result<Watch, WatchError> {
    Watch::builder(provider, source).spawn()
}

/// Sets up a [`Watch`]: [`Watch::builder`].
#[must_use = "a builder does nothing until `spawn` is called"]
pub struct WatchBuilder {
    provider: Arc<ReloadingRuleSetProvider>,
    source: FileRuleSource,
    debounce: Duration,
    on_reload: Option<OnReload>,
}

impl WatchBuilder {
    /// How long the file system must be quiet before a reload (default
    /// [`DEFAULT_DEBOUNCE`], 100 ms; from 1 ms to one hour). A burst of events that never goes
    /// quiet reloads every ten periods.
    pub fn debounce(mut self, quiet: Duration) -> Self {
        // At least 1 ms; at most an hour, so that ten periods from now cannot overflow.
        self.debounce = quiet.clamp(Duration::from_millis(1), Duration::from_secs(3600));
        self
    }

    /// Called after every reload the watch makes, with its result: the
    /// [`ReloadReport`] of what changed, or why the rules in force were kept (the
    /// provider has already logged and counted the failure). Runs on the watch's task:
    /// keep it short.
    pub fn on_reload(mut self, callback: impl Fn(&Result<ReloadReport, ReloadError>) + Send + Sync + 'static) -> Self {
        self.on_reload = Some(Arc::new(callback));
        self
    }

    /// Starts watching, on the tokio runtime of the caller.
    ///
    /// **What is watched.** When the source's path is a directory: that directory, and an
    /// event on any of its rule files (the files [`FileRuleSource`] reads: `*.yaml`,
    /// `*.yml`, `*.toml`, `*.json`, names not starting with `.`) triggers a reload. When it
    /// is a file (or does not exist yet): its parent directory, and an event naming the
    /// file triggers a reload, so that an editor that saves by writing another file and
    /// renaming it over the rule file is seen (a watch on the file itself would follow the
    /// old, replaced file). In both cases a swap of an entry named `..data` (how
    /// Kubernetes updates a mounted ConfigMap) triggers a reload too. Reads of the files,
    /// including the watch's own, trigger nothing. Subdirectories are not watched.
    ///
    /// **Debounce.** The watch reloads once the file system has been quiet for the
    /// debounce period (100 ms by default) after an event, or ten periods after the first
    /// event of a burst that never goes quiet. On Linux, a rule file written to in place
    /// also holds the reload until its writer closes it (at most a minute, or ten periods
    /// if longer): a file truncated and written in pieces is not read cut, as valid rules
    /// with some missing. An event during a reload triggers another one: the last edit is
    /// always loaded.
    ///
    /// **Staleness bound.** A change is in force at most one debounce period plus the
    /// time of one load after the last write of the burst (on Linux, inotify delivers
    /// events within microseconds).
    ///
    /// **Failures** keep the rules in force, as every reload of the provider does: an
    /// unreadable or invalid file, or a rule set an engine's limiter refuses, is logged and
    /// counted ([`ReloadingRuleSetProvider::failures`]); the next change tries again.
    ///
    /// The watch does not load the rules when it starts: load them first (as
    /// [`FileRuleSource::read`] for the provider), then spawn the watch. An edit made
    /// between that read and the start of the watch is loaded with the next change (or
    /// at once with [`ReloadingRuleSetProvider::reload_from`] after the spawn). It holds
    /// the provider weakly, and ends when the [`Watch`] is dropped.
    ///
    /// # Errors
    ///
    /// [`WatchError`] when the directory cannot be watched (it does not exist, or the
    /// system's limit of watches is reached).
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn(self) -> Result<Watch, WatchError> {
        let path = self.source.path();
        let (dir, target) = if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            let name = path.file_name().map(OsString::from);
            (path.to_path_buf(), Target::Directory(name))
        } else {
            let name = path.file_name().ok_or_else(|| WatchError {
                path: path.to_path_buf(),
                source: "the path names no file".into(),
            })?;
            (parent_of(path), Target::File(name.to_os_string()))
        };
        let trigger = Arc::new(Notify::new());
        let events = trigger.clone();
        let writers = Arc::new(Writers::default());
        let seen = writers.clone();
        let rewatch = matches!(target, Target::Directory(_)).then(|| dir.clone());
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            Ok(event) => {
                if target.wants(&event) {
                    seen.see(&event);
                    events.notify_one();
                }
            }
            Err(error) => {
                // Events may have been lost: reload to be sure.
                tracing::warn!(%error, "rule file watch error");
                seen.clear();
                events.notify_one();
            }
        })
        .map_err(|e| WatchError {
            path: dir.clone(),
            source: e.into(),
        })?;
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(|e| WatchError {
                path: dir.clone(),
                source: e.into(),
            })?;
        if rewatch.is_some() {
            // A directory replaced by another (renamed over it) is seen in its parent.
            let parent = parent_of(&dir);
            if let Err(error) = watcher.watch(&parent, RecursiveMode::NonRecursive) {
                tracing::warn!(%error, parent = %parent.display(), "cannot watch the rule directory's parent: a directory renamed over the rule directory will not be seen");
            }
        }
        let watcher = Arc::new(Mutex::new(watcher));
        let task = tokio::spawn(run(
            Arc::downgrade(&self.provider),
            Arc::new(self.source),
            trigger,
            writers,
            self.debounce,
            self.on_reload,
            rewatch.map(|dir| (dir, watcher.clone())),
        ));
        Ok(Watch {
            dir,
            task,
            _watcher: watcher,
        })
    }
}

/// The directory a file lives in (`.` for a bare file name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

impl fmt::Debug for WatchBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WatchBuilder")
            .field("source", &self.source)
            .field("debounce", &self.debounce)
            .field("on_reload", &self.on_reload.is_some())
            .finish_non_exhaustive()
    }
}

/// A running file watch: reloads a [`ReloadingRuleSetProvider`] from a
/// [`FileRuleSource`] when its files change. Made by [`spawn_watching`] or
/// [`Watch::builder`]; dropping it stops watching.
#[must_use = "the watch stops when dropped"]
pub struct Watch {
    dir: PathBuf,
    task: tokio::task::JoinHandle<()>,
    _watcher: Arc<Mutex<notify::RecommendedWatcher>>,
}

impl Watch {
    /// A builder: set the debounce period or a callback, then
    /// [`spawn`](WatchBuilder::spawn).
    pub fn builder(provider: Arc<ReloadingRuleSetProvider>, source: FileRuleSource) -> WatchBuilder {
        WatchBuilder {
            provider,
            source,
            debounce: DEFAULT_DEBOUNCE,
            on_reload: None,
        }
    }

    /// The directory watched: the source's directory, or the parent of its file.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // The task first, then (as a field) the watcher and its thread.
        self.task.abort();
    }
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch").field("dir", &self.dir).finish_non_exhaustive()
    }
}

/// Why a [`Watch`] could not start.
#[derive(Debug, thiserror::Error)]
#[error("rule path `{}`: cannot watch: {source}", path.display())]
pub struct WatchError {
    path: PathBuf,
    #[source]
    source: BoxError,
}

impl WatchError {
    /// The directory (or path) that could not be watched.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Which events of the watched directory trigger a reload.
#[derive(Debug)]
enum Target {
    /// Events naming this file.
    File(OsString),
    /// Events naming a rule file of the directory, or the directory itself (by this name,
    /// in its parent: replaced, moved, removed).
    Directory(Option<OsString>),
}

impl Target {
    fn wants(&self, event: &notify::Event) -> bool {
        if event.need_rescan() {
            return true;
        }
        // Opening and reading (the reload's own reads among them) change nothing.
        if matches!(event.kind, EventKind::Access(kind) if kind != AccessKind::Close(AccessMode::Write)) {
            return false;
        }
        event.paths.iter().any(|path| {
            let Some(name) = path.file_name() else {
                return false;
            };
            if name == "..data" {
                return true;
            }
            match self {
                Self::File(file) => name == file,
                Self::Directory(own) => {
                    own.as_deref() == Some(name)
                        || (!name.to_string_lossy().starts_with('.') && Format::from_path(path).is_some())
                }
            }
        })
    }
}

/// The rule files written to in place and not closed since: a reload would read them
/// half-written. Kept where the platform reports the close ([`SEES_CLOSE`]).
#[derive(Debug, Default)]
struct Writers(Mutex<HashSet<PathBuf>>);

impl Writers {
    /// Follows an event on the rule files.
    fn see(&self, event: &notify::Event) {
        if !SEES_CLOSE {
            return;
        }
        let mut open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if event.need_rescan() {
            open.clear();
            return;
        }
        match event.kind {
            EventKind::Modify(ModifyKind::Data(_)) => open.extend(event.paths.iter().cloned()),
            // Closed, removed, or renamed: no longer written to under this name.
            EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Name(_)) => {
                for path in &event.paths {
                    open.remove(path);
                }
            }
            _ => {}
        }
    }

    /// Forgets every file (events may have been lost).
    fn clear(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }

    /// Whether a rule file is being written to.
    fn any(&self) -> bool {
        !self.0.lock().unwrap_or_else(PoisonError::into_inner).is_empty()
    }
}

/// The watch's task: waits for an event, lets the burst settle, watches a directory
/// source again (it may have been replaced), reloads.
async fn run(
    provider: Weak<ReloadingRuleSetProvider>,
    source: Arc<dyn RuleSource>,
    trigger: Arc<Notify>,
    writers: Arc<Writers>,
    debounce: Duration,
    on_reload: Option<OnReload>,
    rewatch: Option<(PathBuf, Arc<Mutex<notify::RecommendedWatcher>>)>,
) {
    loop {
        trigger.notified().await;
        settle(&trigger, &writers, debounce).await;
        let Some(provider) = provider.upgrade() else {
            return;
        };
        if let Some((dir, watcher)) = &rewatch {
            watch_again(dir, watcher);
        }
        // Logged and counted by the provider, a panic of the source included.
        let result = provider.reload_from(&*source).await;
        if let Some(callback) = &on_reload {
            let call = std::panic::AssertUnwindSafe(|| callback(&result));
            if std::panic::catch_unwind(call).is_err() {
                tracing::error!("the rule watch's reload callback panicked");
            }
        }
    }
}

/// Watches `dir` again: when it was replaced by another directory, the watch follows the
/// new one. A directory that is missing now is watched again at the next event of its
/// parent.
fn watch_again(dir: &Path, watcher: &Mutex<notify::RecommendedWatcher>) {
    let mut watcher = watcher.lock().unwrap_or_else(PoisonError::into_inner);
    let _ = watcher.unwatch(dir);
    if let Err(error) = watcher.watch(dir, RecursiveMode::NonRecursive) {
        tracing::warn!(%error, dir = %dir.display(), "cannot watch the rule directory again");
    }
}

/// Returns once `trigger` has been quiet for `quiet`, or `MAX_HOLD` periods after the call,
/// and no rule file is being written to (or `OPEN_HOLD` passed): a writer that truncates a
/// file and writes it in pieces leaves it cut in between, and a file cut after a complete
/// rule set, or a complete rule, is valid rules with some missing.
async fn settle(trigger: &Notify, writers: &Writers, quiet: Duration) {
    let start = Instant::now();
    let deadline = start + quiet * MAX_HOLD;
    let open_deadline = start + OPEN_HOLD.max(quiet * MAX_HOLD);
    loop {
        let writing = writers.any();
        let until = (Instant::now() + quiet).min(if writing { open_deadline } else { deadline });
        let quiet_now = tokio::time::timeout_at(until, trigger.notified()).await.is_err();
        let now = Instant::now();
        if writers.any() {
            if now >= open_deadline {
                tracing::warn!("a rule file written to has not been closed for {OPEN_HOLD:?}: reloading it as it is");
                // Read as it is: a file its writer holds open for good holds back no later
                // reload (of it or of another file). Its next write holds them again, and
                // its close triggers a reload of its own.
                writers.clear();
                return;
            }
        } else if quiet_now || now >= deadline {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::super::tests::Counting;
    use super::*;

    fn start(provider: &Arc<ReloadingRuleSetProvider>) -> (Arc<Notify>, Arc<AtomicUsize>) {
        start_with(provider, Arc::new(Writers::default()))
    }

    fn start_with(provider: &Arc<ReloadingRuleSetProvider>, writers: Arc<Writers>) -> (Arc<Notify>, Arc<AtomicUsize>) {
        let trigger = Arc::new(Notify::new());
        let loads = Arc::new(AtomicUsize::new(0));
        tokio::spawn(run(
            Arc::downgrade(provider),
            Arc::new(Counting(loads.clone())),
            trigger.clone(),
            writers,
            Duration::from_millis(100),
            None,
            None,
        ));
        (trigger, loads)
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_reloads_once_after_the_quiet_period() {
        let provider = Arc::new(ReloadingRuleSetProvider::default());
        let (trigger, loads) = start(&provider);
        let step = Duration::from_millis(20);
        for _ in 0..5 {
            trigger.notify_one();
            tokio::time::sleep(step).await;
        }
        // 20 ms after the last event.
        tokio::time::sleep(Duration::from_millis(70)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 0, "still within the quiet period");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 1, "one reload for the burst");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 1, "nothing without events");
        assert_eq!(provider.reloads(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_that_never_ends_reloads_every_ten_periods() {
        let provider = Arc::new(ReloadingRuleSetProvider::default());
        let (trigger, loads) = start(&provider);
        // An event every 50 ms for 2.5 s: never 100 ms quiet.
        for _ in 0..50 {
            trigger.notify_one();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let during = loads.load(Ordering::SeqCst);
        assert!((2..=3).contains(&during), "{during} reloads in 2.5 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            loads.load(Ordering::SeqCst),
            during + 1,
            "and one for the end of the burst"
        );
    }

    /// A rule file its writer holds open for good is read as it is once `OPEN_HOLD` has
    /// passed, and holds back no later reload: a rule file renamed into place afterwards
    /// is in force one debounce period later, not a minute.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test(start_paused = true)]
    async fn a_file_held_open_for_good_holds_back_one_reload_only() {
        use notify::event::{DataChange, ModifyKind, RenameMode};
        let provider = Arc::new(ReloadingRuleSetProvider::default());
        let writers = Arc::new(Writers::default());
        let (trigger, loads) = start_with(&provider, writers.clone());
        writers.see(&event(
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            "/etc/app/held.yaml",
        ));
        trigger.notify_one();
        tokio::time::sleep(OPEN_HOLD - Duration::from_secs(1)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 0, "held while the file is open");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 1, "read as it is after OPEN_HOLD");
        // Another rule file renamed into place; the held one is still open.
        writers.see(&event(
            EventKind::Modify(ModifyKind::Name(RenameMode::Both)),
            "/etc/app/other.yaml",
        ));
        trigger.notify_one();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            loads.load(Ordering::SeqCst),
            2,
            "the next change is not held for a minute"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_task_ends_with_the_provider() {
        let provider = Arc::new(ReloadingRuleSetProvider::default());
        let (trigger, loads) = start(&provider);
        drop(provider);
        trigger.notify_one();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 0);
        assert_eq!(Arc::strong_count(&trigger), 1, "the task is gone");
    }

    fn event(kind: EventKind, path: &str) -> notify::Event {
        notify::Event::new(kind).add_path(PathBuf::from(path))
    }

    #[test]
    fn only_writes_to_the_rule_files_count() {
        use notify::event::{CreateKind, ModifyKind, RenameMode};
        let file = Target::File("rules.yaml".into());
        let write = EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any));
        assert!(file.wants(&event(write, "/etc/app/rules.yaml")));
        assert!(!file.wants(&event(write, "/etc/app/other.yaml")));
        assert!(!file.wants(&event(
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            "/etc/app/rules.yaml"
        )));
        assert!(file.wants(&event(
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            "/etc/app/rules.yaml"
        )));
        let renamed = notify::Event::new(EventKind::Modify(ModifyKind::Name(RenameMode::Both)))
            .add_path(PathBuf::from("/etc/app/.rules.yaml.tmp"))
            .add_path(PathBuf::from("/etc/app/rules.yaml"));
        assert!(file.wants(&renamed));
        assert!(file.wants(&event(EventKind::Create(CreateKind::Any), "/etc/app/..data")));

        let dir = Target::Directory(Some("rules".into()));
        assert!(dir.wants(&event(write, "/etc/app/rules/limits.toml")));
        assert!(dir.wants(&event(
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            "/etc/app/rules"
        )));
        assert!(!dir.wants(&event(write, "/etc/app/other")));
        assert!(!dir.wants(&event(write, "/etc/app/rules/.limits.toml.swp")));
        assert!(!dir.wants(&event(write, "/etc/app/rules/notes.txt")));
    }
}
