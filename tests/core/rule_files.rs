//! Rule files: the three formats load the same rules; invalid ones are named precisely.

use std::time::Duration;

use fluxgate::core::{RuleError, RuleSets, Scope};

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/rules")
        .join(name)
}

#[test]
fn yaml_toml_and_json_load_the_same_rules() {
    let summary = |sets: &RuleSets| {
        let api = sets.get("api").unwrap();
        api.rules()
            .iter()
            .map(|r| {
                let bands: Vec<_> = r
                    .bands()
                    .iter()
                    .map(|b| (b.capacity(), b.window(), b.label().map(str::to_owned)))
                    .collect();
                (
                    r.id().to_string(),
                    r.priority(),
                    r.permits(),
                    r.scope().clone(),
                    r.methods().len(),
                    bands,
                )
            })
            .collect::<Vec<_>>()
    };
    let yaml = RuleSets::from_file(fixture("valid.yaml")).unwrap();
    let toml = RuleSets::from_file(fixture("valid.toml")).unwrap();
    let json = RuleSets::from_file(fixture("valid.json")).unwrap();
    assert_eq!(summary(&yaml), summary(&toml));
    assert_eq!(summary(&yaml), summary(&json));
    let rules = summary(&yaml);
    // Priority orders the rules: the tenant rule (5) comes first.
    assert_eq!(rules[0].0, "per-tenant-writes");
    assert_eq!(rules[0].3, Scope::Attribute("tenant".into()));
    assert_eq!(rules[1].5[1], (100, Duration::from_secs(60), Some("sustained".into())));
}

fn invalid(yaml_rule: &str) -> String {
    let text = format!(
        "rule_sets:\n  - id: api\n    rules:\n      - {}\n",
        yaml_rule.trim().replace('\n', "\n        ")
    );
    match RuleSets::from_yaml_str(&text) {
        Ok(_) => panic!("accepted: {text}"),
        Err(e @ RuleError::Invalid { .. }) => e.to_string(),
        Err(other) => panic!("wrong error kind {other:?} for {text}"),
    }
}

#[test]
fn invalid_rules_name_the_rule_set_rule_and_field() {
    let cases = [
        (
            "id: r1\nbands: [{capacity: 0, window: 1s}]",
            "rule `r1`, field `bands[0].capacity`",
            "capacity is 0",
        ),
        (
            "id: r2\nbands: [{capacity: 5, window: 0s}]",
            "field `bands[0].window`",
            "window is 0",
        ),
        (
            "id: r3\nbands: [{capacity: 5, window: 5x}]",
            "field `bands[0].window`",
            "invalid duration `5x`",
        ),
        (
            "id: r4\nscope: planet\nbands: [{capacity: 5, window: 1s}]",
            "field `scope`",
            "unknown variant `planet`",
        ),
        (
            "id: r5\nscope: composite\nbands: [{capacity: 5, window: 1s}]",
            "field `fields`",
            "needs `fields",
        ),
        (
            "id: r6\nscope: attribute\nbands: [{capacity: 5, window: 1s}]",
            "field `attribute`",
            "needs `attribute",
        ),
        (
            "id: r7\nmatch: {paths: [\"/a/b**\"]}\nbands: [{capacity: 5, window: 1s}]",
            "field `match.paths[0]`",
            "whole segment",
        ),
        (
            "id: r8\nmatch: {methods: [\"GE T\"]}\nbands: [{capacity: 5, window: 1s}]",
            "field `match.methods[0]`",
            "not an HTTP method",
        ),
        (
            "id: r9\npreset: leaky_bucket\nbands: [{capacity: 5, window: 1s}]",
            "field `preset`",
            "either `preset` or `bands`",
        ),
        (
            "id: r15\npreset: fixed_window\nalgorithm: sliding_window_log",
            "field `preset`",
            "contradicts `algorithm: sliding_window_log`",
        ),
        ("id: r16\npreset: gcra", "field `preset`", "unknown variant `gcra`"),
        ("id: r10\nbands: []", "field `bands`", "at least one band"),
        (
            "id: r11\npermits: 0\nbands: [{capacity: 5, window: 1s}]",
            "field `permits`",
            "permits is 0",
        ),
        ("id: r12\nbandz: []", "field `bandz`", "unknown field"),
        (
            "id: \"a:b\"\nbands: [{capacity: 5, window: 1s}]",
            "field `id`",
            "contains ':'",
        ),
        (
            "id: r13\non_missing_key: maybe\nbands: [{capacity: 5, window: 1s}]",
            "field `on_missing_key`",
            "unknown variant",
        ),
        ("id: r14", "field `bands`", "at least one band (or a `preset`)"),
        (
            "id: r15\nbands: [{capacity: 5}]",
            "field `bands[0].window`",
            "missing field",
        ),
    ];
    for (rule, place, what) in cases {
        let msg = invalid(rule);
        assert!(msg.starts_with("rule set `api`"), "{msg}");
        assert!(msg.contains(place), "expected {place:?} in: {msg}");
        assert!(msg.contains(what), "expected {what:?} in: {msg}");
    }
}

