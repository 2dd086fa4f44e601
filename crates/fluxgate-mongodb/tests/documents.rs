//! The document mapping, on BSON documents: no MongoDB server needed.

use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, Document};
use fluxgate_core::{
    Algorithm, BandSpec, FailurePolicy, KeyField, LeaseSpec, Mode, OnLimitSpec, OnMissingKey, RuleSet, RuleSetSpec,
    RuleSets, RuleSpec, Scope, ScopeKind,
};
use fluxgate_mongodb::document::{
    rule_from_document, rule_set_specs_from_documents, rule_set_to_documents, rule_sets_from_documents,
    DocumentProblem, MappingError, WriteError,
};
use proptest::prelude::*;

/// A rule document as the Java FluxGate's `RateLimitRuleMongoConverter.toBson` writes one:
/// numbers as int64 (Java `long`).
fn java_rule(rule_set: &str, id: &str) -> Document {
    doc! {
        "_id": ObjectId::parse_str("65f1c0a2b3c4d5e6f7a8b9c0").expect("an ObjectId"),
        "id": id,
        "name": "API Rate Limit",
        "enabled": true,
        "scope": "PER_API_KEY",
        "keyStrategyId": "apiKey",
        "onLimitExceedPolicy": "REJECT_REQUEST",
        "ruleSetId": rule_set,
        "bands": [
            { "windowSeconds": 1_i64, "capacity": 100_i64, "label": "per-second" },
            { "windowSeconds": 60_i64, "capacity": 1000_i64, "label": "per-minute" },
        ],
        "attributes": { "tier": "premium", "team": "billing" },
        "_class": "org.fluxgate.adapter.mongo.model.RateLimitRuleDocument",
    }
}

fn load(documents: &[Document]) -> RuleSets {
    rule_sets_from_documents(documents).unwrap_or_else(|e| panic!("{e}"))
}

fn error(documents: &[Document]) -> String {
    match rule_sets_from_documents(documents) {
        Ok(sets) => panic!("loaded {} rule sets, expected an error", sets.len()),
        Err(e) => e.to_string(),
    }
}

/// The error of a document with `ruleSetId: "api"`, `id: "r"`, one band of 10 per second,
/// and `fields` replaced or added (`Bson::Null` values remove the field).
fn error_with(fields: Document) -> String {
    error(&[with(fields)])
}

fn with(fields: Document) -> Document {
    let mut document = doc! {
        "ruleSetId": "api",
        "id": "r",
        "bands": [ { "windowSeconds": 1, "capacity": 10 } ],
    };
    for (key, value) in fields {
        if value == Bson::Null {
            document.remove(&key);
        } else {
            document.insert(key, value);
        }
    }
    document
}

fn band(band: Document) -> Document {
    doc! { "bands": [band] }
}

#[test]
fn a_java_document_maps_to_the_rule_model() {
    let sets = load(&[java_rule("my-api-ruleset", "api-rate-limit")]);
    let set = sets.get("my-api-ruleset").expect("the rule set");
    let rule = &set.rules()[0];
    assert_eq!(&**rule.id(), "api-rate-limit");
    assert!(rule.enabled());
    assert_eq!(rule.scope(), &Scope::ApiKey);
    assert_eq!(rule.mode(), Mode::Enforce);
    assert_eq!(rule.algorithm(), Algorithm::TokenBucket);
    assert_eq!(rule.priority(), 0);
    assert!(rule.paths().is_empty() && rule.methods().is_empty());
    let bands: Vec<(u64, Duration, Option<&str>)> = rule
        .bands()
        .iter()
        .map(|b| (b.capacity(), b.window(), b.label()))
        .collect();
    assert_eq!(
        bands,
        [
            (100, Duration::from_secs(1), Some("per-second")),
            (1000, Duration::from_secs(60), Some("per-minute")),
        ]
    );
}

#[test]
fn int32_int64_and_integral_doubles_are_the_same_numbers() {
    let shaped = |capacity: Bson, window: Bson, priority: Bson| {
        with(doc! {
            "priority": priority,
            "permits": capacity.clone(),
            "bands": [ { "windowSeconds": window, "capacity": capacity } ],
        })
    };
    let int32 = load(&[shaped(Bson::Int32(5), Bson::Int32(60), Bson::Int32(7))]);
    let int64 = load(&[shaped(Bson::Int64(5), Bson::Int64(60), Bson::Int64(7))]);
    let double = load(&[shaped(Bson::Double(5.0), Bson::Double(60.0), Bson::Double(7.0))]);
    assert_eq!(int32.get("api"), int64.get("api"));
    assert_eq!(int32.get("api"), double.get("api"));
    let rule = &int32.get("api").unwrap().rules()[0];
    assert_eq!((rule.bands()[0].capacity(), rule.permits(), rule.priority()), (5, 5, 7));
    assert_eq!(rule.bands()[0].window(), Duration::from_secs(60));
}

#[test]
fn sub_second_windows() {
    let windows = |band_doc: Document| {
        let sets = load(&[with(band(band_doc))]);
        sets.get("api").unwrap().rules()[0].bands()[0].window()
    };
    assert_eq!(
        windows(doc! { "windowSeconds": 0.5, "capacity": 5 }),
        Duration::from_millis(500)
    );
    assert_eq!(
        windows(doc! { "windowSeconds": 0.001, "capacity": 5 }),
        Duration::from_millis(1)
    );
    assert_eq!(
        windows(doc! { "windowSeconds": 2.25, "capacity": 5 }),
        Duration::from_millis(2250)
    );
    assert_eq!(
        windows(doc! { "windowMillis": 250_i64, "capacity": 5 }),
        Duration::from_millis(250)
    );
    assert_eq!(
        windows(doc! { "windowMillis": 1500.0, "capacity": 5 }),
        Duration::from_millis(1500)
    );
    assert_eq!(
        windows(doc! { "window": "100ms", "capacity": 5 }),
        Duration::from_millis(100)
    );
    assert_eq!(windows(doc! { "window": "1m", "capacity": 5 }), Duration::from_secs(60));
}

