//! Tests of validation: how rule sets are put together, and the typed problems errors carry.

use std::time::Duration;

use super::*;
use crate::error::RuleError;

fn rule(id: &str, priority: i32) -> Rule {
    let mut spec = RuleSpec::new(id, vec![BandSpec::new(1, Duration::from_secs(1))]);
    spec.priority = priority;
    Rule::from_spec("elsewhere", spec).unwrap()
}

#[test]
fn both_constructors_order_by_priority_and_reject_duplicate_ids() {
    let order = |set: &RuleSet| set.rules().iter().map(|r| r.id().to_string()).collect::<Vec<_>>();
    let set = RuleSet::new("s", [rule("a", 0), rule("b", 5), rule("c", 0)]).unwrap();
    assert_eq!(order(&set), ["b", "a", "c"]);
    let spec = RuleSetSpec {
        id: "s".into(),
        rules: [("a", 0), ("b", 5), ("c", 0)]
            .map(|(id, priority)| RuleSpec {
                priority,
                ..RuleSpec::new(id, vec![BandSpec::new(1, Duration::from_secs(1))])
            })
            .into(),
    };
    assert_eq!(order(&RuleSet::from_spec(spec).unwrap()), ["b", "a", "c"]);

    let msg = RuleSet::new("s", [rule("a", 0), rule("a", 1)]).unwrap_err().to_string();
    assert_eq!(
        msg,
        "rule set `s`, rule `a`, field `id`: duplicate rule id in this rule set"
    );
}

#[test]
fn a_duplicate_id_is_reported_before_the_rule_is_validated() {
    let valid = RuleSpec::new("a", vec![BandSpec::new(1, Duration::from_secs(1))]);
    let invalid = RuleSpec::new("a", vec![BandSpec::new(0, Duration::from_secs(1))]);
    let spec = RuleSetSpec {
        id: "s".into(),
        rules: vec![valid, invalid],
    };
    let msg = RuleSet::from_spec(spec).unwrap_err().to_string();
    assert!(msg.contains("duplicate rule id"), "{msg}");
}

#[test]
fn rules_from_another_rule_set_get_counters_of_this_one() {
    let set = RuleSet::new("s", [rule("a", 0)]).unwrap();
    let spec = RuleSetSpec {
        id: "s".into(),
        rules: vec![RuleSpec::new("a", vec![BandSpec::new(1, Duration::from_secs(1))])],
    };
    let same = RuleSet::from_spec(spec).unwrap();
    assert_eq!(set.rules()[0].bands()[0].ident(), same.rules()[0].bands()[0].ident());
    assert_ne!(rule("a", 0).bands()[0].ident(), same.rules()[0].bands()[0].ident());
}

#[test]
fn errors_carry_the_typed_problem_at_its_field() {
    let invalid = |bands: Vec<BandSpec>, edit: fn(&mut RuleSpec)| {
        let mut spec = RuleSpec::new("r", bands);
        edit(&mut spec);
        match Rule::from_spec("s", spec) {
            Err(RuleError::Invalid { field, message, .. }) => (field, message),
            other => panic!("{other:?}"),
        }
    };
    let second_too_short = vec![
        BandSpec::new(1, Duration::from_secs(1)),
        BandSpec::new(1, Duration::from_micros(10)),
    ];
    assert_eq!(
        invalid(second_too_short, |_| {}),
        (
            "bands[1].window".to_owned(),
            Problem::Band(BandError::OutOfRange {
                index: 1,
                error: BandRangeError::WindowTooShort
            })
        )
    );
    let fraction = vec![BandSpec::new(1, Duration::from_micros(1_000_500))];
    assert_eq!(
        invalid(fraction, |_| {}),
        (
            "bands[0].window".to_owned(),
            Problem::Band(BandError::OutOfRange {
                index: 0,
                error: BandRangeError::WindowFraction
            })
        )
    );
    let one = || vec![BandSpec::new(1, Duration::from_secs(1))];
    assert_eq!(
        invalid(one(), |s| s.matcher.methods = vec!["GET".into(), "GE T".into()]),
        (
            "match.methods[1]".to_owned(),
            Problem::Match(MatchError::Method {
                index: 1,
                method: "GE T".into()
            })
        )
    );
    // Every method meant, no method matched: refused with the way to say it.
    type Edit = fn(&mut RuleSpec);
    let wildcards: [(&str, Edit); 3] = [
        ("*", |s| s.matcher.methods = vec!["GET".into(), "*".into()]),
        ("any", |s| s.matcher.methods = vec!["GET".into(), "any".into()]),
        ("ALL", |s| s.matcher.methods = vec!["GET".into(), "ALL".into()]),
    ];
    for (wildcard, edit) in wildcards {
        let (field, problem) = invalid(one(), edit);
        assert_eq!(field, "match.methods[1]");
        assert_eq!(
            problem,
            Problem::Match(MatchError::Wildcard {
                index: 1,
                method: wildcard.into()
            })
        );
        assert!(problem.to_string().contains("leave `methods` out"), "{problem}");
    }
    assert_eq!(
        invalid(one(), |s| {
            s.scope = ScopeKind::Composite;
            s.fields = vec!["ip".into(), "a:b".into()];
        }),
        (
            "fields[1]".to_owned(),
            Problem::Scope(ScopeError::FieldName {
                index: 1,
                error: IdError::InvalidCharacter {
                    id: "a:b".into(),
                    character: ':'
                }
            })
        )
    );
    assert_eq!(
        invalid(one(), |s| s.permits = MAX_CAPACITY + 1),
        (
            "permits".to_owned(),
            Problem::PermitsTooLarge {
                permits: MAX_CAPACITY + 1
            }
        )
    );
    assert_eq!(
        Band::new(0, Duration::from_secs(1)).unwrap_err(),
        BandRangeError::CapacityZero
    );
}

