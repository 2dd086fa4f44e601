//! File watch: real rule files edited while an engine uses them, reloaded within the
//! debounce period.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fluxgate::core::reload::{spawn_watching, Watch};
use fluxgate::core::{Engine, FileRuleSource, ReloadingRuleSetProvider, RequestContext};

/// How long a change may take to be seen before a test fails: far above the 100 ms
/// debounce, for busy machines. The delays measured are in the failure messages.
const PATIENCE: Duration = Duration::from_secs(5);

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fluxgate-watch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// Rule set `default`: one global rule on `/api/**`, `capacity` a day.
fn rules(capacity: u64) -> String {
    format!(
        "rule_sets:\n  - id: default\n    rules:\n      - {{id: api, scope: global, match: {{paths: [\"/api/**\"]}}, bands: [{{capacity: {capacity}, window: 1d}}]}}\n"
    )
}

/// The capacity of the binding band for a request to `/api/x`, consuming one permit.
async fn limit(engine: &Engine) -> Option<u64> {
    let ctx = RequestContext::builder().path("/api/x").build();
    engine.check(&ctx).await.expect("decided").limit()
}

/// Waits until `seen()` holds and returns how long it took; fails after [`PATIENCE`].
async fn within(what: &str, since: Instant, seen: impl Fn() -> bool) -> Duration {
    loop {
        if seen() {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < PATIENCE,
            "{what}: not seen after {:?}",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A provider reading `path`, an engine on it, and the provider's watch.
fn watched(path: &Path) -> (Arc<ReloadingRuleSetProvider>, Engine, Watch) {
    let source = FileRuleSource::new(path);
    let provider = Arc::new(ReloadingRuleSetProvider::new(source.read().expect("valid rules")));
    let engine = Engine::builder(provider.clone()).build().expect("an engine");
    let watch = spawn_watching(provider.clone(), source).expect("watching");
    (provider, engine, watch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_file_is_enforced_within_the_debounce() {
    let dir = scratch("edit");
    let file = dir.join("rules.yaml");
    std::fs::write(&file, rules(5)).unwrap();
    let (provider, engine, watch) = watched(&file);
    assert_eq!(watch.dir(), dir);
    assert_eq!(limit(&engine).await, Some(5));

    let edited = Instant::now();
    std::fs::write(&file, rules(3)).unwrap();
    let delay = within("the edit", edited, || provider.reloads() >= 1).await;
    assert_eq!(limit(&engine).await, Some(3), "the new limit, {delay:?} after the edit");
    assert_eq!(provider.failures(), 0);
    drop(watch);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_edit_keeps_the_rules_in_force() {
    let dir = scratch("broken");
    let file = dir.join("rules.yaml");
    std::fs::write(&file, rules(5)).unwrap();
    let source = FileRuleSource::new(&file);
    let provider = Arc::new(ReloadingRuleSetProvider::new(source.read().unwrap()));
    let engine = Engine::builder(provider.clone()).build().unwrap();
    let results = Arc::new(Mutex::new(Vec::new()));
    let seen = results.clone();
    let watch = Watch::builder(provider.clone(), source)
        .debounce(Duration::from_millis(50))
        .on_reload(move |result| {
            seen.lock()
                .unwrap()
                .push(result.as_ref().map_err(ToString::to_string).cloned())
        })
        .spawn()
        .unwrap();

    let edited = Instant::now();
    std::fs::write(&file, "rule_sets: [{id: default, rules: [").unwrap();
    let delay = within("the broken edit", edited, || provider.failures() >= 1).await;
    assert_eq!(provider.reloads(), 0, "{delay:?}");
    assert_eq!(limit(&engine).await, Some(5), "the rules in force are kept");
    {
        let results = results.lock().unwrap();
        let error = results[0].as_ref().unwrap_err();
        assert!(error.contains("rules.yaml"), "the callback sees why: {error}");
    }

    // Fixed: swapped in.
    let edited = Instant::now();
    std::fs::write(&file, rules(2)).unwrap();
    let delay = within("the fix", edited, || provider.reloads() >= 1).await;
    assert_eq!(limit(&engine).await, Some(2), "{delay:?}");
    let last = results.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.unwrap().changed, ["default".into()]);
    drop(watch);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_leaving_no_rule_set_keeps_the_rules_in_force() {
    let dir = scratch("no-rule-set");
    let file = dir.join("rules.yaml");
    std::fs::write(&file, rules(5)).unwrap();
    let (provider, engine, watch) = watched(&file);
    assert_eq!(limit(&engine).await, Some(5));

    // A template rendered without its data, a list emptied by a script: the file parses,
    // and holds no rule set at all.
    for (i, empty) in ["rule_sets: []\n", "rule_sets: [] # none yet\n"]
        .into_iter()
        .enumerate()
    {
        let edited = Instant::now();
        std::fs::write(&file, empty).unwrap();
        let delay = within("the emptied file", edited, || provider.failures() > i as u64).await;
        assert_eq!(provider.reloads(), 0, "{delay:?}");
        assert_eq!(limit(&engine).await, Some(5), "the rules in force are kept");
    }
    drop(watch);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_by_rename_is_picked_up() {
    let dir = scratch("rename");
    let file = dir.join("rules.yaml");
    std::fs::write(&file, rules(5)).unwrap();
    let (provider, engine, watch) = watched(&file);

    // As editors save: a temporary file in the same directory, renamed over the rules.
    for (i, capacity) in [4u64, 3].into_iter().enumerate() {
        let edited = Instant::now();
        let temporary = dir.join(format!(".rules.yaml.{i}.tmp"));
        std::fs::write(&temporary, rules(capacity)).unwrap();
        std::fs::rename(&temporary, &file).unwrap();
        let delay = within("the renamed file", edited, || provider.reloads() > i as u64).await;
        assert_eq!(limit(&engine).await, Some(capacity), "save {i}, {delay:?}");
    }
    assert_eq!(provider.failures(), 0);
    drop(watch);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_directory_reloads_when_one_of_its_rule_files_changes() {
    let dir = scratch("directory");
    std::fs::write(dir.join("api.yaml"), rules(5)).unwrap();
    let (provider, engine, watch) = watched(&dir);
    assert_eq!(watch.dir(), dir);

    // Not a rule file: nothing to reload.
    std::fs::write(dir.join("notes.txt"), "not rules").unwrap();
    std::fs::write(dir.join(".api.yaml.swp"), "not rules either").unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(provider.reloads() + provider.failures(), 0, "no rule file changed");

    let edited = Instant::now();
    let temporary = dir.join(".api.yaml.tmp");
    std::fs::write(&temporary, rules(3)).unwrap();
    std::fs::rename(&temporary, dir.join("api.yaml")).unwrap();
    let delay = within("the renamed file", edited, || provider.reloads() >= 1).await;
    assert_eq!(limit(&engine).await, Some(3), "{delay:?}");
    drop(watch);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_directory_replaced_by_another_is_followed() {
    let base = scratch("replaced");
    let dir = base.join("rules");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("api.yaml"), rules(5)).unwrap();
    let (provider, engine, _watch) = watched(&dir);

    // A deployment that renames a new directory over the old one.
    let next = base.join("rules.next");
    std::fs::create_dir(&next).unwrap();
    std::fs::write(next.join("api.yaml"), rules(4)).unwrap();
    let edited = Instant::now();
    std::fs::rename(&dir, base.join("rules.old")).unwrap();
    std::fs::rename(&next, &dir).unwrap();
    let delay = within("the new directory", edited, || provider.reloads() >= 1).await;
    assert_eq!(limit(&engine).await, Some(4), "{delay:?}");

    // The watch now follows the new directory: an edit in it is seen.
    let reloads = provider.reloads();
    let edited = Instant::now();
    std::fs::write(dir.join("api.yaml"), rules(2)).unwrap();
    let delay = within("an edit in the new directory", edited, || provider.reloads() > reloads).await;
    assert_eq!(limit(&engine).await, Some(2), "{delay:?}");
    std::fs::remove_dir_all(base).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_watch_stops_reloading() {
    let dir = scratch("drop");
    let file = dir.join("rules.yaml");
    std::fs::write(&file, rules(5)).unwrap();
    let (provider, engine, watch) = watched(&file);
    let edited = Instant::now();
    std::fs::write(&file, rules(4)).unwrap();
    within("the edit", edited, || provider.reloads() >= 1).await;
    assert_eq!(limit(&engine).await, Some(4));

    drop(watch);
    let reloads = provider.reloads();
    std::fs::write(&file, rules(3)).unwrap();
    // Several debounce periods: a live watch would have reloaded by now.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(provider.reloads(), reloads, "no reload once the watch is dropped");
    assert_eq!(limit(&engine).await, Some(4));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Rule set `default` as [`rules`], then rule set `other` with two rules.
fn two_rule_sets(capacity: u64) -> String {
    format!(
        "{}  - id: other\n    rules:\n      - {{id: first, scope: global, bands: [{{capacity: 7, window: 1d}}]}}\n      - {{id: second, scope: ip, bands: [{{capacity: 3, window: 1d}}]}}\n",
        rules(capacity)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_in_place_in_pieces_is_not_loaded_cut() {
    use std::io::Write as _;

    let dir = scratch("in-place");
    let file = dir.join("rules.yaml");
    std::fs::write(&file, two_rule_sets(5)).unwrap();
    let source = FileRuleSource::new(&file);
    let provider = Arc::new(ReloadingRuleSetProvider::new(source.read().unwrap()));
    let engine = Engine::builder(provider.clone()).build().unwrap();
    // After each reload: how many rules rule set `other` has in force.
    let others = Arc::new(Mutex::new(Vec::new()));
    let seen = others.clone();
    let watched = provider.clone();
    let watch = Watch::builder(provider.clone(), source)
        .on_reload(move |_| {
            let rules = watched.rule_sets().get("other").map_or(0, |set| set.rules().len());
            seen.lock().unwrap().push(rules);
        })
        .spawn()
        .unwrap();

    // As `render > rules.yaml` or a deploy that streams the file: truncated, then written
    // in pieces; the first piece ends after a complete rule, and is valid rules.
    let text = two_rule_sets(4);
    let cut = text.find("      - {id: second").unwrap();
    let mut writer = std::fs::File::create(&file).unwrap();
    writer.write_all(&text.as_bytes()[..cut]).unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    writer.write_all(&text.as_bytes()[cut..]).unwrap();
    drop(writer);
    let edited = Instant::now();
    let delay = within("the whole file", edited, || limit_now(&provider) == Some(4)).await;

    // A file written slowly for longer than ten debounce periods, a line at a time.
    let text = two_rule_sets(3);
    let mut writer = std::fs::File::create(&file).unwrap();
    for line in text.split_inclusive('\n') {
        writer.write_all(line.as_bytes()).unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    drop(writer);
    let edited = Instant::now();
    within("the slowly written file", edited, || limit_now(&provider) == Some(3)).await;
    assert_eq!(limit(&engine).await, Some(3));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let others = others.lock().unwrap().clone();
    assert!(
        others.iter().all(|&rules| rules == 2),
        "rules of `other` in force after each reload: {others:?} (the first edit seen {delay:?} after its end)"
    );
    drop(watch);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The capacity of rule set `default`'s rule in force now.
fn limit_now(provider: &ReloadingRuleSetProvider) -> Option<u64> {
    let sets = provider.rule_sets();
    Some(sets.get("default")?.rules().first()?.bands().first()?.capacity())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_by_symlink_swap_is_picked_up() {
    // A mounted ConfigMap: `rules.yaml -> ..data/rules.yaml`, `..data -> ..<timestamp>`.
    // An update writes a new timestamped directory, points `..data_tmp` at it, renames
    // `..data_tmp` over `..data`, then removes the old directory.
    let dir = scratch("configmap");
    std::fs::create_dir(dir.join("..2024_01")).unwrap();
    std::fs::write(dir.join("..2024_01/rules.yaml"), rules(5)).unwrap();
    std::os::unix::fs::symlink("..2024_01", dir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/rules.yaml", dir.join("rules.yaml")).unwrap();
    let (file_provider, file_engine, file_watch) = watched(&dir.join("rules.yaml"));
    let (dir_provider, dir_engine, dir_watch) = watched(&dir);
    assert_eq!(
        (limit(&file_engine).await, limit(&dir_engine).await),
        (Some(5), Some(5))
    );

    for (i, capacity) in [4u64, 3].into_iter().enumerate() {
        let (old, new) = (format!("..2024_0{}", i + 1), format!("..2024_0{}", i + 2));
        std::fs::create_dir(dir.join(&new)).unwrap();
        std::fs::write(dir.join(&new).join("rules.yaml"), rules(capacity)).unwrap();
        std::os::unix::fs::symlink(&new, dir.join("..data_tmp")).unwrap();
        let edited = Instant::now();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        std::fs::remove_dir_all(dir.join(&old)).unwrap();
        let reloads = i as u64;
        let delay = within("the swap, file source", edited, || file_provider.reloads() > reloads).await;
        assert_eq!(limit(&file_engine).await, Some(capacity), "{delay:?}");
        let delay = within("the swap, directory source", edited, || {
            dir_provider.reloads() > reloads
        })
        .await;
        assert_eq!(limit(&dir_engine).await, Some(capacity), "{delay:?}");
    }
    assert_eq!((file_provider.failures(), dir_provider.failures()), (0, 0));
    drop((file_watch, dir_watch));
    std::fs::remove_dir_all(dir).unwrap();
}