#[test]
fn rules_are_grouped_by_rule_set_and_ordered_by_priority_then_id() {
    let mut documents = vec![
        with(doc! { "id": "c" }),
        with(doc! { "id": "a" }),
        with(doc! { "id": "b", "priority": 10 }),
        with(doc! { "ruleSetId": "other", "id": "a", "scope": "GLOBAL" }),
    ];
    let sets = load(&documents);
    assert_eq!(sets.len(), 2);
    let ids: Vec<&str> = sets.get("api").unwrap().rules().iter().map(|r| &**r.id()).collect();
    assert_eq!(ids, ["b", "a", "c"]);
    assert_eq!(sets.get("other").unwrap().rules()[0].scope(), &Scope::Global);

    // Whatever order the documents come in, the rule sets are equal.
    documents.reverse();
    let again = load(&documents);
    assert_eq!(again.get("api"), sets.get("api"));
    assert_eq!(again.get("other"), sets.get("other"));
}

#[test]
fn disabled_rules_are_kept_disabled() {
    let sets = load(&[with(doc! { "id": "off", "enabled": false }), with(doc! { "id": "on" })]);
    let rules = sets.get("api").unwrap().rules();
    let enabled: Vec<(&str, bool)> = rules.iter().map(|r| (&**r.id(), r.enabled())).collect();
    assert_eq!(enabled, [("off", false), ("on", true)]);
}

#[test]
fn missing_optional_fields_take_the_rule_models_defaults() {
    let minimal = doc! {
        "ruleSetId": "api",
        "id": "r",
        "bands": [ { "windowSeconds": 1, "capacity": 10 } ],
    };
    let nulls = doc! {
        "ruleSetId": "api",
        "id": "r",
        "name": null, "enabled": null, "scope": null, "keyStrategyId": null,
        "onLimitExceedPolicy": null, "attributes": null, "priority": null, "paths": null,
        "methods": null, "algorithm": null, "permits": null, "mode": null,
        "bands": [ { "windowSeconds": 1, "capacity": 10, "label": null } ],
    };
    let expected = RuleSet::from_spec(RuleSetSpec::new(
        "api",
        vec![RuleSpec::new("r", vec![BandSpec::new(10, Duration::from_secs(1))])],
    ))
    .unwrap();
    for document in [minimal, nulls] {
        let sets = load(&[document]);
        assert_eq!(sets.get("api").map(|s| &**s), Some(&expected));
        assert_eq!(
            expected.rules()[0].scope(),
            &Scope::Ip,
            "the default scope is the client IP"
        );
    }
}

#[test]
fn the_older_shape_of_the_design_documents() {
    // `_id` as the rule id, `limitScope` with the older names, one `path` and `method`.
    let sets = load(&[doc! {
        "_id": "login-per-user",
        "ruleSetId": "api",
        "path": "/api/login",
        "method": "post",
        "limitScope": "USER_ID",
        "priority": 5,
        "enabled": true,
        "bands": [ { "windowSeconds": 60, "capacity": 5 } ],
    }]);
    let rule = &sets.get("api").unwrap().rules()[0];
    assert_eq!(&**rule.id(), "login-per-user");
    assert_eq!(rule.scope(), &Scope::User);
    assert_eq!(rule.priority(), 5);
    assert_eq!(rule.paths()[0].as_str(), "/api/login");
    let methods: Vec<&str> = rule.methods().iter().map(|m| m.as_str()).collect();
    assert_eq!(methods, ["POST"]);
}

#[test]
fn custom_and_composite_scopes() {
    let sets = load(&[
        with(doc! { "id": "tenant", "scope": "CUSTOM", "keyStrategyId": "tenant" }),
        with(doc! {
            "id": "ip-user",
            "scope": "COMPOSITE",
            "compositeKeyFields": ["IP", "USER_ID", "API_KEY", "tenant"],
        }),
        with(doc! { "id": "per-ip", "scope": "per_ip" }),
    ]);
    let set = sets.get("api").unwrap();
    let scope = |id: &str| set.rules().iter().find(|r| &**r.id() == id).unwrap().scope().clone();
    assert_eq!(scope("tenant"), Scope::Attribute("tenant".into()));
    assert_eq!(
        scope("ip-user"),
        Scope::Composite(vec![
            KeyField::Ip,
            KeyField::User,
            KeyField::ApiKey,
            KeyField::Attribute("tenant".into())
        ])
    );
    assert_eq!(scope("per-ip"), Scope::Ip, "names are read in any case");
}

#[test]
fn fields_of_the_rule_model_beyond_the_java_documents() {
    let sets = load(&[with(doc! {
        "paths": ["/api/**", "/v2/*/items"],
        "methods": ["GET", "post"],
        "algorithm": "SLIDING_WINDOW_COUNTER",
        "permits": 2,
        "onMissingKey": "skip",
        "mode": "SHADOW",
        "onBackendFailure": "fail_closed",
        "scope": "PER_USER",
        "lease": { "max": 5, "ttl": "250ms" },
    })]);
    let rule = &sets.get("api").unwrap().rules()[0];
    let paths: Vec<&str> = rule.paths().iter().map(|p| p.as_str()).collect();
    assert_eq!(paths, ["/api/**", "/v2/*/items"]);
    assert_eq!(rule.methods().len(), 2);
    assert_eq!(rule.algorithm(), Algorithm::SlidingWindowCounter);
    assert_eq!(rule.permits(), 2);
    assert_eq!(rule.on_missing_key(), OnMissingKey::Skip);
    assert_eq!(rule.mode(), Mode::Shadow);
    assert_eq!(rule.on_backend_failure(), Some(FailurePolicy::FailClosed));
    let lease = rule.lease().unwrap();
    assert_eq!((lease.max(), lease.ttl()), (5, Duration::from_millis(250)));
}