#[test]
fn duplicate_ids_and_syntax_errors() {
    let dup = "rule_sets:\n  - id: api\n    rules:\n      - {id: a, bands: [{capacity: 1, window: 1s}]}\n      - {id: a, bands: [{capacity: 1, window: 1s}]}\n";
    let msg = RuleSets::from_yaml_str(dup).unwrap_err().to_string();
    assert!(msg.contains("rule `a`") && msg.contains("duplicate rule id"), "{msg}");
    let dup_set = "rule_sets:\n  - {id: api, rules: []}\n  - {id: api, rules: []}\n";
    let msg = RuleSets::from_yaml_str(dup_set).unwrap_err().to_string();
    assert!(
        msg.contains("rule set `api`") && msg.contains("duplicate rule set id"),
        "{msg}"
    );
    let msg = RuleSets::from_json_str("{\"rule_sets\": [").unwrap_err().to_string();
    assert!(msg.starts_with("JSON syntax error"), "{msg}");
    let msg = RuleSets::from_toml_str("rule_sets = 3").unwrap_err().to_string();
    assert!(msg.contains("expected a list of rule sets"), "{msg}");
    let msg = RuleSets::from_yaml_str("rules: []").unwrap_err().to_string();
    assert!(msg.contains("field `rules`"), "{msg}");
    // A key given twice in one map: refused in every format, naming the key and where,
    // never taken from its last occurrence (here a loose limit after a tight one).
    let twice = r#"{"rule_sets": [{"id": "api", "rules": [{"id": "r", "bands": [{"capacity": 10, "window": "1s"}], "bands": [{"capacity": 1000000, "window": "1s"}]}]}]}"#;
    let msg = RuleSets::from_json_str(twice).unwrap_err().to_string();
    assert!(
        msg.starts_with("JSON syntax error") && msg.contains("`bands` is given twice") && msg.contains("line 1"),
        "{msg}"
    );
    let twice = "rule_sets:\n  - id: api\n    rules:\n      - id: r\n        bands: [{capacity: 10, window: 1s}]\n        bands: [{capacity: 1000000, window: 1s}]\n";
    let msg = RuleSets::from_yaml_str(twice).unwrap_err().to_string();
    assert!(
        msg.starts_with("YAML syntax error") && msg.contains("`bands` is given twice") && msg.contains("line"),
        "{msg}"
    );
    let twice = "[[rule_sets]]\nid = \"api\"\nid = \"web\"\nrules = []\n";
    assert!(RuleSets::from_toml_str(twice).is_err());
    // More `[` and `{` than any rule file needs are refused before the reader reads them
    // (it takes time in the square of their nesting), naming where, wherever they are:
    // nested, in a quoted scalar or a comment, after a stray quote, behind `--- `.
    let deep = "[".repeat(40_000);
    for prefix in [
        "",
        "rule_sets: ",
        "a: x 'y\nb: ",
        "a: |\n  don 't\nb: ",
        "--- ",
        "# ",
        "\u{feff}",
    ] {
        let msg = RuleSets::from_yaml_str(&format!("{prefix}{deep}"))
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("YAML syntax error: more than 20000 `[` and `{` by line"),
            "{prefix:?}: {}",
            &msg[..msg.len().min(200)]
        );
    }
    let deep = format!("rule_sets: {}", "{a: ".repeat(50_000));
    assert!(RuleSets::from_yaml_str(&deep)
        .unwrap_err()
        .to_string()
        .contains("more than 20000"));
    // A large rule file within the bound reads as before: 3,000 rules, their bands in flow
    // style, brackets in quoted scalars and comments included.
    let mut large = String::from("rule_sets:\n  - id: api\n    rules:\n");
    for n in 0..3_000 {
        large.push_str(&format!(
            "      - id: r{n} # [{{\n        match: {{ paths: [\"/a/{n}\"] }}\n        bands: [{{ capacity: 10, window: 1s }}]\n"
        ));
    }
    assert!(large.bytes().filter(|&b| b == b'[' || b == b'{').count() <= 20_000);
    assert_eq!(
        RuleSets::from_yaml_str(&large)
            .expect("a large rule file")
            .get("api")
            .unwrap()
            .rules()
            .len(),
        3_000
    );
    // A long id is cut in the error, wherever it is named.
    let long = "a".repeat(100_000);
    let msg = RuleSets::from_json_str(&format!(r#"{{"rule_sets": [{{"id": "{long}", "rules": []}}]}}"#))
        .unwrap_err()
        .to_string();
    assert!(
        msg.len() < 400 && msg.contains('…'),
        "{} bytes: {}",
        msg.len(),
        &msg[..msg.len().min(300)]
    );
    let top = r#"{"rule_sets": [], "rule_sets": []}"#;
    assert!(RuleSets::from_json_str(top)
        .unwrap_err()
        .to_string()
        .contains("`rule_sets` is given twice"));
}

/// Found by fuzzing: an empty id or key used to be echoed as the name of the place
/// (rule set ``), and YAML errors at the first character named no line.
#[test]
fn every_error_names_its_place() {
    let cases: [(&str, &[&str]); 6] = [
        (
            r#"{"rule_sets":[{"id":"","rules":[]}]}"#,
            &["rule set `#1`", "field `id`", "must not be empty"],
        ),
        (
            r#"{"rule_sets":[{"id":"a","rules":[{"id":"","bands":[{"capacity":1,"window":"1s"}]}]}]}"#,
            &["rule set `a`", "rule `#1`", "field `id`"],
        ),
        (
            r#"{"rule_sets":[{"id":"a","rules":[{"":1}]}]}"#,
            &["rule set `a`", "rule `#1`"],
        ),
        (r#"{"":1}"#, &["field `\"\"`", "unknown field"]),
        (
            r#"{"rule_sets":[{"id":"a","rules":[]},{"id":"b","rules":[{"id":"x","bands":[{"capacity":1,"window":"1s"}]},{"id":"","bands":[{"capacity":0,"window":"1s"}]}]}]}"#,
            &["rule set `b`", "rule `#2`"],
        ),
        (
            r#"{"rule_sets":[{"id":"a","rules":[]},{"id":"","rules":[]}]}"#,
            &["rule set `#2`"],
        ),
    ];
    for (json, parts) in cases {
        let msg = RuleSets::from_json_str(json).unwrap_err().to_string();
        for part in parts {
            assert!(msg.contains(part), "`{part}` missing from: {msg}");
        }
        for empty in ["set ``,", "rule ``,", "field ``:"] {
            assert!(!msg.contains(empty), "an empty name: {msg}");
        }
    }
    for (yaml, at) in [
        ("]", "at line 1 column 1"),
        ("\0", "at line 1 column 1"),
        ("*a", "at line 1 column 1"),
        ("rule_sets: [1,\n", "at line 2 column 1"),
        ("a: 1\n---\nb: 1\n", "in the text as a whole"),
    ] {
        let msg = RuleSets::from_yaml_str(yaml).unwrap_err().to_string();
        assert!(
            msg.starts_with("YAML syntax error") && msg.contains(at),
            "{yaml:?}: {msg}"
        );
    }
}

#[test]
fn file_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("fluxgate-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "rule_sets:\n  - id: web\n    rules:\n      - id: slow\n        bands: [{capacity: 0, window: 1s}]\n",
    )
    .unwrap();
    let msg = RuleSets::from_file(&bad).unwrap_err().to_string();
    assert!(
        msg.contains("bad.yaml") && msg.contains("rule set `web`, rule `slow`, field `bands[0].capacity`"),
        "{msg}"
    );
    let msg = RuleSets::from_file(dir.join("missing.yaml")).unwrap_err().to_string();
    assert!(msg.contains("missing.yaml") && msg.contains("cannot read"), "{msg}");
    let msg = RuleSets::from_file(dir.join("rules.ini")).unwrap_err().to_string();
    assert!(msg.contains("unknown rule file format"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_algorithm_and_its_preset_load() {
    use fluxgate::core::Algorithm;
    let mut yaml = String::from("rule_sets:\n  - id: algos\n    rules:\n");
    for a in Algorithm::ALL {
        let name = a.as_str();
        yaml.push_str(&format!(
            "      - {{ id: {name}, algorithm: {name}, bands: [{{ capacity: 5, window: 2s }}] }}\n      - {{ id: {name}-preset, preset: {name} }}\n"
        ));
    }
    let sets = RuleSets::from_yaml_str(&yaml).unwrap();
    let rules = sets.get("algos").unwrap().rules();
    for (pair, a) in rules.chunks(2).zip(Algorithm::ALL) {
        assert_eq!(pair[0].algorithm(), a);
        assert_eq!(pair[0].bands()[0].capacity(), 5);
        assert_eq!(pair[1].algorithm(), a);
        let band = &pair[1].bands()[0];
        let expected = match a {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => (10, 10),
            _ => (10, 60),
        };
        assert_eq!((band.capacity(), band.window().as_secs()), expected, "{a:?}");
    }
}

/// The example of `docs/configuration.md` section 5 loads in all three formats, with the
/// same rules.
#[test]
fn the_documented_example_loads_in_every_format() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md")).unwrap();
    let start = doc.find("## 5. One example").expect("section 5");
    let end = start + doc[start..].find("\n## 6.").expect("section 6");
    let section = &doc[start..end];
    let block = |lang: &str| -> String {
        let open = format!("```{lang}\n");
        let from = section.find(&open).unwrap_or_else(|| panic!("no {lang} block")) + open.len();
        section[from..from + section[from..].find("```").unwrap()].to_owned()
    };
    let yaml = RuleSets::from_yaml_str(&block("yaml")).unwrap();
    let toml = RuleSets::from_toml_str(&block("toml")).unwrap();
    let json = RuleSets::from_json_str(&block("json")).unwrap();
    let shape = |sets: &RuleSets| -> Vec<String> {
        let mut ids: Vec<&str> = sets.iter().map(|s| s.id().as_ref()).collect();
        ids.sort_unstable();
        ids.iter()
            .flat_map(|id| sets.get(id).unwrap().rules().iter())
            .map(|r| {
                format!(
                    "{} {:?} {:?} {} {:?}",
                    r.id(),
                    r.algorithm(),
                    r.scope(),
                    r.permits(),
                    r.bands().iter().map(|b| (b.capacity(), b.window())).collect::<Vec<_>>()
                )
            })
            .collect()
    };
    assert_eq!(shape(&yaml), shape(&toml));
    assert_eq!(shape(&yaml), shape(&json));
    assert!(
        shape(&yaml).iter().any(|r| r.contains("SlidingWindowLog")),
        "{:?}",
        shape(&yaml)
    );
}

#[test]
fn a_rule_file_that_is_too_large_or_not_a_file_is_refused_without_reading_it() {
    let dir = std::env::temp_dir().join(format!("fluxgate-rule-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let large = dir.join("large.yaml");
    let file = std::fs::File::create(&large).unwrap();
    // Sparse: the size without the bytes.
    file.set_len(fluxgate::core::rule::MAX_RULE_FILE + 1).unwrap();
    let error = RuleSets::from_file(&large).unwrap_err().to_string();
    assert!(
        error.contains("large.yaml") && error.contains("larger than 16777216 bytes"),
        "{error}"
    );

    // A pipe would block the reader forever: refused at once.
    let pipe = dir.join("pipe.yaml");
    let made = std::process::Command::new("mkfifo").arg(&pipe).status().unwrap();
    assert!(made.success());
    let error = RuleSets::from_file(&pipe).unwrap_err().to_string();
    assert!(
        error.contains("pipe.yaml") && error.contains("not a regular file"),
        "{error}"
    );
    let error = fluxgate::core::FileRuleSource::new(&pipe)
        .read()
        .unwrap_err()
        .to_string();
    assert!(error.contains("not a regular file"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// YAML's `.nan` and `.inf` are floats no field holds: each is refused where it is, never
/// read as an absent value (a rule set without rules, a rule without its failure policy).
#[test]
fn non_finite_numbers_are_refused_not_taken_as_absent() {
    for (field, value) in [
        ("rules", ".nan"),
        ("rules", ".inf"),
        ("on_backend_failure", ".nan"),
        ("lease", "-.inf"),
        ("on_limit", ".NaN"),
        ("preset", ".Inf"),
        ("attribute", ".nan"),
    ] {
        let text = if field == "rules" {
            format!("rule_sets:\n  - id: api\n    rules: {value}\n")
        } else {
            format!("rule_sets:\n  - id: api\n    rules:\n      - id: r\n        {field}: {value}\n        bands: [{{capacity: 1, window: 1s}}]\n")
        };
        let msg = match RuleSets::from_yaml_str(&text) {
            Ok(sets) => panic!("`{field}: {value}` accepted: {:?}", sets.get("api").unwrap()),
            Err(e) => e.to_string(),
        };
        assert!(
            msg.contains(field) && msg.contains("not a finite number"),
            "{field}: {value}: {msg}"
        );
    }
    let label = "rule_sets: [{id: api, rules: [{id: r, bands: [{capacity: 1, window: 1s, label: .nan}]}]}]";
    let msg = RuleSets::from_yaml_str(label).unwrap_err().to_string();
    assert!(
        msg.contains("bands[0].label") && msg.contains("not a finite number"),
        "{msg}"
    );
}
