//! What the code under test reports: its metrics, caught by `metrics-util`'s debugging
//! recorder installed for the current thread only, and its tracing spans and events, caught
//! by a small `tracing-subscriber` layer of one global subscriber that hands each span and
//! event to the catch open on the thread that reports it. Tests in parallel never see each
//! other's.
//!
//! (One global subscriber rather than one per test: `tracing` caches, per callsite and
//! process-wide, whether any subscriber wants it, and per-thread subscribers set and dropped
//! by tests running in parallel can leave a callsite cached as unwanted.)

// Each test binary uses the part it needs.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// One metric: its kind, name, labels (sorted by name) and value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Metric {
    pub(crate) kind: MetricKind,
    pub(crate) name: String,
    pub(crate) labels: Vec<(String, String)>,
    pub(crate) value: Value,
}

/// A metric's value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Counter(u64),
    Gauge(f64),
    Histogram(Vec<f64>),
}

/// The metrics recorded while a test ran.
#[derive(Debug, Clone)]
pub(crate) struct Metrics(pub(crate) Vec<Metric>);

impl Metrics {
    /// The counter `name` with exactly these labels; 0 when it was never recorded.
    pub(crate) fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.find(MetricKind::Counter, name, labels).map(|m| &m.value) {
            Some(Value::Counter(n)) => *n,
            _ => 0,
        }
    }

    /// The values of the histogram `name` with exactly these labels.
    pub(crate) fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match self.find(MetricKind::Histogram, name, labels).map(|m| &m.value) {
            Some(Value::Histogram(values)) => values.clone(),
            _ => Vec::new(),
        }
    }

    /// Every counter, as `name{label=value,...} = n` lines, sorted: for exact comparisons.
    pub(crate) fn counters(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .0
            .iter()
            .filter_map(|m| match m.value {
                Value::Counter(n) => Some(format!("{}{} = {n}", m.name, braces(&m.labels))),
                _ => None,
            })
            .collect();
        lines.sort();
        lines
    }

    /// Every label value of every metric.
    pub(crate) fn label_values(&self) -> Vec<&str> {
        self.0
            .iter()
            .flat_map(|m| m.labels.iter().map(|(_, v)| v.as_str()))
            .collect()
    }

    fn find(&self, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Option<&Metric> {
        let mut wanted: Vec<(String, String)> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        wanted.sort();
        self.0
            .iter()
            .find(|m| m.kind == kind && m.name == name && m.labels == wanted)
    }
}

fn braces(labels: &[(String, String)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{{{}}}", inner.join(","))
}

fn collect(recorder_snapshot: metrics_util::debugging::Snapshot) -> Metrics {
    Metrics(
        recorder_snapshot
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let (kind, key) = key.into_parts();
                let mut labels: Vec<(String, String)> = key
                    .labels()
                    .map(|l| (l.key().to_string(), l.value().to_string()))
                    .collect();
                labels.sort();
                let value = match value {
                    DebugValue::Counter(n) => Value::Counter(n),
                    DebugValue::Gauge(g) => Value::Gauge(g.into_inner()),
                    DebugValue::Histogram(values) => {
                        Value::Histogram(values.into_iter().map(|v| v.into_inner()).collect())
                    }
                };
                Metric {
                    kind,
                    name: key.name().to_string(),
                    labels,
                    value,
                }
            })
            .collect(),
    )
}

/// Runs `f` with a debugging recorder as this thread's metrics recorder; returns what it
/// recorded.
pub(crate) fn metrics<T>(f: impl FnOnce() -> T) -> (T, Metrics) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let out = metrics::with_local_recorder(&recorder, f);
    (out, collect(snapshotter.snapshot()))
}

/// Runs `f` to completion with a debugging recorder as this thread's metrics recorder; for
/// a test on tokio's current-thread runtime (the default of `#[tokio::test]`), where every
/// task runs on this thread.
pub(crate) async fn metrics_async<T>(f: impl Future<Output = T>) -> (T, Metrics) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let out = {
        let _guard = metrics::set_default_local_recorder(&recorder);
        f.await
    };
    (out, collect(snapshotter.snapshot()))
}

/// A span that was opened: its name, level and fields (those given later included).
#[derive(Debug, Clone)]
pub(crate) struct SpanRecord {
    pub(crate) name: &'static str,
    pub(crate) level: Level,
    pub(crate) fields: BTreeMap<String, String>,
}

