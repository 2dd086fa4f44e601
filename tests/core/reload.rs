//! Hot reload from rule files: only changed rule sets are swapped, counters of unchanged
//! rules survive, and bad rules never replace working ones.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate::core::reload::{spawn_polling, FileSourceError, ReloadError, RuleSource};
use fluxgate::core::{
    BoxError, Decision, Engine, FileRuleSource, MaybeReady, MemoryLimiter, RateLimiter, ReloadingRuleSetProvider,
    RequestContext, RuleError, RuleSet, RuleSetProvider, RuleSets,
};

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fluxgate-reload-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// A rule set `id` with one global rule per `(rule, path prefix, capacity)`, per day (so
/// that nothing refills while a test runs).
fn rule_file(id: &str, rules: &[(&str, &str, u64)]) -> String {
    let rules: String = rules
        .iter()
        .map(|(rule, prefix, capacity)| {
            format!(
                "      - {{id: {rule}, scope: global, match: {{paths: [\"{prefix}/**\"]}}, bands: [{{capacity: {capacity}, window: 1d}}]}}\n"
            )
        })
        .collect();
    format!("rule_sets:\n  - id: {id}\n    rules:\n{rules}")
}

fn write(dir: &Path, file: &str, text: &str) {
    std::fs::write(dir.join(file), text).expect("a rule file written");
}

async fn check(engine: &Engine, rule_set: &str, path: &str) -> Decision {
    let ctx = RequestContext::builder().rule_set_id(rule_set).path(path).build();
    engine.check(&ctx).await.expect("decided")
}

async fn remaining(engine: &Engine, rule_set: &str, path: &str) -> Option<u64> {
    check(engine, rule_set, path).await.remaining()
}

/// Every rule set in force, by id, with its `Arc`.
fn snapshot(provider: &ReloadingRuleSetProvider) -> Vec<Arc<RuleSet>> {
    let mut sets: Vec<_> = provider.rule_sets().iter().cloned().collect();
    sets.sort_by(|a, b| a.id().cmp(b.id()));
    sets
}

fn same_arcs(a: &[Arc<RuleSet>], b: &[Arc<RuleSet>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| Arc::ptr_eq(a, b))
}

