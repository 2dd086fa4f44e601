//! Rules read from MongoDB documents through the facade (`fluxgate::mongodb`, feature
//! `mongodb`), swapped into a reloading provider and enforced; the documents are built
//! here, so no MongoDB server is needed (the live test is in `crates/fluxgate-mongodb`).

use std::sync::Arc;

use fluxgate::core::reload::ReloadingRuleSetProvider;
use fluxgate::mongodb::bson::{doc, Document};
use fluxgate::mongodb::document::rule_sets_from_documents;
use fluxgate::{Engine, RequestContext};

fn java_rule(capacity: i64) -> Document {
    doc! {
        "id": "per-ip",
        "name": "Per IP",
        "enabled": true,
        "scope": "PER_IP",
        "keyStrategyId": "ip",
        "onLimitExceedPolicy": "REJECT_REQUEST",
        "ruleSetId": "default",
        "bands": [ { "windowSeconds": 60_i64, "capacity": capacity, "label": "per-minute" } ],
    }
}

#[tokio::test]
async fn documents_read_through_the_facade_are_enforced_and_reloaded() {
    let rules = rule_sets_from_documents(&[java_rule(2)]).expect("valid documents");
    let provider = Arc::new(ReloadingRuleSetProvider::new(rules));
    let engine = Engine::builder(provider.clone()).build().expect("engine");
    let ctx = RequestContext::builder()
        .client_ip("192.0.2.7".parse().expect("an address"))
        .build();
    let remaining = |engine: &Engine| {
        let decision = engine.check(&ctx);
        async move { decision.await.expect("decision").remaining() }
    };
    assert_eq!(remaining(&engine).await, Some(1));

    let report = provider
        .replace(rule_sets_from_documents(&[java_rule(4)]).expect("valid documents"))
        .expect("replace");
    assert_eq!(report.changed, ["default".into()]);
    assert_eq!(remaining(&engine).await, Some(3), "a new capacity: a fresh band");
}
