//! The source against MongoDB.
//!
//! The live test runs only when `FLUXGATE_TEST_MONGO_URL` names a MongoDB server
//! (`mongodb://127.0.0.1:27017`); it works in a database of its own and drops it. Without
//! the variable it prints that it did not run, and why. The other tests need no server:
//! they check the deadline and the errors of a server that does not answer.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bson::{doc, Document};
use fluxgate_core::reload::{ReloadError, ReloadingRuleSetProvider, RuleSource};
use fluxgate_core::{BandSpec, Engine, RequestContext, RuleSetSpec, RuleSets, RuleSpec, ScopeKind};
use fluxgate_mongodb::{MongoRuleSource, SourceError, DEFAULT_COLLECTION};

const URL_VARIABLE: &str = "FLUXGATE_TEST_MONGO_URL";

/// A rule set of one global rule: `capacity` per hour.
fn spec(id: &str, capacity: u64) -> RuleSetSpec {
    let mut rule = RuleSpec::new(
        "all",
        vec![BandSpec::new(capacity, Duration::from_secs(3600)).label("hour")],
    );
    rule.scope = ScopeKind::Global;
    RuleSetSpec::new(id, vec![rule])
}

async fn allowed(engine: &Engine, ctx: &RequestContext) -> bool {
    engine.check(ctx).await.expect("a decision").allowed()
}

#[tokio::test]
async fn rules_kept_in_mongodb_are_loaded_enforced_and_reloaded() {
    let Ok(url) = std::env::var(URL_VARIABLE) else {
        // Written to the process's stderr rather than with `eprintln!`, which the test
        // harness captures: the notice shows in every `cargo test`.
        let notice = format!(
            "NOT RUN: the live MongoDB test needs a MongoDB server; set {URL_VARIABLE} \
             (e.g. mongodb://127.0.0.1:27017) to run it. No MongoDB server package exists in \
             Debian's archive, so the test suite does not start one.\n"
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), notice.as_bytes());
        return;
    };
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let database = format!("fluxgate_test_{}_{nanos}", std::process::id());
    let source = MongoRuleSource::connect(&url, &database)
        .await
        .expect("connect to the MongoDB of FLUXGATE_TEST_MONGO_URL");
    assert_eq!(source.namespace(), format!("{database}.{DEFAULT_COLLECTION}"));
    let result = live(&source).await;
    source
        .mongo_collection()
        .client()
        .database(&database)
        .drop()
        .await
        .expect("drop the test database");
    result.unwrap_or_else(|e| panic!("{e}"));
}