#[test]
fn unknown_fields_and_java_metadata_are_ignored() {
    let plain = load(&[with(doc! {})]);
    let decorated = load(&[with(doc! {
        "_class": "org.fluxgate.adapter.mongo.model.RateLimitRuleDocument",
        "name": "anything",
        "keyStrategyId": "clientIp",
        "attributes": { "jiraTicket": "RATE-123", "maxBurstOverride": 1000 },
        "createdAt": bson::DateTime::from_millis(0),
        "bands": [ { "windowSeconds": 1, "capacity": 10, "refillTokens": 10 } ],
    })]);
    assert_eq!(plain.get("api"), decorated.get("api"));
}

/// A field the mapping knows, written in another case or in the rule files' snake_case
/// (`on_missing_key`), or a field of the rule files that documents name otherwise
/// (`match`, `fields`, `attribute`): refused, naming the field the mapping reads, never
/// ignored in favour of the default (a `GLOBAL` limit counted per IP, `permits` of 1, no
/// `deny` for a missing key).
#[test]
fn a_known_field_misspelled_is_refused_not_ignored() {
    let cases: [(Document, &str, &str); 11] = [
        (doc! { "Scope": "GLOBAL" }, "Scope", "scope"),
        (doc! { "SCOPE": "GLOBAL" }, "SCOPE", "scope"),
        (doc! { "Permits": 5 }, "Permits", "permits"),
        (doc! { "on_missing_key": "deny" }, "on_missing_key", "onMissingKey"),
        (
            doc! { "on_backend_failure": "fail_closed" },
            "on_backend_failure",
            "onBackendFailure",
        ),
        (doc! { "limit_scope": "GLOBAL" }, "limit_scope", "limitScope"),
        (doc! { "Enabled": false }, "Enabled", "enabled"),
        (doc! { "match": { "paths": ["/api/**"] } }, "match", "paths"),
        (
            doc! { "scope": "COMPOSITE", "compositeKeyFields": ["IP"], "fields": ["USER_ID"] },
            "fields",
            "compositeKeyFields",
        ),
        (
            doc! { "lease": { "max": 2, "TTL": "1s", "ttl": "1s" } },
            "lease.TTL",
            "ttl",
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": 10, "Capacity": 1 }),
            "bands[0].Capacity",
            "capacity",
        ),
    ];
    for (fields, field, known) in cases {
        let message = error_with(fields);
        assert!(
            message.contains(&format!("field `{field}`")) && message.contains(&format!("`{known}`")),
            "{field}: {message}"
        );
    }
    assert_eq!(
        error_with(doc! { "on_missing_key": "deny" }),
        "document {ruleSetId: \"api\", id: \"r\"}: field `on_missing_key`: is not read; the field is \
         `onMissingKey` (document fields are camelCase, case-sensitive)"
    );
    // `_id` and `_class` are the Java documents' own; other names stay ignored.
    load(&[with(
        doc! { "_id": "r", "_class": "x", "createdBy": "ops", "scopeNote": "per tenant" },
    )]);
}

/// A near miss of a field the mapping reads (a letter added, left out, replaced or two
/// swapped: one edit for names of 5 to 7 letters, two for longer ones) is refused, naming the
/// field, rather than ignored for the default: ignored, `scopes: GLOBAL` counted per IP
/// (50 of 100 requests from 5 addresses admitted under a global limit of 10), `permit: 5`
/// cost 1 (50 admitted where 10 were meant), `onMissingKeys: deny` counted the requests
/// without a user per IP (50 admitted where none were meant).
#[test]
fn a_near_miss_of_a_known_field_is_refused_not_ignored() {
    let cases: [(Document, &str, &str); 13] = [
        (doc! { "scopes": "GLOBAL" }, "scopes", "scope"),
        (doc! { "scpoe": "GLOBAL" }, "scpoe", "scope"),
        (doc! { "permit": 5 }, "permit", "permits"),
        (doc! { "Permit": 5 }, "Permit", "permits"),
        (
            doc! { "scope": "PER_USER", "onMissingKeys": "deny" },
            "onMissingKeys",
            "onMissingKey",
        ),
        (doc! { "algoritm": "sliding_window_log" }, "algoritm", "algorithm"),
        (
            doc! { "onBackendFailures": "fail_closed" },
            "onBackendFailures",
            "onBackendFailure",
        ),
        (
            doc! { "backendFailure": "fail_closed" },
            "backendFailure",
            "onBackendFailure",
        ),
        (doc! { "priorty": 5 }, "priorty", "priority"),
        (doc! { "band": [] }, "band", "bands"),
        (
            doc! { "onLimit": { "wait": { "maxWait": "1s", "maxWaiters": 5, "maxWaiter": 1 } } },
            "onLimit.wait.maxWaiter",
            "maxWaiters",
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": 10, "capcity": 1 }),
            "bands[0].capcity",
            "capacity",
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": 10, "labels": "x" }),
            "bands[0].labels",
            "label",
        ),
    ];
    for (fields, field, known) in cases {
        let message = error_with(fields);
        assert!(
            message.contains(&format!("field `{field}`")) && message.contains(&format!("the field is `{known}`")),
            "{field}: {message}"
        );
    }
    assert_eq!(
        error_with(doc! { "permit": 5 }),
        "document {ruleSetId: \"api\", id: \"r\"}: field `permit`: is not read; the field is \
         `permits` (document fields are camelCase, case-sensitive)"
    );
    // Spelled right, the limit is the one meant: 10 of 100 requests from 5 addresses.
    let global = load(&[with(doc! { "scope": "GLOBAL" })]);
    assert_eq!(admitted(global, 5, 20), 10);
    let costly = load(&[with(doc! { "permits": 5 })]);
    assert_eq!(admitted(costly, 5, 20), 10);
}