/// Waits until the provider has tried `n` reloads, successful or not.
async fn polled(provider: &ReloadingRuleSetProvider, n: u64) {
    while provider.reloads() + provider.failures() < n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two files: `api` (rules `a` on `/a/**`, 5 a day, and `b` on `/b/**`, 50 a day) and
/// `web` (rule `w`, 10 a day).
fn two_files(name: &str) -> (PathBuf, FileRuleSource) {
    let dir = scratch(name);
    write(&dir, "api.yaml", &rule_file("api", &[("a", "/a", 5), ("b", "/b", 50)]));
    write(&dir, "web.toml", &toml_web(10));
    let source = FileRuleSource::new(&dir);
    (dir, source)
}

fn toml_web(capacity: u64) -> String {
    format!(
        "[[rule_sets]]\nid = \"web\"\n[[rule_sets.rules]]\nid = \"w\"\nscope = \"global\"\nbands = [{{ capacity = {capacity}, window = \"1d\" }}]\n"
    )
}

#[tokio::test(start_paused = true)]
async fn twenty_unchanged_polls_change_nothing() {
    let (dir, source) = two_files("unchanged");
    let provider = Arc::new(ReloadingRuleSetProvider::new(source.read().unwrap()));
    let engine = Engine::builder(provider.clone()).build().unwrap();
    let before = snapshot(&provider);
    assert_eq!(before.len(), 2);

    let polling = spawn_polling(provider.clone(), Arc::new(source.clone()), Duration::from_secs(1));
    for i in 1..=20u64 {
        polled(&provider, i).await;
        assert!(same_arcs(&before, &snapshot(&provider)), "poll {i} swapped a rule set");
        assert_eq!(remaining(&engine, "api", "/b/x").await, Some(50 - i));
    }
    polling.abort();
    assert_eq!((provider.reloads(), provider.failures()), (20, 0));

    // Reloads called directly report that nothing changed.
    for _ in 0..20 {
        let report = provider.reload_from(&source).await.unwrap();
        assert!(report.is_empty(), "{report}");
    }
    assert!(same_arcs(&before, &snapshot(&provider)));
    assert_eq!(remaining(&engine, "api", "/b/x").await, Some(29));
    assert_eq!((provider.reloads(), provider.failures()), (40, 0));
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_changed_file_swaps_only_its_rule_set_and_resets_only_the_changed_band() {
    let (dir, source) = two_files("changed");
    let provider = Arc::new(ReloadingRuleSetProvider::new(source.read().unwrap()));
    let engine = Engine::builder(provider.clone()).build().unwrap();
    for _ in 0..2 {
        check(&engine, "api", "/a/x").await;
        check(&engine, "api", "/b/x").await;
        check(&engine, "web", "/").await;
    }
    let before = snapshot(&provider);

    // Rule `a` now allows 3 a day; rule `b` and rule set `web` are unchanged.
    write(&dir, "api.yaml", &rule_file("api", &[("a", "/a", 3), ("b", "/b", 50)]));
    let polling = spawn_polling(provider.clone(), Arc::new(source), Duration::from_secs(5));
    polled(&provider, 1).await;
    polling.abort();
    let after = snapshot(&provider);
    assert!(!Arc::ptr_eq(&before[0], &after[0]), "api was swapped");
    assert!(Arc::ptr_eq(&before[1], &after[1]), "web was kept");
    assert_eq!(after[0].rules()[0].bands()[0].capacity(), 3);

    // The changed band starts fresh with its new capacity, and is enforced at once.
    assert_eq!(remaining(&engine, "api", "/a/x").await, Some(2));
    assert_eq!(remaining(&engine, "api", "/a/x").await, Some(1));
    assert_eq!(remaining(&engine, "api", "/a/x").await, Some(0));
    assert!(!check(&engine, "api", "/a/x").await.allowed());
    // The unchanged rule of the changed set, and the other set, keep their counters.
    assert_eq!(remaining(&engine, "api", "/b/x").await, Some(47));
    assert_eq!(remaining(&engine, "web", "/").await, Some(7));
    assert_eq!((provider.reloads(), provider.failures()), (1, 0));
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_broken_file_keeps_the_rules_in_force() {
    let (dir, source) = two_files("broken");
    let provider = Arc::new(ReloadingRuleSetProvider::new(source.read().unwrap()));
    let engine = Engine::builder(provider.clone()).build().unwrap();
    assert_eq!(remaining(&engine, "api", "/a/x").await, Some(4));
    let before = snapshot(&provider);

    write(&dir, "api.yaml", "rule_sets: [{id: api, rules: [");
    let error = provider.reload_from(&source).await.unwrap_err();
    let ReloadError::Source(inner) = &error else {
        panic!("{error}")
    };
    let file_error = inner.downcast_ref::<FileSourceError>().unwrap();
    assert!(
        matches!(file_error, FileSourceError::Rules(RuleError::File { path, .. }) if path.ends_with("api.yaml")),
        "{file_error:?}"
    );
    assert!(error.to_string().contains("api.yaml"), "{error}");
    assert_eq!(provider.failures(), 1);

    // Polls fail the same way and keep the old rules.
    let polling = spawn_polling(provider.clone(), Arc::new(source), Duration::from_secs(1));
    polled(&provider, 4).await;
    polling.abort();
    assert_eq!((provider.reloads(), provider.failures()), (0, 4));
    assert!(same_arcs(&before, &snapshot(&provider)));
    assert_eq!(remaining(&engine, "api", "/a/x").await, Some(3));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A limiter that decides in memory but refuses any band above `max`.
#[derive(Debug)]
struct AtMost {
    max: u64,
    memory: MemoryLimiter,
}

impl RateLimiter for AtMost {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        self.memory.acquire(request)
    }

    fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        for rule in set.rules() {
            for band in rule.bands().iter() {
                if band.capacity() > self.max {
                    return Err(RuleError::Unsupported {
                        backend: "at-most",
                        rule_set: set.id().to_string(),
                        rule: rule.id().to_string(),
                        band: band.name().to_string(),
                        message: format!("capacity {} above {}", band.capacity(), self.max),
                    });
                }
            }
        }
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_rule_the_limiter_cannot_decide_keeps_the_rules_in_force() {
    let (dir, source) = two_files("refused");
    let provider = Arc::new(ReloadingRuleSetProvider::new(source.read().unwrap()));
    let limiter = AtMost {
        max: 100,
        memory: MemoryLimiter::default(),
    };
    let engine = Engine::builder(provider.clone()).limiter(limiter).build().unwrap();
    assert_eq!(remaining(&engine, "web", "/").await, Some(9));
    let before = snapshot(&provider);

    write(&dir, "web.toml", &toml_web(1000));
    let error = provider.reload_from(&source).await.unwrap_err();
    assert!(
        matches!(&error, ReloadError::Refused(RuleError::Unsupported { rule_set, rule, .. }) if rule_set == "web" && rule == "w"),
        "{error:?}"
    );
    let polling = spawn_polling(provider.clone(), Arc::new(source.clone()), Duration::from_secs(1));
    polled(&provider, 3).await;
    polling.abort();
    assert_eq!((provider.reloads(), provider.failures()), (0, 3));
    assert!(same_arcs(&before, &snapshot(&provider)));
    assert_eq!(
        remaining(&engine, "web", "/").await,
        Some(8),
        "the old limit, counters kept"
    );

    // Within the limiter's range again: swapped in.
    write(&dir, "web.toml", &toml_web(100));
    let report = provider.reload_from(&source).await.unwrap();
    assert_eq!(report.changed, ["web".into()]);
    assert_eq!(remaining(&engine, "web", "/").await, Some(99));
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn a_directory_merges_its_rule_files_in_name_order() {
    let (dir, source) = two_files("merge");
    write(&dir, "z.json", r#"{"rule_sets": [{"id": "admin", "rules": []}]}"#);
    write(&dir, "notes.txt", "not rules");
    write(&dir, ".api.yaml", "not rules either: [");
    std::fs::create_dir(dir.join("sub.yaml")).unwrap();
    let sets = source.load().await.unwrap();
    let mut ids: Vec<_> = sets.iter().map(|s| s.id().to_string()).collect();
    ids.sort();
    assert_eq!(ids, ["admin", "api", "web"]);

    // One file of the directory, alone.
    let one = FileRuleSource::new(dir.join("web.toml")).read().unwrap();
    assert_eq!(one.len(), 1);
    assert!(one.get("web").is_some());

    // Rule sets appear and disappear with their files.
    let provider = ReloadingRuleSetProvider::new(RuleSets::default());
    let report = provider.reload_from(&source).await.unwrap();
    assert_eq!(report.added, ["admin".into(), "api".into(), "web".into()]);
    std::fs::remove_file(dir.join("z.json")).unwrap();
    let report = provider.reload_from(&source).await.unwrap();
    assert_eq!(report.removed, ["admin".into()]);
    assert!(report.added.is_empty() && report.changed.is_empty());
    assert!(provider.rule_set("admin").into_ready().unwrap().unwrap().is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn a_rule_set_in_two_files_names_both() {
    let (dir, source) = two_files("duplicate");
    write(&dir, "more.yml", &rule_file("api", &[("x", "/x", 1)]));
    let error = source.read().unwrap_err();
    match &error {
        FileSourceError::DuplicateRuleSet { id, first, second } => {
            assert_eq!(id, "api");
            assert_eq!(first, &dir.join("api.yaml"));
            assert_eq!(second, &dir.join("more.yml"));
        }
        other => panic!("{other:?}"),
    }
    let message = error.to_string();
    assert!(
        message.contains("api.yaml") && message.contains("more.yml"),
        "{message}"
    );
    assert!(source.load().await.is_err());
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn missing_and_empty_paths_are_errors() {
    let dir = scratch("empty");
    let error = FileRuleSource::new(&dir).read().unwrap_err();
    assert!(matches!(error, FileSourceError::NoRuleFiles { .. }), "{error:?}");
    let missing = dir.join("nope.yaml");
    let error = FileRuleSource::new(&missing).read().unwrap_err();
    assert!(
        matches!(error, FileSourceError::Io { ref path, .. } if path == &missing),
        "{error:?}"
    );
    write(&dir, "empty.yaml", "");
    let error = FileRuleSource::new(&dir).read().unwrap_err();
    assert!(error.to_string().contains("empty.yaml"), "{error}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn rules_without_a_rule_set_keep_the_rules_in_force_unless_allowed() {
    let (dir, source) = two_files("no-rule-set");
    let provider = ReloadingRuleSetProvider::new(source.read().unwrap());
    let before = snapshot(&provider);

    // Every file emptied: the directory still holds rule files, and no rule set.
    write(&dir, "api.yaml", "rule_sets: []\n");
    write(&dir, "web.toml", "rule_sets = []\n");
    let error = provider.reload_from(&source).await.unwrap_err();
    assert!(error.to_string().contains("holds no rule set"), "{error}");
    assert!(same_arcs(&before, &snapshot(&provider)), "nothing removed");
    assert_eq!((provider.reloads(), provider.failures()), (0, 1));

    // One file, alone.
    let file = FileRuleSource::new(dir.join("api.yaml"));
    let error = file.read().unwrap_err();
    assert!(
        matches!(error, FileSourceError::NoRuleSets { ref path } if path == &dir.join("api.yaml")),
        "{error:?}"
    );

    // Unless no rules is what is meant.
    let report = provider.reload_from(&source.clone().allow_empty(true)).await.unwrap();
    assert_eq!(report.removed, ["api".into(), "web".into()]);
    assert!(file.allow_empty(true).read().unwrap().is_empty());
    std::fs::remove_dir_all(dir).unwrap();
}

/// Each thread decides with its own copy of a rule set and its own snapshot of the rule
/// sets in force: after a swap, a thread that decided with the old rules (and holds copies
/// of them) decides its very next request with the new ones, whether the swap lowered a
/// capacity, removed a rule or reset the counters, and whichever engine path the rule set
/// takes (one rule of one band, or several rules).
#[test]
fn a_thread_decides_its_next_request_after_a_swap_with_the_new_rules() {
    use std::sync::mpsc;
    let file = |rules: &str| {
        RuleSets::from_yaml_str(&format!("rule_sets:\n  - id: default\n    rules:\n{rules}")).expect("valid rules")
    };
    let roomy = "      - { id: all, scope: global, bands: [{ capacity: 1000, window: 1h }] }\n";
    let tight = "      - { id: all, scope: global, bands: [{ capacity: 5, window: 1h }] }\n";
    let blocking = "      - { id: none, scope: global, bands: [{ capacity: 1, window: 1h }] }\n";
    let elsewhere = "      - { id: none, scope: global, match: { paths: [\"/elsewhere\"] }, bands: [{ capacity: 1, window: 1h }] }\n";
    for extra in ["", "      - { id: per-ip, bands: [{ capacity: 1000, window: 1h }] }\n"] {
        let provider = Arc::new(ReloadingRuleSetProvider::new(file(&format!("{roomy}{extra}"))));
        let engine = Engine::builder(provider.clone()).build().expect("an engine");
        let (ask, asked) = mpsc::channel::<()>();
        let (answer, answers) = mpsc::channel::<Decision>();
        let other = std::thread::spawn({
            let engine = engine.clone();
            move || {
                let ctx = RequestContext::builder()
                    .client_ip("192.0.2.1".parse().expect("an address"))
                    .build();
                for () in asked {
                    let decision = engine.check(&ctx).into_ready().expect("in memory").expect("decided");
                    if answer.send(decision).is_err() {
                        break;
                    }
                }
            }
        });
        let decide = || {
            ask.send(()).expect("the other thread");
            answers.recv().expect("its decision")
        };
        let limit = |d: &Decision| d.bands.iter().find(|b| &*b.rule == "all").map(|b| b.limit);
        // The other thread decides with the roomy rule, and keeps its copies.
        for _ in 0..3 {
            assert_eq!(limit(&decide()), Some(1000), "{extra}");
        }
        // A lower capacity: the next request there is counted by it.
        provider.replace(file(&format!("{tight}{extra}"))).expect("swapped");
        let d = decide();
        assert_eq!((limit(&d), d.remaining()), (Some(5), Some(4)), "{extra}");
        // A rule that refuses everything, then removed: the next request passes.
        provider
            .replace(file(&format!("{tight}{blocking}{extra}")))
            .expect("swapped");
        assert!(decide().allowed(), "{extra}: the blocking rule's one permit");
        assert!(!decide().allowed(), "{extra}: refused by the blocking rule");
        provider
            .replace(file(&format!("{tight}{elsewhere}{extra}")))
            .expect("swapped");
        let d = decide();
        assert!(d.allowed(), "{extra}: the blocking rule is gone: {d:?}");
        assert!(d.bands.iter().all(|b| &*b.rule != "none"), "{extra}");
        // The tight rule's last permits; a reset gives them back at once.
        assert_eq!(d.remaining(), Some(2), "{extra}");
        assert!(decide().allowed() && decide().allowed(), "{extra}");
        assert!(!decide().allowed(), "{extra}");
        assert!(provider.reset_buckets("default"));
        assert!(decide().allowed(), "{extra}: reset counters");
        drop(ask);
        other.join().expect("the other thread");
    }
}