/// An event: its level, message, other fields (as a formatter writes them: `%` fields by
/// their `Display`, `?` fields by their `Debug`) and the name of the span it happened in.
#[derive(Debug, Clone)]
pub(crate) struct EventRecord {
    pub(crate) level: Level,
    pub(crate) message: String,
    pub(crate) fields: BTreeMap<String, String>,
    pub(crate) span: Option<&'static str>,
}

/// The spans and events of a test.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    pub(crate) spans: Vec<SpanRecord>,
    pub(crate) events: Vec<EventRecord>,
}

impl Trace {
    /// The spans named `name`.
    pub(crate) fn spans(&self, name: &str) -> Vec<&SpanRecord> {
        self.spans.iter().filter(|s| s.name == name).collect()
    }

    /// The events at `level` or more severe.
    pub(crate) fn events_at_least(&self, level: Level) -> Vec<&EventRecord> {
        // `Level`'s order: TRACE > DEBUG > INFO > WARN > ERROR (the more verbose, the greater).
        self.events.iter().filter(|e| e.level <= level).collect()
    }
}

/// The catch open on this thread, with its number.
type Open = (usize, Arc<Mutex<Trace>>);

thread_local! {
    static OPEN: std::cell::RefCell<Option<Open>> = const { std::cell::RefCell::new(None) };
}

/// The global subscriber's layer: fills the [`Trace`] open on the reporting thread.
struct Catcher;

/// Where a span was recorded: the catch's number and the span's index in its trace.
struct Index(usize, usize);

fn open() -> Option<Open> {
    OPEN.with(|open| open.borrow().clone())
}

/// Installs the global subscriber once per test binary.
fn install() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        let subscriber = tracing_subscriber::registry().with(Catcher);
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber of the tests");
    });
}

/// Opens a catch on this thread until the guard is dropped.
fn catch() -> (CatchGuard, Arc<Mutex<Trace>>) {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    install();
    let trace = Arc::new(Mutex::new(Trace::default()));
    let number = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let previous = OPEN.with(|open| open.borrow_mut().replace((number, trace.clone())));
    (CatchGuard(previous), trace)
}

/// Closes a catch, restoring the one it replaced.
struct CatchGuard(Option<Open>);

impl Drop for CatchGuard {
    fn drop(&mut self) {
        let previous = self.0.take();
        OPEN.with(|open| *open.borrow_mut() = previous);
    }
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Catcher {
    // Enabled only on a thread with a catch open, asked at each call: elsewhere spans and
    // events are off, as without a subscriber (what the engine's short paths look at).
    fn register_callsite(&self, _: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }

    fn enabled(&self, _: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        open().is_some()
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some((number, trace)) = open() else { return };
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let mut trace = trace.lock().unwrap();
        trace.spans.push(SpanRecord {
            name: attrs.metadata().name(),
            level: *attrs.metadata().level(),
            fields: fields.0,
        });
        let index = trace.spans.len() - 1;
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Index(number, index));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some((number, trace)) = open() else { return };
        let Some(span) = ctx.span(id) else { return };
        let Some(&Index(recorded_by, index)) = span.extensions().get::<Index>() else {
            return;
        };
        if recorded_by != number {
            return;
        }
        let mut fields = Fields::default();
        values.record(&mut fields);
        trace.lock().unwrap().spans[index].fields.extend(fields.0);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some((_, trace)) = open() else { return };
        let mut fields = Fields::default();
        event.record(&mut fields);
        let span = ctx.event_span(event).map(|s| s.name());
        let message = fields.0.remove("message").unwrap_or_default();
        trace.lock().unwrap().events.push(EventRecord {
            level: *event.metadata().level(),
            message,
            fields: fields.0,
            span,
        });
    }
}

/// Runs `f`, catching every span and event (all levels) reported on this thread.
pub(crate) fn trace<T>(f: impl FnOnce() -> T) -> (T, Trace) {
    let (guard, trace) = catch();
    let out = f();
    drop(guard);
    let trace = std::mem::take(&mut *trace.lock().unwrap());
    (out, trace)
}

/// Runs `f` to completion, catching every span and event reported on this thread (see
/// [`metrics_async`] for the runtime it needs).
pub(crate) async fn trace_async<T>(f: impl Future<Output = T>) -> (T, Trace) {
    let (guard, trace) = catch();
    let out = f.await;
    drop(guard);
    let trace = std::mem::take(&mut *trace.lock().unwrap());
    (out, trace)
}