/// Metadata that people and tools write next to a rule stays ignored: no field the mapping
/// reads is that near to these names.
#[test]
fn metadata_fields_are_not_taken_for_near_misses() {
    let mut metadata = Document::new();
    for name in [
        "createdAt",
        "updatedAt",
        "createdBy",
        "updatedBy",
        "modifiedAt",
        "lastModified",
        "version",
        "__v",
        "_rev",
        "description",
        "desc",
        "comment",
        "comments",
        "note",
        "notes",
        "tags",
        "owner",
        "team",
        "tenant",
        "service",
        "env",
        "environment",
        "region",
        "source",
        "status",
        "type",
        "kind",
        "category",
        "group",
        "labels",
        "meta",
        "metadata",
        "expiresAt",
        "code",
        "node",
        "model",
        "deleted",
        "active",
        "disabled",
        "schemaVersion",
        "hash",
        "revision",
        "author",
        "title",
        "displayName",
        "ruleName",
        "ruleSetName",
        "order",
        "index",
        "limit",
        "release",
        "enabledAt",
        "scopeNote",
        "ticket",
        "reason",
    ] {
        metadata.insert(name, "x");
    }
    let plain = load(&[with(doc! {})]);
    assert_eq!(plain.get("api"), load(&[with(metadata)]).get("api"));
}

/// Requests from `ips` addresses, `each` from every one, decided in memory with no time
/// passing: how many are admitted.
fn admitted(rules: RuleSets, ips: u8, each: usize) -> usize {
    let limiter = fluxgate_core::MemoryLimiter::builder()
        .clock(fluxgate_core::ManualClock::new(1_700_000_000_000_000_000))
        .build();
    let engine = fluxgate_core::Engine::builder(rules)
        .limiter(limiter)
        .build()
        .expect("an engine");
    let mut admitted = 0;
    for ip in 0..ips {
        let ctx = fluxgate_core::RequestContext::builder()
            .rule_set_id("api")
            .client_ip(std::net::IpAddr::from([192, 0, 2, ip]))
            .build();
        for _ in 0..each {
            let Ok(decision) = engine.check(&ctx).into_ready() else {
                panic!("decided at once")
            };
            admitted += usize::from(decision.expect("a decision").allowed());
        }
    }
    admitted
}