async fn live(source: &MongoRuleSource) -> Result<(), Box<dyn std::error::Error>> {
    // An empty collection fails the load (a wrong database must not remove every rule).
    let error = source.load_rule_sets().await.expect_err("an empty collection");
    assert!(matches!(error, SourceError::Empty { .. }), "{error}");
    assert!(source.clone().allow_empty(true).load_rule_sets().await?.is_empty());

    source.put_rule_set(&spec("api", 3)).await?;
    source.put_rule_set(&spec("other", 10)).await?;
    let provider = Arc::new(ReloadingRuleSetProvider::new(RuleSets::default()));
    let engine = Engine::builder(provider.clone()).build()?;
    let report = provider.reload_from(source).await?;
    assert_eq!(report.added, ["api".into(), "other".into()]);
    let ctx = RequestContext::builder().rule_set_id("api").build();
    for _ in 0..3 {
        assert!(allowed(&engine, &ctx).await);
    }
    assert!(!allowed(&engine, &ctx).await, "3 per hour");

    // An unchanged reload changes nothing; a changed rule set is swapped in, its band fresh.
    assert!(provider.reload_from(source).await?.is_empty());
    source.put_rule_set(&spec("api", 5)).await?;
    let report = provider.reload_from(source).await?;
    assert_eq!(report.changed, ["api".into()]);
    for _ in 0..5 {
        assert!(allowed(&engine, &ctx).await);
    }
    assert!(!allowed(&engine, &ctx).await, "5 per hour");

    // A document written by the Java FluxGate (int32 and double numbers here, a sub-second
    // window) is read as well.
    let collection = source.mongo_collection();
    collection
        .insert_one(doc! {
            "id": "java-rule",
            "name": "Java rule",
            "enabled": true,
            "scope": "PER_IP",
            "keyStrategyId": "ip",
            "onLimitExceedPolicy": "REJECT_REQUEST",
            "ruleSetId": "java",
            "bands": [ { "windowSeconds": 0.5, "capacity": 2.0, "label": "half-second" } ],
            "_class": "org.fluxgate.adapter.mongo.model.RateLimitRuleDocument",
        })
        .await?;
    let report = provider.reload_from(source).await?;
    assert_eq!(report.added, ["java".into()]);
    let sets = provider.rule_sets();
    let band = &sets.get("java").expect("java").rules()[0].bands()[0];
    assert_eq!((band.capacity(), band.window()), (2, Duration::from_millis(500)));

    // A bad document fails the load, naming itself and the field; the rules in force stay.
    let bad = collection
        .insert_one(doc! {
            "ruleSetId": "api", "id": "broken", "scope": "PER_IP",
            "bands": [ { "windowSeconds": 1, "capacity": -1 } ],
        })
        .await?;
    let error = provider.reload_from(source).await.expect_err("a bad document");
    let message = error.to_string();
    assert!(matches!(error, ReloadError::Source(_)), "{message}");
    assert!(
        message.contains(r#"ruleSetId: "api", id: "broken"}: field `bands[0].capacity`: must not be negative"#),
        "{message}"
    );
    assert!(!allowed(&engine, &ctx).await, "the rules in force stay");
    collection.delete_one(doc! { "_id": bad.inserted_id }).await?;

    // put_rule_set refuses an invalid rule set and writes nothing.
    let error = source.put_rule_set(&spec("api", 0)).await.expect_err("capacity 0");
    assert!(matches!(error, SourceError::Write(_)), "{error}");
    let api: Vec<Document> = source
        .documents()
        .await?
        .into_iter()
        .filter(|d| d.get_str("ruleSetId") == Ok("api"))
        .collect();
    assert_eq!(api.len(), 1);
    assert_eq!(
        api[0].get_array("bands")?[0]
            .as_document()
            .and_then(|b| b.get_i64("capacity").ok()),
        Some(5)
    );

    // put_rule_set replaces the rules of the set: a removed rule's document goes.
    let mut two = spec("api", 5);
    let mut second = RuleSpec::new("second", vec![BandSpec::new(1, Duration::from_secs(1))]);
    second.scope = ScopeKind::User;
    two.rules.push(second);
    source.put_rule_set(&two).await?;
    assert_eq!(
        source
            .list()
            .await?
            .iter()
            .find(|s| s.id == "api")
            .map(|s| s.rules.len()),
        Some(2)
    );
    source.put_rule_set(&spec("api", 5)).await?;
    assert_eq!(
        source
            .list()
            .await?
            .iter()
            .find(|s| s.id == "api")
            .map(|s| s.rules.len()),
        Some(1)
    );

    // A filter loads only the rule sets named; deleting a rule set removes it on reload.
    let only_api = source.clone().rule_sets(["api"]).load_rule_sets().await?;
    assert_eq!((only_api.len(), only_api.get("api").is_some()), (1, true));
    assert_eq!(source.delete_rule_set("other").await?, 1);
    assert_eq!(source.delete_rule_set("other").await?, 0);
    let report = provider.reload_from(source).await?;
    assert_eq!(report.removed, ["other".into()]);

    // Another collection of the same database starts empty.
    let elsewhere = source.clone().collection("other_rules").allow_empty(true);
    assert!(elsewhere.load_rule_sets().await?.is_empty());
    assert!(elsewhere.namespace().ends_with(".other_rules"));
    Ok(())
}

/// A port nothing listens on: 1 on the loopback interface.
const NOBODY: &str = "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=10000&connectTimeoutMS=10000";

#[tokio::test]
async fn a_server_that_does_not_answer_fails_the_load_within_the_deadline() {
    let client = mongodb::Client::with_uri_str(NOBODY).await.expect("a client");
    let source = MongoRuleSource::from_collection(client.database("fluxgate").collection(DEFAULT_COLLECTION))
        .timeout(Duration::from_millis(200));
    let started = Instant::now();
    let error = source.load().await.expect_err("no server");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!(
        error.to_string(),
        "MongoDB rule source `fluxgate.rate_limit_rules`: no answer to find within 200ms"
    );
    let provider = ReloadingRuleSetProvider::new(RuleSets::default());
    assert!(matches!(
        provider.reload_from(&source).await,
        Err(ReloadError::Source(_))
    ));
    assert_eq!(provider.failures(), 1);
}

#[tokio::test]
async fn connect_fails_on_a_server_that_does_not_answer_and_on_a_bad_url() {
    let started = Instant::now();
    let error = MongoRuleSource::connect("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=100", "fluxgate")
        .await
        .expect_err("no server");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    assert!(matches!(error, SourceError::Mongo { .. }), "{error}");
    assert!(
        error
            .to_string()
            .starts_with("MongoDB rule source `fluxgate.rate_limit_rules`: Kind: Server selection timeout"),
        "{error}"
    );

    let error = MongoRuleSource::connect("http://127.0.0.1:27017", "fluxgate")
        .await
        .expect_err("not a MongoDB connection string");
    assert!(matches!(error, SourceError::Mongo { .. }), "{error}");
}

#[cfg(not(feature = "dns-resolver"))]
#[tokio::test]
async fn srv_urls_need_the_dns_resolver_feature() {
    let error = MongoRuleSource::connect("mongodb+srv://cluster0.example.com/", "fluxgate")
        .await
        .expect_err("no DNS resolver");
    assert!(matches!(error, SourceError::Mongo { .. }), "{error}");
    assert!(error.to_string().contains("dns-resolver"), "{error}");
}