#[test]
fn a_band_identity_covers_every_part_and_is_pinned() {
    use super::model::band_ident;
    let second = Duration::from_secs(1);
    let base = band_ident("s", "r", "b0", Algorithm::TokenBucket, 10, second);
    assert_eq!(base, band_ident("s", "r", "b0", Algorithm::TokenBucket, 10, second));
    let others = [
        band_ident("t", "r", "b0", Algorithm::TokenBucket, 10, second),
        band_ident("s", "q", "b0", Algorithm::TokenBucket, 10, second),
        band_ident("s", "r", "b1", Algorithm::TokenBucket, 10, second),
        band_ident("s", "r", "b0", Algorithm::LeakyBucket, 10, second),
        band_ident("s", "r", "b0", Algorithm::TokenBucket, 11, second),
        band_ident(
            "s",
            "r",
            "b0",
            Algorithm::TokenBucket,
            10,
            second + Duration::from_millis(1),
        ),
        // Texts are length-prefixed: moving a character from one to the next changes it.
        band_ident("s", "rb", "0", Algorithm::TokenBucket, 10, second),
    ];
    for other in others {
        assert_ne!(base, other);
    }
    // The encoding is part of the identity's stability: it must not change by accident.
    assert_eq!(base, 0xa8e8_a423_fb20_e5e2);
}

#[test]
fn a_lease_holds_one_request_at_least_and_a_band_at_most() {
    let with_lease = |permits: u64, max: u64, ttl: Duration| {
        let mut spec = RuleSpec::new(
            "r",
            vec![
                BandSpec::new(1000, Duration::from_secs(60)),
                BandSpec::new(100, Duration::from_secs(1)),
            ],
        );
        spec.permits = permits;
        spec.lease = Some(LeaseSpec::new(max, ttl));
        Rule::from_spec("s", spec)
    };
    let second = Duration::from_secs(1);
    let rule = with_lease(2, 100, second).unwrap();
    assert_eq!(rule.lease().map(|l| (l.max(), l.ttl())), Some((100, second)));
    let problem = |result: Result<Rule, RuleError>| match result {
        Err(RuleError::Invalid { field, message, .. }) => (field, message.to_string()),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        problem(with_lease(1, 101, second)),
        (
            "lease.max".to_owned(),
            "lease max is 101; a lease takes at most the smallest band's capacity (100)".to_owned()
        )
    );
    assert_eq!(
        problem(with_lease(5, 4, second)),
        (
            "lease.max".to_owned(),
            "lease max is 4; a lease holds at least one request, the rule's permits (5)".to_owned()
        )
    );
    assert_eq!(problem(with_lease(1, 10, Duration::ZERO)).0, "lease.ttl");
    assert_eq!(
        problem(with_lease(1, 10, Duration::from_secs(7200))),
        (
            "lease.ttl".to_owned(),
            "lease ttl is 2h; it must be from 1ms to 1h".to_owned()
        )
    );
    // From a file: the block and its duration.
    let sets = RuleSets::from_yaml_str(
        "rule_sets: [{ id: s, rules: [{ id: r, bands: [{ capacity: 10, window: 1s }], lease: { max: 5, ttl: 250ms } }] }]",
    )
    .unwrap();
    let lease = sets.get("s").unwrap().rules()[0].lease().unwrap();
    assert_eq!((lease.max(), lease.ttl()), (5, Duration::from_millis(250)));
}

/// A rule names methods of at most 32 characters, as the service's check API takes them: a
/// rule set PUT through the admin API with a method of 900,000 characters was stored for
/// every instance to load, and its error quoted it whole.
#[test]
fn a_method_longer_than_32_characters_is_refused_and_quoted_cut() {
    let with_method = |method: String| {
        let mut spec = RuleSpec::new("r", vec![BandSpec::new(1, Duration::from_secs(1))]);
        spec.matcher.methods = vec!["GET".into(), method];
        Rule::from_spec("s", spec)
    };
    assert!(with_method("M".repeat(32)).is_ok());
    for method in ["M".repeat(33), "M".repeat(900_000)] {
        let error = with_method(method).expect_err("a method of more than 32 characters");
        assert!(error.to_string().len() < 300, "{} bytes", error.to_string().len());
        match error {
            RuleError::Invalid { field, message, .. } => {
                assert_eq!(field, "match.methods[1]");
                assert!(matches!(message, Problem::Match(MatchError::Method { index: 1, .. })));
            }
            other => panic!("{other:?}"),
        }
    }
}