#[test]
fn a_document_that_cannot_be_read_names_itself_and_the_field() {
    let cases: Vec<(Document, &str)> = vec![
        (
            doc! { "ruleSetId": null },
            r#"document {id: "r"}: field `ruleSetId`: is missing"#,
        ),
        (
            doc! { "ruleSetId": 7 },
            r#"document {id: "r"}: field `ruleSetId`: expected a string, found int32 7"#,
        ),
        (
            doc! { "onLimit": { "wait": { "maxWait": "1s" } } },
            r#"document {ruleSetId: "api", id: "r"}: field `onLimit.wait.maxWaiters`: is missing"#,
        ),
        (
            doc! { "lease": { "ttl": "1s" } },
            r#"document {ruleSetId: "api", id: "r"}: field `lease.max`: is missing"#,
        ),
        (
            doc! { "lease": { "max": 3, "ttl": 5 } },
            r#"document {ruleSetId: "api", id: "r"}: field `lease.ttl`: expected a string, found int32 5"#,
        ),
        (
            doc! { "id": null },
            r#"document {ruleSetId: "api"}: field `id`: is missing"#,
        ),
        (
            doc! { "bands": null },
            r#"document {ruleSetId: "api", id: "r"}: field `bands`: is missing"#,
        ),
        (
            doc! { "bands": { "windowSeconds": 1, "capacity": 10 } },
            r#"document {ruleSetId: "api", id: "r"}: field `bands`: expected an array of bands, found document"#,
        ),
        (
            doc! { "bands": [ 10 ] },
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0]`: expected a band document, found int32 10"#,
        ),
        (
            band(doc! { "windowSeconds": 1 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].capacity`: is missing"#,
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": "10" }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].capacity`: expected a number (int32, int64 or double), found string "10""#,
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": -5_i64 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].capacity`: must not be negative, found -5"#,
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": 1.5 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].capacity`: expected a whole number, found 1.5"#,
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": f64::NAN }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].capacity`: expected a whole number, found NaN"#,
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": 1e300 }),
            "document {ruleSetId: \"api\", id: \"r\"}: field `bands[0].capacity`: 1e300 is out of range; a number is at most 2^63 - 1",
        ),
        (
            band(doc! { "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].windowSeconds`: is missing"#,
        ),
        (
            band(doc! { "windowSeconds": -1, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].windowSeconds`: must not be negative, found -1"#,
        ),
        (
            band(doc! { "windowSeconds": -0.5, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].windowSeconds`: must not be negative, found -0.5"#,
        ),
        (
            band(doc! { "windowSeconds": f64::INFINITY, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].windowSeconds`: inf is out of range; a window is a finite number of seconds"#,
        ),
        (
            band(doc! { "windowSeconds": 1, "windowMillis": 1000, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].windowSeconds`: `windowMillis` is given too; give only one of them"#,
        ),
        (
            band(doc! { "window": "soon", "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].window`: invalid duration `soon`: expected a whole number followed by ms, s, m, h or d (e.g. `500ms`, `1m`)"#,
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": 10, "label": 3 }),
            r#"document {ruleSetId: "api", id: "r"}: field `bands[0].label`: expected a string, found int32 3"#,
        ),
        (
            doc! { "scope": "PER_TENANT" },
            r#"document {ruleSetId: "api", id: "r"}: field `scope`: unknown value "PER_TENANT"; expected one of GLOBAL, PER_IP, PER_USER, PER_API_KEY, CUSTOM (with keyStrategyId), COMPOSITE (with compositeKeyFields)"#,
        ),
        (
            doc! { "scope": "PER_IP", "limitScope": "IP" },
            r#"document {ruleSetId: "api", id: "r"}: field `scope`: `limitScope` is given too; give only one of them"#,
        ),
        (
            doc! { "scope": "CUSTOM" },
            r#"document {ruleSetId: "api", id: "r"}: field `keyStrategyId`: is required by `scope: CUSTOM` (the attribute to count per)"#,
        ),
        (
            doc! { "scope": "COMPOSITE" },
            r#"document {ruleSetId: "api", id: "r"}: field `compositeKeyFields`: is required by `scope: COMPOSITE`"#,
        ),
        (
            doc! { "scope": "COMPOSITE", "compositeKeyFields": ["IP", 2] },
            r#"document {ruleSetId: "api", id: "r"}: field `compositeKeyFields[1]`: expected a string, found int32 2"#,
        ),
        (
            doc! { "onLimitExceedPolicy": "WAIT_FOR_REFILL" },
            r#"document {ruleSetId: "api", id: "r"}: field `onLimitExceedPolicy`: "WAIT_FOR_REFILL" is not supported: a rejected request is answered at once (with Retry-After), never held until tokens refill; use REJECT_REQUEST"#,
        ),
        (
            doc! { "onLimitExceedPolicy": "DROP" },
            r#"document {ruleSetId: "api", id: "r"}: field `onLimitExceedPolicy`: unknown value "DROP"; expected one of REJECT_REQUEST"#,
        ),
        (
            doc! { "enabled": "yes" },
            r#"document {ruleSetId: "api", id: "r"}: field `enabled`: expected a boolean, found string "yes""#,
        ),
        (
            doc! { "priority": 1_i64 << 40 },
            r#"document {ruleSetId: "api", id: "r"}: field `priority`: 1099511627776 is out of range; a priority is a 32-bit integer"#,
        ),
        (
            doc! { "paths": "/api/**" },
            r#"document {ruleSetId: "api", id: "r"}: field `paths`: expected an array of strings, found string "/api/**""#,
        ),
        (
            doc! { "paths": ["/a"], "path": "/b" },
            r#"document {ruleSetId: "api", id: "r"}: field `paths`: `path` is given too; give only one of them"#,
        ),
        (
            doc! { "algorithm": "gcra" },
            r#"document {ruleSetId: "api", id: "r"}: field `algorithm`: unknown value "gcra"; expected one of token_bucket, leaky_bucket, fixed_window, sliding_window_log, sliding_window_counter"#,
        ),
        (
            doc! { "mode": "dry_run" },
            r#"document {ruleSetId: "api", id: "r"}: field `mode`: unknown value "dry_run"; expected one of enforce, shadow"#,
        ),
        (
            doc! { "attributes": ["tier"] },
            r#"document {ruleSetId: "api", id: "r"}: field `attributes`: expected a document, found array"#,
        ),
        (
            doc! { "permits": Bson::Decimal128(bson::Decimal128::from_bytes([0; 16])) },
            r#"document {ruleSetId: "api", id: "r"}: field `permits`: expected a number (int32, int64 or double), found decimal128"#,
        ),
    ];
    for (fields, expected) in cases {
        assert_eq!(error_with(fields.clone()), expected, "{fields}");
    }
}

#[test]
fn the_id_is_named_as_the_mongodb_shell_writes_it() {
    let mut document = java_rule("api", "r");
    document.insert("scope", "PER_TENANT");
    let message = error(&[document]);
    assert!(
        message.starts_with(
            r#"document {_id: ObjectId("65f1c0a2b3c4d5e6f7a8b9c0"), ruleSetId: "api", id: "r"}: field `scope`"#
        ),
        "{message}"
    );
    let problem = match rule_from_document(&with(doc! { "scope": "X" })) {
        Err(e) => e.problem,
        Ok(_) => panic!("read"),
    };
    assert!(matches!(problem, DocumentProblem::UnknownValue { .. }));
}

#[test]
fn long_values_are_cut_in_errors() {
    let long = "X".repeat(100_000);
    let message = error_with(doc! { "_id": long.as_str(), "scope": long.as_str() });
    assert!(message.len() < 600, "{} bytes", message.len());
    assert!(message.contains(&format!("{}…", "X".repeat(80))), "{message}");
}

#[test]
fn an_invalid_rule_names_the_document_rule_set_rule_and_field() {
    let cases: Vec<(Document, &str)> = vec![
        (
            band(doc! { "windowSeconds": 1, "capacity": 0 }),
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands[0].capacity`: band 1: capacity is 0; capacity must be at least 1"#,
        ),
        (
            band(doc! { "windowSeconds": 1, "capacity": i64::MAX }),
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands[0].capacity`: band 1: capacity is larger than 2^40"#,
        ),
        (
            band(doc! { "windowSeconds": 0.0001, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands[0].windowSeconds`: band 1: window is shorter than 1ms; a window must be at least 1ms"#,
        ),
        (
            // Named `1s` in a backend's keys and in the rules written back, it would be
            // taken for a window of one second.
            band(doc! { "windowSeconds": 1.0005, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands[0].windowSeconds`: band 1: window has a fraction of a millisecond; a window is a whole number of milliseconds"#,
        ),
        (
            band(doc! { "windowMillis": 0, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands[0].windowMillis`: band 1: window is 0; a window must be at least 1ms"#,
        ),
        (
            band(doc! { "windowSeconds": 1e12, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands[0].windowSeconds`: band 1: window is longer than ten years"#,
        ),
        (
            band(doc! { "windowSeconds": i64::MAX, "capacity": 10 }),
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands[0].windowSeconds`: band 1: window is longer than ten years"#,
        ),
        (
            doc! { "bands": [] },
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `bands`: a rule needs at least one band (or a `preset`)"#,
        ),
        (
            doc! { "path": "api/**" },
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `path`: invalid path pattern `api/**`: a pattern must start with `/`"#,
        ),
        (
            doc! { "paths": ["/ok", "/a**"] },
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `paths[1]`: invalid path pattern `/a**`: `**` must be a whole segment, as in `/api/**`"#,
        ),
        (
            doc! { "methods": ["GET", "NOT A METHOD"] },
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `methods[1]`: `NOT A METHOD` is not an HTTP method (a token of 1 to 32 characters)"#,
        ),
        (
            doc! { "scope": "CUSTOM", "keyStrategyId": "a b" },
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `keyStrategyId`: `a b` contains ' '; use only letters, digits, `_`, `-` and `.`"#,
        ),
        (
            doc! { "compositeKeyFields": ["IP"] },
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `compositeKeyFields`: `fields` is only allowed with `scope: composite`"#,
        ),
        (
            doc! { "permits": 0 },
            r#"document {ruleSetId: "api", id: "r"}: rule set `api`, rule `r`, field `permits`: permits is 0; a request costs at least 1"#,
        ),
        (
            doc! { "id": "" },
            r#"document {ruleSetId: "api", id: ""}: rule set `api`, rule `""`, field `id`: must not be empty"#,
        ),
        (
            doc! { "ruleSetId": "my api" },
            r#"document {ruleSetId: "my api", id: "r"}: rule set `my api`, rule `-`, field `ruleSetId`: `my api` contains ' '; use only letters, digits, `_`, `-` and `.`"#,
        ),
    ];
    for (fields, expected) in cases {
        let message = error_with(fields.clone());
        assert!(
            message.starts_with(expected),
            "{fields}:\n  got      {message}\n  expected {expected}"
        );
    }
    let invalid = rule_sets_from_documents(&[with(band(doc! { "windowSeconds": 1, "capacity": 0 }))]).unwrap_err();
    assert!(matches!(invalid, MappingError::Invalid { .. }), "{invalid:?}");
}

#[test]
fn a_rule_stored_twice_names_both_documents() {
    let message = error(&[
        with(doc! { "_id": 1, "id": "r" }),
        with(doc! { "_id": 2, "id": "other" }),
        with(doc! { "_id": 3, "id": "r" }),
    ]);
    assert_eq!(
        message,
        r#"document {_id: 1, ruleSetId: "api", id: "r"} and document {_id: 3, ruleSetId: "api", id: "r"}: rule `r` of rule set `api` is stored twice"#
    );
    // The same rule id in two rule sets is two rules.
    load(&[with(doc! { "id": "r" }), with(doc! { "ruleSetId": "other", "id": "r" })]);
}

#[test]
fn rule_sets_round_trip_through_documents() {
    let mut composite = RuleSpec::new(
        "composite",
        vec![BandSpec::new(3, Duration::from_millis(500)).label("half")],
    );
    composite.scope = ScopeKind::Composite;
    composite.fields = vec!["ip".into(), "user".into(), "tenant".into()];
    composite.priority = -3;
    let mut tenant = RuleSpec::new(
        "tenant",
        vec![
            BandSpec::new(10, Duration::from_secs(1)).label("burst"),
            BandSpec::new(1000, Duration::from_secs(3600)).label("hour"),
        ],
    );
    tenant.scope = ScopeKind::Attribute;
    tenant.attribute = Some("tenant".into());
    tenant.matcher.paths = vec!["/api/**".into()];
    tenant.matcher.methods = vec!["POST".into(), "PUT".into()];
    tenant.algorithm = Algorithm::SlidingWindowLog;
    tenant.permits = 2;
    tenant.mode = Mode::Shadow;
    tenant.on_missing_key = OnMissingKey::Deny;
    tenant.on_backend_failure = Some(FailurePolicy::FallbackLocal);
    tenant.priority = 10;
    tenant.lease = Some(LeaseSpec::new(8, Duration::from_millis(1500)));
    let mut off = RuleSpec::new("off", vec![BandSpec::new(1, Duration::from_secs(86_400))]);
    off.enabled = false;
    off.scope = ScopeKind::Global;
    let preset = RuleSpec::preset("preset", Algorithm::FixedWindow);
    let mut user = RuleSpec::new("user", vec![BandSpec::new(5, Duration::from_secs(60))]);
    user.scope = ScopeKind::User;
    user.on_limit = Some(OnLimitSpec::wait(Duration::from_millis(250), 40));
    let mut key = RuleSpec::new("key", vec![BandSpec::new(5, Duration::from_secs(60))]);
    key.scope = ScopeKind::ApiKey;
    let spec = RuleSetSpec::new("api", vec![composite, tenant, off, preset, user, key]);

    let documents = rule_set_to_documents(&spec).unwrap();
    assert_eq!(documents.len(), 6);
    let sets = load(&documents);
    let expected = RuleSet::from_spec(spec.clone()).unwrap();
    let loaded = sets.get("api").unwrap();
    let mut loaded_rules: Vec<_> = loaded.rules().to_vec();
    let mut expected_rules: Vec<_> = expected.rules().to_vec();
    loaded_rules.sort_by(|a, b| a.id().cmp(b.id()));
    expected_rules.sort_by(|a, b| a.id().cmp(b.id()));
    assert_eq!(loaded_rules, expected_rules);

    // The Java shape: int64 numbers, the Java names, the fields Java requires.
    let tenant_doc = documents.iter().find(|d| d.get_str("id") == Ok("tenant")).unwrap();
    assert_eq!(tenant_doc.get_str("scope"), Ok("CUSTOM"));
    assert_eq!(tenant_doc.get_str("keyStrategyId"), Ok("tenant"));
    assert_eq!(tenant_doc.get_str("name"), Ok("tenant"));
    assert_eq!(tenant_doc.get_str("onLimitExceedPolicy"), Ok("REJECT_REQUEST"));
    assert_eq!(tenant_doc.get_str("ruleSetId"), Ok("api"));
    assert_eq!(tenant_doc.get_i32("priority"), Ok(10));
    assert_eq!(tenant_doc.get_str("mode"), Ok("shadow"));
    assert_eq!(tenant_doc.get_str("onBackendFailure"), Ok("fallback_local"));
    let bands = tenant_doc.get_array("bands").unwrap();
    assert_eq!(
        bands[1],
        Bson::Document(doc! { "windowSeconds": 3600_i64, "capacity": 1000_i64, "label": "hour" })
    );
    let composite_doc = documents.iter().find(|d| d.get_str("id") == Ok("composite")).unwrap();
    assert_eq!(
        composite_doc.get_array("bands").unwrap()[0],
        Bson::Document(doc! { "windowMillis": 500_i64, "capacity": 3_i64, "label": "half" })
    );
    let fields: Vec<&str> = composite_doc
        .get_array("compositeKeyFields")
        .unwrap()
        .iter()
        .filter_map(Bson::as_str)
        .collect();
    assert_eq!(fields, ["IP", "USER_ID", "tenant"]);
    let scopes: Vec<(&str, &str, &str)> = documents
        .iter()
        .map(|d| {
            (
                d.get_str("id").unwrap(),
                d.get_str("scope").unwrap(),
                d.get_str("keyStrategyId").unwrap(),
            )
        })
        .collect();
    assert!(scopes.contains(&("off", "GLOBAL", "global")));
    assert!(scopes.contains(&("user", "PER_USER", "userId")));
    assert!(scopes.contains(&("key", "PER_API_KEY", "apiKey")));
    assert!(scopes.contains(&("preset", "PER_IP", "ip")));

    // Grouping without validation gives the specs back, rules in id order.
    let specs = rule_set_specs_from_documents(&documents).unwrap();
    assert_eq!(specs.len(), 1);
    let ids: Vec<&str> = specs[0].rules.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["composite", "key", "off", "preset", "tenant", "user"]);
}

#[test]
fn what_cannot_be_written_is_refused() {
    let invalid = RuleSetSpec::new(
        "api",
        vec![RuleSpec::new("r", vec![BandSpec::new(0, Duration::from_secs(1))])],
    );
    assert!(matches!(rule_set_to_documents(&invalid), Err(WriteError::Rule(_))));
    assert_eq!(
        rule_set_to_documents(&RuleSetSpec::new("api", vec![])).unwrap_err().to_string(),
        "rule set `api` has no rule; one document is stored per rule, so an empty rule set cannot be stored (delete it instead)"
    );
    let fraction = RuleSetSpec::new(
        "api",
        vec![RuleSpec::new("r", vec![BandSpec::new(1, Duration::from_micros(1500))])],
    );
    assert_eq!(
        rule_set_to_documents(&fraction).unwrap_err().to_string(),
        "rule set `api`, rule `r`, field `bands[0].window`: band 1: window has a fraction of a millisecond; a window is a whole number of milliseconds"
    );
}

/// Malformed values for every field the mapping reads: none may panic.
#[test]
fn malformed_values_never_panic() {
    let values = || {
        vec![
            Bson::Null,
            Bson::Int32(i32::MIN),
            Bson::Int32(-1),
            Bson::Int32(0),
            Bson::Int64(i64::MIN),
            Bson::Int64(i64::MAX),
            Bson::Double(f64::NAN),
            Bson::Double(f64::INFINITY),
            Bson::Double(f64::NEG_INFINITY),
            Bson::Double(-0.0),
            Bson::Double(f64::MAX),
            Bson::Double(f64::MIN_POSITIVE),
            Bson::Double(1e-300),
            Bson::Double(9.3e18),
            Bson::Double(1.5),
            Bson::String(String::new()),
            Bson::String("x".repeat(10_000)),
            Bson::String("é\u{0}💥".into()),
            Bson::Boolean(true),
            Bson::Array(vec![]),
            Bson::Array(vec![Bson::Null; 3]),
            Bson::Array(vec![Bson::Document(doc! { "windowSeconds": 1, "capacity": 1 }); 10_000]),
            Bson::Document(doc! {}),
            Bson::ObjectId(ObjectId::new()),
            Bson::DateTime(bson::DateTime::MAX),
            Bson::Decimal128(bson::Decimal128::from_bytes([0xff; 16])),
            Bson::MinKey,
            Bson::Undefined,
        ]
    };
    let top = RULE_FIELDS;
    let band_fields = BAND_FIELDS;
    let mut outcomes = (0, 0);
    for value in values() {
        for key in top {
            let document = with(doc! { key: value.clone() });
            let _ = rule_from_document(&document);
            match rule_sets_from_documents(&[document]) {
                Ok(_) => outcomes.0 += 1,
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    outcomes.1 += 1;
                }
            }
        }
        for key in band_fields {
            let mut band_doc = doc! { "windowSeconds": 1, "capacity": 10 };
            band_doc.insert(key, value.clone());
            let document = with(band(band_doc));
            match rule_sets_from_documents(&[document]) {
                Ok(_) => outcomes.0 += 1,
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    outcomes.1 += 1;
                }
            }
        }
    }
    assert!(outcomes.0 > 0 && outcomes.1 > 0, "{outcomes:?}");
    // An empty document, and a rule set of many rules.
    assert!(rule_sets_from_documents(&[Document::new()]).is_err());
    let many: Vec<Document> = (0..2_000).map(|i| with(doc! { "id": format!("r{i}") })).collect();
    assert_eq!(load(&many).get("api").unwrap().rules().len(), 2_000);
}

/// Any BSON value, nested a little.
fn any_bson() -> impl Strategy<Value = Bson> {
    let leaf = prop_oneof![
        Just(Bson::Null),
        any::<bool>().prop_map(Bson::Boolean),
        any::<i32>().prop_map(Bson::Int32),
        any::<i64>().prop_map(Bson::Int64),
        any::<f64>().prop_map(Bson::Double),
        prop_oneof![Just(0.5), Just(1.0), Just(60.0), Just(-1.0), Just(1e20)].prop_map(Bson::Double),
        "[a-zA-Z_ ]{0,12}".prop_map(Bson::String),
        prop_oneof![
            Just("PER_IP"),
            Just("GLOBAL"),
            Just("CUSTOM"),
            Just("COMPOSITE"),
            Just("WAIT_FOR_REFILL"),
            Just("REJECT_REQUEST"),
            Just("500ms"),
            Just("/api/**"),
            Just("GET"),
        ]
        .prop_map(|s| Bson::String(s.to_owned())),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Bson::Array),
            prop::collection::vec((field_name(), inner), 0..6)
                .prop_map(|fields| Bson::Document(fields.into_iter().collect())),
        ]
    })
}

/// The fields a rule document may hold.
const RULE_FIELDS: [&str; 22] = [
    "_id",
    "ruleSetId",
    "id",
    "name",
    "enabled",
    "scope",
    "limitScope",
    "keyStrategyId",
    "compositeKeyFields",
    "onLimitExceedPolicy",
    "bands",
    "attributes",
    "priority",
    "paths",
    "path",
    "methods",
    "method",
    "algorithm",
    "permits",
    "onMissingKey",
    "mode",
    "onBackendFailure",
];

/// The fields a band may hold.
const BAND_FIELDS: [&str; 5] = ["capacity", "windowSeconds", "windowMillis", "window", "label"];

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(RULE_FIELDS.iter().chain(&BAND_FIELDS).copied().collect::<Vec<_>>())
            .prop_map(str::to_owned),
        "[a-z]{1,6}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the documents hold, reading them answers rule sets or an error.
    #[test]
    fn any_document_is_read_or_refused_without_panicking(
        fields in prop::collection::vec((field_name(), any_bson()), 0..12),
        bands in prop::collection::vec(prop::collection::vec((field_name(), any_bson()), 0..6), 0..4),
    ) {
        let mut document: Document = fields.into_iter().collect();
        if !bands.is_empty() && !document.contains_key("bands") {
            let bands: Vec<Bson> = bands.into_iter().map(|b| Bson::Document(b.into_iter().collect())).collect();
            document.insert("bands", bands);
        }
        let _ = rule_from_document(&document);
        match rule_sets_from_documents(&[document.clone(), with(doc! {})]) {
            Ok(sets) => prop_assert!(sets.get("api").is_some()),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// Numbers of every type and sign in the band's fields.
    #[test]
    fn any_band_numbers(capacity in any_bson(), window in any_bson(), millis in any::<Option<i64>>()) {
        let mut band_doc = doc! { "capacity": capacity, "windowSeconds": window };
        if let Some(millis) = millis {
            band_doc.insert("windowMillis", millis);
        }
        let _ = rule_sets_from_documents(&[with(band(band_doc))]);
    }
}

/// A connection string that cannot be used is refused with an error (its `Display` and its
/// `Debug`) that does not show the password in it.
#[tokio::test]
async fn a_refused_connection_string_shows_no_password() {
    for uri in [
        "mongodb://app:mongo-secret@127.0.0.1:notaport/",
        "mongodb://app:mongo-secret@127.0.0.1/?authMechanism=NOPE",
        "mongodb://app:mongo-secret@127.0.0.1/?tls=maybe",
        "mongodb://app:mongo-secret@/",
        "mongodb://app:mongo-secret@[::1/",
        "mongo://app:mongo-secret@127.0.0.1/",
        "mongodb://app:mongo-secret@127.0.0.1/?appname=x&appname=y&replicaSet=",
    ] {
        let error = fluxgate_mongodb::MongoRuleSource::connect(uri, "fluxgate")
            .await
            .map(|_| ())
            .expect_err(uri);
        let shown = format!("{error} / {error:?}");
        assert!(!shown.contains("mongo-secret"), "{uri}: {shown}");
    }
}
