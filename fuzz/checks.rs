//! The properties checked by the fuzz targets and by `tests/core/fuzz_regressions.rs`.
//!
//! Each public function takes raw bytes, decodes them into a structured input, and panics
//! when a property of the limiter's hostile-input surfaces fails. The same file is compiled
//! into every fuzz target (`fuzz/fuzz_targets/<name>.rs`) and into the regression test of
//! the root package, so a crash file replays identically in both.
//!
//! Input encodings (see `fuzz/README.md`):
//!
//! - `rule_file`: a format byte (`y`, `t`, `j`, else the byte modulo 3), then the text.
//! - `paths`: the pattern, `\n`, the raw request path.
//! - `keys`: a scope byte, a parameter byte, then values separated by `0xFF`.
//! - `client_ip`: `\n`-separated lines: the header choice byte and trusted networks, the
//!   peer address, then one line per header value (first byte: `x` or `f`, which header).
#![allow(dead_code, unreachable_pub, missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use fluxgate::core::key::{KeyResolution, KeyResolver};
use fluxgate::core::path::{normalize_path, routed_segments};
use fluxgate::core::rule::{MAX_CAPACITY, MAX_WINDOW};
use fluxgate::core::{
    BandSpec, Engine, Format, OnMissingKey, Outcome, PathPattern, RequestContext, Rule, RuleError, RuleSet, RuleSets,
    RuleSpec, ScopeKind,
};
use fluxgate::tower::{ClientIpResolver, IpNet};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};

// ---------------------------------------------------------------------------------------
// rule_file
// ---------------------------------------------------------------------------------------

/// Rule files in any of the three formats: parsing never panics, every error says where it
/// is, and whatever loads is within the documented bounds and can be decided.
pub fn rule_file(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let format = match first {
        b'y' | b'Y' => Format::Yaml,
        b't' | b'T' => Format::Toml,
        b'j' | b'J' => Format::Json,
        b => [Format::Yaml, Format::Toml, Format::Json][usize::from(b % 3)],
    };
    let text = String::from_utf8_lossy(rest);
    match RuleSets::parse(&text, format) {
        Ok(sets) => check_loaded(&sets),
        Err(RuleError::Invalid {
            rule_set,
            rule,
            field,
            message,
        }) => {
            // An empty id or key is named by its position or as `""`, never as nothing.
            assert!(
                !rule_set.is_empty(),
                "invalid-rule error without a rule set name: field `{field}`: {message}"
            );
            assert!(
                !rule.is_empty(),
                "invalid-rule error without a rule name: rule set `{rule_set}`, field `{field}`: {message}"
            );
            assert!(
                !field.is_empty(),
                "invalid-rule error without a field: rule set `{rule_set}`, rule `{rule}`: {message}"
            );
            assert!(!message.to_string().is_empty(), "invalid-rule error without a message");
        }
        Err(RuleError::Syntax { format: f, message }) => {
            assert_eq!(f, format, "syntax error names another format");
            assert!(
                has_location(&message),
                "{format} syntax error without a location: {message:?}"
            );
        }
        Err(other) => panic!("unexpected kind of error from RuleSets::parse: {other:?}"),
    }
}

/// Whether a parser's message says where the error is: serde_json and the YAML reader write
/// `at line L column C`, toml `at line L, column C`; the YAML reader's errors (a
/// control character, invalid UTF-8) give a byte offset, `at position N`.
fn has_location(message: &str) -> bool {
    let followed_by_digit = |word: &str| {
        message
            .match_indices(word)
            .any(|(i, s)| message[i + s.len()..].starts_with(|c: char| c.is_ascii_digit()))
    };
    (followed_by_digit("line ") && message.contains("column"))
        || followed_by_digit("position ")
        // The YAML reader's few errors without a position (more than one document).
        || message.ends_with("(in the text as a whole)")
}

fn check_loaded(sets: &RuleSets) {
    for set in sets.iter() {
        assert!(!set.id().is_empty(), "a loaded rule set has an empty id");
        for rule in set.rules() {
            let at = format!("rule set `{}`, rule `{}`", set.id(), rule.id());
            assert!(!rule.id().is_empty(), "{at}: empty rule id");
            assert!(
                (1..=MAX_CAPACITY).contains(&rule.permits()),
                "{at}: permits {} out of 1..=2^40",
                rule.permits()
            );
            assert!(!rule.bands().is_empty(), "{at}: no band");
            for band in rule.bands().iter() {
                assert!(
                    (1..=MAX_CAPACITY).contains(&band.capacity()),
                    "{at}: capacity {} out of 1..=2^40",
                    band.capacity()
                );
                assert!(
                    band.window() >= Duration::from_millis(1) && band.window() <= MAX_WINDOW,
                    "{at}: window {:?} out of 1ms..=10 years",
                    band.window()
                );
            }
        }
    }
    // Decide a request for every rule set, with every kind of key present, on a path that
    // each rule's first pattern matches.
    let engine = Engine::in_memory(sets.clone());
    for set in sets.iter() {
        let mut paths = vec!["/".to_owned()];
        for rule in set.rules().iter().take(4) {
            if let Some(p) = rule.paths().first() {
                paths.push(p.as_str().replace("**", "x").replace(['*', '?'], "y"));
            }
        }
        for (i, path) in paths.iter().enumerate() {
            let mut builder = RequestContext::builder()
                .rule_set_id(set.id().clone())
                .path(path)
                .user_id("u")
                .api_key("k");
            if i % 2 == 1 {
                builder = builder.client_ip(IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1)));
            }
            for rule in set.rules() {
                if let fluxgate::core::Scope::Attribute(name) = rule.scope() {
                    builder = builder.attribute(name.to_string(), "v");
                }
            }
            let ctx = builder.build();
            match engine.check(&ctx).into_ready() {
                Ok(Ok(decision)) => assert_eq!(&*decision.rule_set, &**set.id(), "decided by another rule set"),
                Ok(Err(e)) => panic!("rule set `{}` loaded but cannot be decided: {e}", set.id()),
                Err(_) => panic!("the in-memory engine did not decide synchronously"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// paths
// ---------------------------------------------------------------------------------------

/// Path normalization and Ant patterns on request paths that `http::Uri` accepts.
pub fn paths(data: &[u8]) {
    let (pattern, raw) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b"/"[..]),
    };
    let pattern = String::from_utf8_lossy(pattern);
    // Any string at all: no panic.
    let _ = normalize_path(&String::from_utf8_lossy(raw));
    let Ok(uri) = Uri::try_from(raw) else {
        return;
    };
    // What axum's router sees.
    let raw = uri.path();
    check_normalized(raw);

    let routed = routed_segments(raw);
    assert_eq!(routed, reference_routed(raw), "routed_segments({raw:?})");

    let parsed = PathPattern::from_str(&pattern);
    assert_eq!(
        parsed.is_ok(),
        reference_pattern_valid(&pattern),
        "PathPattern::from_str({pattern:?}) = {parsed:?}"
    );
    let Ok(parsed) = parsed else {
        return;
    };
    // Each segment of the pattern, decoded and as written: a path's segment matches either.
    let written: Vec<Vec<char>> = pattern
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|s| s.chars().collect())
        .collect();
    let decoded: Vec<Vec<char>> = reference_decode(&pattern)
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|s| s.chars().collect())
        .collect();
    let pat: Vec<[Vec<char>; 2]> = decoded.into_iter().zip(written).map(|(d, w)| [d, w]).collect();
    // A pattern that writes `%2F` also matches with it read as a `/` (when that reads as a
    // pattern at all), never as written.
    let flat_text = pattern.replace("%2F", "/").replace("%2f", "/");
    let twin: Option<Vec<[Vec<char>; 2]>> = (flat_text != pattern && reference_pattern_valid(&flat_text)).then(|| {
        let segments = |text: &str| -> Vec<Vec<char>> {
            text.split('/')
                .filter(|s| !s.is_empty())
                .map(|s| s.chars().collect())
                .collect()
        };
        let written = segments(&flat_text);
        segments(&reference_decode(&flat_text))
            .into_iter()
            .zip(written)
            .map(|(d, w)| [d, w])
            .collect()
    });
    let matches_pat = |segments: &[&str]| {
        reference_matches(&pat, segments) || twin.as_ref().is_some_and(|t| reference_matches(t, segments))
    };
    let normalized = normalize_path(raw);
    let normal_segments: Vec<&str> = normalized.split('/').filter(|s| !s.is_empty()).collect();
    // A pattern ignores its trailing `/`, so the routed view is also matched without the
    // request's: `/items/*/` applies to `/items//`, which reaches an `/items/{id}/` route.
    let without_slash = |routed: &[&str]| match routed.split_last() {
        Some((&"", rest)) => matches_pat(rest),
        _ => false,
    };
    let by_route = matches_pat(&routed) || without_slash(&routed);
    // Behind a middleware that trims the runs of `/` at both ends (tower-http's
    // `NormalizePathLayer`), the router sees `/` and the rest, when there are such runs.
    let trimmed_raw = if raw.starts_with("//") || raw.ends_with('/') {
        format!("/{}", raw.trim_matches('/'))
    } else {
        raw.to_owned()
    };
    let by_trim = trimmed_raw != raw && matches_pat(&reference_routed(&trimmed_raw));
    assert_eq!(
        parsed.matches_routed_trimmed(raw),
        by_trim,
        "`{pattern}`.matches_routed_trimmed({raw:?}), trimmed {trimmed_raw:?}"
    );
    let by_path = matches_pat(&normal_segments);
    assert_eq!(
        parsed.matches_routed(raw),
        matches_pat(&routed),
        "`{pattern}`.matches_routed({raw:?}), segments {routed:?}"
    );
    assert_eq!(
        parsed.matches_routed_or_without_trailing_slash(raw) || by_trim,
        by_route || by_trim,
        "`{pattern}`.matches_routed_or_without_trailing_slash({raw:?}), segments {routed:?}"
    );
    assert_eq!(
        parsed.matches(&normalized),
        by_path,
        "`{pattern}`.matches({normalized:?}) (from {raw:?})"
    );
    // With escapes, two views more: the routed segments decoded (with or without the
    // trailing `/`, or trimmed), and the normalized path with `%2F` decoded too.
    let by_decoded = raw.contains('%') && {
        let decoded: Vec<String> = routed.iter().map(|s| reference_decode(s)).collect();
        let decoded: Vec<&str> = decoded.iter().map(String::as_str).collect();
        let trimmed: Vec<String> = reference_routed(&trimmed_raw)
            .iter()
            .map(|s| reference_decode(s))
            .collect();
        let trimmed: Vec<&str> = trimmed.iter().map(String::as_str).collect();
        // `%2F` decoded first, as a wildcard parameter holds it: split as routed (each
        // segment decoded, with or without the trailing `/`, or trimmed), and normalized.
        let slashes = raw.replace("%2F", "/").replace("%2f", "/");
        let flat_routed: Vec<String> = reference_routed(&slashes).iter().map(|s| reference_decode(s)).collect();
        let flat_routed: Vec<&str> = flat_routed.iter().map(String::as_str).collect();
        let flat_trimmed = format!("/{}", slashes.split(['?', '#']).next().unwrap_or("").trim_matches('/'));
        let flat_trimmed: Vec<String> = reference_routed(&flat_trimmed)
            .iter()
            .map(|s| reference_decode(s))
            .collect();
        let flat_trimmed: Vec<&str> = flat_trimmed.iter().map(String::as_str).collect();
        let flattened = normalize_path(&slashes);
        let flattened: Vec<&str> = flattened.split('/').filter(|s| !s.is_empty()).collect();
        matches_pat(&decoded)
            || without_slash(&decoded)
            || (trimmed_raw != raw && matches_pat(&trimmed))
            || matches_pat(&flat_routed)
            || without_slash(&flat_routed)
            || (flat_trimmed != flat_routed && matches_pat(&flat_trimmed))
            || matches_pat(&flattened)
    };
    // With a dot or empty segment, or a `%2F`: for each root k (up to 16 segments deep) a
    // wildcard may begin at, the segments before k as they are and the rest read with `%2F`
    // as `/` and cleaned, never above k. The segments are the routed ones decoded (`%2F`
    // kept), and the same trimmed of empty segments at either end.
    let by_clamped = {
        let decoded: Vec<String> = routed.iter().map(|s| reference_decode(s)).collect();
        let first = decoded.iter().take_while(|s| s.is_empty()).count();
        let last = decoded.len() - decoded[first..].iter().rev().take_while(|s| s.is_empty()).count();
        let trimmed: Vec<String> = decoded[first..last].to_vec();
        let dotted = |s: &str| matches!(s, "" | "." | "..");
        [decoded, trimmed].iter().any(|base| {
            (1..base.len().min(17)).any(|k| {
                let flattened = base[k..].iter().any(|s| s.contains("%2F"));
                let rest: Vec<&str> = base[k..].iter().flat_map(|s| s.split("%2F")).collect();
                if !rest.iter().any(|s| dotted(s)) && !flattened {
                    return false;
                }
                // Read with `%2F` as `/`, not cleaned.
                let split: Vec<&str> = base[..k]
                    .iter()
                    .map(String::as_str)
                    .chain(rest.iter().copied())
                    .collect();
                if flattened && matches_pat(&split) {
                    return true;
                }
                let mut kept: Vec<&str> = base[..k].iter().map(String::as_str).collect();
                for s in rest {
                    match s {
                        "" | "." => {}
                        ".." if kept.len() > k => drop(kept.pop()),
                        ".." => {}
                        s => kept.push(s),
                    }
                }
                matches_pat(&kept)
            })
        })
    };
    let by_route = by_route || by_trim || by_decoded || by_clamped;

    // A rule with the pattern applies exactly when the routed (with or without its trailing
    // `/`, or trimmed) or the normalized path matches, for GET and HEAD alike, and never for another
    // method.
    let mut spec = RuleSpec::new("r", vec![BandSpec::new(MAX_CAPACITY, Duration::from_secs(1))]);
    spec.matcher.paths = vec![pattern.to_string()];
    spec.matcher.methods = vec!["GET".to_owned()];
    let rule = Rule::from_spec("default", spec).expect("a rule with a valid pattern is valid");
    let at = |method: Method| RequestContext::builder().method(method).path(raw).build();
    let expected = by_route || by_path;
    assert_eq!(
        rule.applies(&at(Method::GET)),
        expected,
        "rule on `{pattern}` for GET {raw:?} (routed {by_route}, normalized {by_path})"
    );
    assert_eq!(
        rule.applies(&at(Method::HEAD)),
        expected,
        "rule on `{pattern}` for HEAD {raw:?}"
    );
    assert!(!rule.applies(&at(Method::POST)), "rule on `{pattern}` for POST {raw:?}");

    // The engine counts the request under the rule exactly when the rule applies.
    let set = RuleSet::new("default", [rule]).expect("valid rule set");
    let engine = Engine::in_memory(RuleSets::from_iter([set]));
    for method in [Method::GET, Method::HEAD] {
        let Ok(Ok(decision)) = engine.check(&at(method.clone())).into_ready() else {
            panic!("the in-memory engine did not decide {method} {raw:?}");
        };
        assert_eq!(
            decision.outcome != Outcome::NoMatchingRule,
            expected,
            "engine on `{pattern}` for {method} {raw:?}: {:?}",
            decision.outcome
        );
    }
}

fn check_normalized(raw: &str) {
    let n = normalize_path(raw);
    assert!(
        n.starts_with('/'),
        "normalize_path({raw:?}) = {n:?} does not start with /"
    );
    for bad in ["//", "/./", "/../"] {
        assert!(!n.contains(bad), "normalize_path({raw:?}) = {n:?} contains {bad}");
    }
    for bad in ["/.", "/.."] {
        assert!(!n.ends_with(bad), "normalize_path({raw:?}) = {n:?} ends in {bad}");
    }
    assert!(
        n == "/" || !n.ends_with('/'),
        "normalize_path({raw:?}) = {n:?} ends in /"
    );
    assert!(
        !n.contains(['?', '#']),
        "normalize_path({raw:?}) = {n:?} keeps a query or fragment"
    );
    assert!(
        !has_unnormalized_escape(&n),
        "normalize_path({raw:?}) = {n:?} holds an escape that normalization changes"
    );
    let again = normalize_path(&n);
    assert_eq!(
        again, n,
        "normalize_path is not idempotent: {raw:?} -> {n:?} -> {again:?}"
    );
}

/// Whether a path holds a `%XX` escape that normalization would change: one with a
/// lower-case hex digit (upper-cased), or of an ASCII character other than those that
/// stay escaped (`/`, `%`, `?`, `#` and ASCII control characters; decoded).
fn has_unnormalized_escape(path: &str) -> bool {
    path.as_bytes().windows(3).any(|w| {
        let digit = |c: u8| char::from(c).to_digit(16);
        match (w[0], digit(w[1]), digit(w[2])) {
            (b'%', Some(h), Some(l)) => {
                let byte = (h * 16 + l) as u8;
                (byte.is_ascii() && !stays_escaped(char::from(byte)))
                    || w[1].is_ascii_lowercase()
                    || w[2].is_ascii_lowercase()
            }
            _ => false,
        }
    })
}

/// The characters an escape of which stays one in a normalized path.
fn stays_escaped(c: char) -> bool {
    matches!(c, '/' | '%' | '?' | '#') || c.is_ascii_control()
}

/// A path (or pattern) with its escapes decoded, as documented for `normalize_path`: each
/// run of escapes decoded to bytes; each character they form written as itself unless it
/// stays escaped; each byte that forms none, and each character that stays escaped,
/// written as escapes with upper-case digits; a `%` that starts no escape as `%25`.
fn reference_decode(text: &str) -> String {
    let mut out = String::new();
    let mut run: Vec<u8> = Vec::new();
    let flush = |run: &mut Vec<u8>, out: &mut String| {
        for chunk in run.utf8_chunks() {
            for c in chunk.valid().chars() {
                if stays_escaped(c) {
                    let mut buf = [0; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        out.push_str(&format!("%{b:02X}"));
                    }
                } else {
                    out.push(c);
                }
            }
            for b in chunk.invalid() {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        run.clear();
    };
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let escape = (chars[i] == '%')
            .then(|| Some((chars.get(i + 1)?.to_digit(16)?, chars.get(i + 2)?.to_digit(16)?)))
            .flatten();
        if let Some((h, l)) = escape {
            run.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        flush(&mut run, &mut out);
        if chars[i] == '%' {
            out.push_str("%25");
        } else {
            out.push(chars[i]);
        }
        i += 1;
    }
    flush(&mut run, &mut out);
    out
}

/// The segments a router sees, from the documentation of `routed_segments`.
fn reference_routed(raw: &str) -> Vec<&str> {
    let path = raw.split(['?', '#']).next().unwrap_or("");
    let path = path.strip_prefix('/').unwrap_or(path);
    if path.is_empty() {
        Vec::new()
    } else {
        path.split('/').collect()
    }
}

/// The documented pattern syntax: checked as written, and decoded (no escaped `*`, no
/// `.` or `..` segment once decoded).
fn reference_pattern_valid(p: &str) -> bool {
    let decoded = reference_decode(p);
    p.starts_with('/')
        && !p.contains(['#', ' '])
        && !p.chars().any(char::is_control)
        && decoded.matches('*').count() == p.matches('*').count()
        && decoded
            .split('/')
            .all(|s| s != "." && s != ".." && (s == "**" || !s.contains("**")))
}

/// Ant matching over segments, by dynamic programming: `**` any number of whole segments,
/// `*` any characters within one segment (an empty segment too), `?` one character. Each
/// pattern segment is given in its two spellings (decoded, as written): either may match.
fn reference_matches(pattern: &[[Vec<char>; 2]], segments: &[&str]) -> bool {
    let segments: Vec<Vec<char>> = segments.iter().map(|s| s.chars().collect()).collect();
    // reach[j]: the pattern so far matches the first j segments.
    let mut reach = vec![false; segments.len() + 1];
    reach[0] = true;
    for p in pattern {
        let mut next = vec![false; segments.len() + 1];
        if p[0].as_slice() == ['*', '*'] {
            let mut any = false;
            for (n, r) in next.iter_mut().zip(&reach) {
                any |= *r;
                *n = any;
            }
        } else {
            for (j, s) in segments.iter().enumerate() {
                if reach[j] && (glob(&p[0], s) || glob(&p[1], s)) {
                    next[j + 1] = true;
                }
            }
        }
        reach = next;
    }
    reach[segments.len()]
}

fn glob(pattern: &[char], text: &[char]) -> bool {
    let mut reach = vec![false; text.len() + 1];
    reach[0] = true;
    for &c in pattern {
        let mut next = vec![false; text.len() + 1];
        if c == '*' {
            let mut any = false;
            for (n, r) in next.iter_mut().zip(&reach) {
                any |= *r;
                *n = any;
            }
        } else {
            for (j, &t) in text.iter().enumerate() {
                if reach[j] && (c == '?' || c == t) {
                    next[j + 1] = true;
                }
                // `?` is one character to the handler: an escape (`%3F`) is one.
                let hex = |k: usize| text.get(k).is_some_and(char::is_ascii_hexdigit);
                if reach[j] && c == '?' && t == '%' && hex(j + 1) && hex(j + 2) {
                    next[j + 3] = true;
                }
            }
        }
        reach = next;
    }
    reach[text.len()]
}

// ---------------------------------------------------------------------------------------
// keys
// ---------------------------------------------------------------------------------------

const ATTRIBUTE_NAMES: [&str; 4] = [
    "tenant",
    "a",
    "x.y-z_0",
    "n123456789n123456789n123456789n123456789n123456789n123456789n123",
];

/// Rule keys: injective, bounded, and free of characters that could be read as structure.
pub fn keys(data: &[u8]) {
    let [scope, param, rest @ ..] = data else {
        return;
    };
    let attribute = ATTRIBUTE_NAMES[usize::from(*param) % ATTRIBUTE_NAMES.len()];
    let values: Vec<String> = rest
        .split(|&b| b == 0xFF)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    let value = |i: usize| values.get(i).cloned().unwrap_or_default();
    match scope % 5 {
        0 => key_pair(ScopeKind::User, None, &[value(0)], &[value(1)]),
        1 => key_pair(ScopeKind::ApiKey, None, &[value(0)], &[value(1)]),
        2 => key_pair(ScopeKind::Attribute, Some(attribute), &[value(0)], &[value(1)]),
        3 => key_pair(
            ScopeKind::Composite,
            Some(attribute),
            &[value(0), value(1)],
            &[value(2), value(3)],
        ),
        _ => ip_keys(*param, rest),
    }
}

fn key_rule(scope: ScopeKind, attribute: Option<&str>) -> Rule {
    let mut spec = RuleSpec::new("r", vec![BandSpec::new(1, Duration::from_secs(1))]);
    spec.scope = scope;
    spec.on_missing_key = OnMissingKey::Deny;
    match scope {
        ScopeKind::Attribute => spec.attribute = attribute.map(str::to_owned),
        ScopeKind::Composite => {
            spec.fields = vec!["user".to_owned(), attribute.unwrap_or("tenant").to_owned()];
        }
        _ => {}
    }
    Rule::from_spec("s", spec).expect("valid key rule")
}

fn resolve(resolver: &KeyResolver, rule: &Rule, ctx: &RequestContext) -> String {
    match resolver.resolve(rule, ctx) {
        KeyResolution::Key(k) => k.to_string(),
        other => panic!("a present key value resolved to {other:?}"),
    }
}

/// The tags of the key's components, and the values each must encode.
fn key_of(scope: ScopeKind, attribute: Option<&str>, values: &[String]) -> (String, Vec<(String, String)>) {
    let rule = key_rule(scope, attribute);
    let attr_tag = format!("a.{}", attribute.unwrap_or("tenant"));
    let b = RequestContext::builder();
    let (ctx, parts) = match scope {
        ScopeKind::User => (b.user_id(&values[0]), vec![("user".to_owned(), values[0].clone())]),
        ScopeKind::ApiKey => (b.api_key(&values[0]), vec![("key".to_owned(), values[0].clone())]),
        ScopeKind::Attribute => (
            b.attribute(attribute.unwrap_or("tenant"), &values[0]),
            vec![(attr_tag, values[0].clone())],
        ),
        _ => (
            b.user_id(&values[0])
                .attribute(attribute.unwrap_or("tenant"), &values[1]),
            vec![("user".to_owned(), values[0].clone()), (attr_tag, values[1].clone())],
        ),
    };
    (resolve(&KeyResolver::default(), &rule, &ctx.build()), parts)
}

fn key_pair(scope: ScopeKind, attribute: Option<&str>, a: &[String], b: &[String]) {
    let (ka, parts_a) = key_of(scope, attribute, a);
    let (kb, parts_b) = key_of(scope, attribute, b);
    check_key_shape(&ka, &parts_a);
    check_key_shape(&kb, &parts_b);
    if a == b {
        assert_eq!(ka, kb, "the same values gave two keys");
    } else {
        assert_ne!(ka, kb, "different values {a:?} and {b:?} share the key {ka:?}");
    }
}

fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// A key is `tag=value` or `tag~hash` components joined by `:`; a value is the exact
/// percent-encoding of the input (so keys are injective), and a hash replaces only values
/// whose encoding is longer than 64.
fn check_key_shape(key: &str, parts: &[(String, String)]) {
    check_key_chars(key);
    let components: Vec<&str> = key.split(':').collect();
    assert_eq!(
        components.len(),
        parts.len(),
        "key {key:?} has {} `:` for {} fields",
        components.len() - 1,
        parts.len()
    );
    for (component, (tag, value)) in components.iter().zip(parts) {
        let rest = component
            .strip_prefix(tag.as_str())
            .unwrap_or_else(|| panic!("component {component:?} of {key:?} does not start with `{tag}`"));
        let encoded_len: usize = value.bytes().map(|b| if is_plain(b) { 1 } else { 3 }).sum();
        if let Some(encoded) = rest.strip_prefix('=') {
            assert!(
                encoded.len() <= 64,
                "component {component:?} is longer than its tag + 65"
            );
            assert_eq!(
                percent_decode(encoded).as_deref(),
                Some(value.as_bytes()),
                "component {component:?} does not encode {value:?}"
            );
        } else if let Some(hash) = rest.strip_prefix('~') {
            assert!(
                hash.len() == 32 && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "component {component:?}: the hash is not 32 hex digits"
            );
            assert!(encoded_len > 64, "{value:?} is hashed although its encoding is short");
        } else {
            panic!("component {component:?} of {key:?}: no `=` or `~` after the tag");
        }
    }
}

fn check_key_chars(key: &str) {
    assert!(
        !key.chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '{' || c == '}'),
        "key {key:?} contains braces, whitespace or a control character"
    );
    assert!(
        key.bytes()
            .all(|b| is_plain(b) || matches!(b, b'%' | b'=' | b'~' | b':')),
        "key {key:?} has a character outside A-Z a-z 0-9 . _ - % = ~ :"
    );
}

/// Strict percent-decoding: `%` must start two upper-case hex digits of a byte that
/// needed escaping, every other byte must be plain.
fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = |c: u8| match c {
                b'0'..=b'9' => Some(c - b'0'),
                b'A'..=b'F' => Some(c - b'A' + 10),
                _ => None,
            };
            let byte = hex(*b.get(i + 1)?)? << 4 | hex(*b.get(i + 2)?)?;
            if is_plain(byte) {
                return None;
            }
            out.push(byte);
            i += 3;
        } else if is_plain(b[i]) {
            out.push(b[i]);
            i += 1;
        } else {
            return None;
        }
    }
    Some(out)
}

/// Reads an address: a kind byte (v4, v6, IPv4-mapped v6, v6 under the NAT64 well-known
/// prefix, IPv4-translated, in a 6to4 network, a Teredo or a link-local address, or the
/// previous address with one bit flipped) and its bytes. A link-local address is cut to
/// the prefix like any other.
fn take_ip(bytes: &mut &[u8], previous: Option<IpAddr>) -> IpAddr {
    let mut take = |n: usize| -> Vec<u8> {
        let (head, tail) = bytes.split_at(n.min(bytes.len()));
        *bytes = tail;
        let mut v = head.to_vec();
        v.resize(n, 0);
        v
    };
    let kind = take(1)[0];
    match (kind % 4, previous) {
        (0, _) => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(take(4)).expect("4 bytes"))),
        (2, _) => {
            let v4 = Ipv4Addr::from(<[u8; 4]>::try_from(take(4)).expect("4 bytes"));
            if kind & 16 != 0 {
                // A Teredo client (`2001:0::/32`), its address inverted in the last 32
                // bits; or an IPv4-translated address (`::ffff:0:a.b.c.d`).
                let mut octets = [0u8; 16];
                if kind & 32 != 0 {
                    octets[..4].copy_from_slice(&[0x20, 0x01, 0, 0]);
                    let middle = take(8);
                    octets[4..12].copy_from_slice(&middle);
                    octets[12..].copy_from_slice(&(!u32::from(v4)).to_be_bytes());
                } else {
                    octets[8..10].copy_from_slice(&[0xff, 0xff]);
                    octets[12..].copy_from_slice(&v4.octets());
                }
                IpAddr::V6(Ipv6Addr::from(octets))
            } else if kind & 8 != 0 {
                // A host of the 6to4 network `2002:WWXX:YYZZ::/48`, the rest of its bits
                // from the input.
                let rest = take(10);
                let mut octets = [0u8; 16];
                octets[..2].copy_from_slice(&[0x20, 0x02]);
                octets[2..6].copy_from_slice(&v4.octets());
                octets[6..6 + rest.len()].copy_from_slice(&rest);
                IpAddr::V6(Ipv6Addr::from(octets))
            } else if kind & 4 == 0 {
                IpAddr::V6(v4.to_ipv6_mapped())
            } else {
                // Under the NAT64 well-known prefix, `64:ff9b::/96`.
                IpAddr::V6(Ipv6Addr::from(
                    (0x64_u128 << 112) | (0xff9b_u128 << 96) | u128::from(u32::from(v4)),
                ))
            }
        }
        (3, Some(IpAddr::V6(p))) => {
            let bit = take(1)[0] % 128;
            IpAddr::V6(Ipv6Addr::from(u128::from(p) ^ (1u128 << bit)))
        }
        (3, Some(IpAddr::V4(p))) => {
            let bit = take(1)[0] % 32;
            IpAddr::V4(Ipv4Addr::from(u32::from(p) ^ (1u32 << bit)))
        }
        _ => {
            let mut octets = <[u8; 16]>::try_from(take(16)).expect("16 bytes");
            if kind & 64 != 0 {
                // Link-local: `fe80::/10`, the rest from the input.
                octets[0] = 0xfe;
                octets[1] = 0x80 | (octets[1] & 0x3f);
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
    }
}

fn reference_mask(ip: IpAddr, prefix: u8) -> IpAddr {
    // IPv4-mapped, IPv4-translated (`::ffff:0:a.b.c.d`), under the NAT64 well-known prefix
    // `64:ff9b::/96`, in the 6to4 network `2002:WWXX:YYZZ::/48` of the host `WW.XX.YY.ZZ`,
    // or a Teredo client (`2001:0::/32`, its address inverted in the last four bytes).
    let embedded = |v6: Ipv6Addr| {
        let (s, o) = (v6.segments(), v6.octets());
        let last = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
        v6.to_ipv4_mapped()
            .or_else(|| (s[..6] == [0, 0, 0, 0, 0xffff, 0]).then_some(last))
            .or_else(|| (s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]).then_some(last))
            .or_else(|| (s[0] == 0x2002).then(|| Ipv4Addr::new(o[2], o[3], o[4], o[5])))
            .or_else(|| (s[..2] == [0x2001, 0]).then(|| Ipv4Addr::from(last.octets().map(|b| !b))))
    };
    match ip {
        IpAddr::V6(v6) => match embedded(v6) {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let keep = if prefix >= 128 {
                    u128::MAX
                } else {
                    !(u128::MAX >> prefix)
                };
                IpAddr::V6(Ipv6Addr::from(u128::from(v6) & keep))
            }
        },
        v4 => v4,
    }
}

fn ip_keys(param: u8, mut bytes: &[u8]) {
    let prefix = 1 + param % 128;
    let resolver = KeyResolver::new(prefix);
    let rule = key_rule(ScopeKind::Ip, None);
    let a = take_ip(&mut bytes, None);
    let b = take_ip(&mut bytes, Some(a));
    let key = |ip: IpAddr| resolve(&resolver, &rule, &RequestContext::builder().client_ip(ip).build());
    let (ka, kb) = (key(a), key(b));
    let (ma, mb) = (resolver.mask(a), resolver.mask(b));
    assert_eq!(ma, reference_mask(a, prefix), "mask({a}) at /{prefix}");
    assert_eq!(mb, reference_mask(b, prefix), "mask({b}) at /{prefix}");
    for (ip, masked, k) in [(a, ma, &ka), (b, mb, &kb)] {
        check_key_chars(k);
        assert!(!k.contains(':'), "IP key {k:?} contains `:`");
        let encoded = k
            .strip_prefix("ip=")
            .unwrap_or_else(|| panic!("IP key {k:?} does not start with ip="));
        assert!(encoded.len() <= 64, "IP key {k:?} is longer than ip= + 64");
        let expected = match masked {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) if prefix < 128 => format!("{v6}_{prefix}"),
            IpAddr::V6(v6) => v6.to_string(),
        };
        assert_eq!(
            percent_decode(encoded).as_deref(),
            Some(expected.as_bytes()),
            "key {k:?} of {ip} at /{prefix}"
        );
    }
    if ma == mb {
        assert_eq!(ka, kb, "{a} and {b} mask alike at /{prefix} but have two keys");
    } else {
        assert_ne!(ka, kb, "{a} and {b} differ at /{prefix} but share the key {ka:?}");
    }
}

// ---------------------------------------------------------------------------------------
// client_ip
// ---------------------------------------------------------------------------------------

const XFF: &str = "x-forwarded-for";
const FORWARDED: &str = "forwarded";

fn header_choice(b: u8) -> &'static str {
    match b {
        b'x' | b'X' => XFF,
        b'f' | b'F' => FORWARDED,
        b if b & 1 == 0 => XFF,
        _ => FORWARDED,
    }
}

/// A trusted network as documented: an address or `address/prefix`, IPv4-mapped IPv6
/// read as IPv4, the prefix at most 32 or 128.
#[derive(Debug, Clone, Copy)]
struct Net {
    addr: IpAddr,
    prefix: u8,
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

impl Net {
    fn parse(s: &str) -> Option<Self> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr = canonical(addr.trim().parse().ok()?);
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.trim().parse::<u8>().ok().filter(|p| *p <= max)?,
            None => max,
        };
        Some(Self { addr, prefix })
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => (u128::from(u32::from(v4)) << 96, 32),
            IpAddr::V6(v6) => (u128::from(v6), 128),
        };
        let (net, net_width) = bits(self.addr);
        let (ip, ip_width) = bits(canonical(ip));
        if net_width != ip_width {
            return false;
        }
        let keep = !u128::MAX.checked_shr(u32::from(self.prefix)).unwrap_or(0);
        net & keep == ip & keep
    }
}

/// How a hop of a forwarding header reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hop {
    /// An address in one of the documented forms.
    Addr(IpAddr),
    /// Not an address.
    Garbage,
    /// Not in a documented form, but an address to a lenient reader (brackets with junk
    /// after them, a zone, inner spaces): the library may read it either way.
    Lenient(IpAddr),
}

/// `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:80`.
fn read_hop(hop: &str) -> Hop {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Hop::Addr(ip);
    }
    if let Ok(sa) = hop.parse::<SocketAddr>() {
        return Hop::Addr(sa.ip());
    }
    if let Some(inner) = hop.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        if let Ok(ip) = inner.parse::<IpAddr>() {
            return Hop::Addr(ip);
        }
    }
    // A lenient reader: trims again, drops a zone, ignores what follows `]`.
    let t = hop.trim().trim_matches('"').trim();
    if let Ok(ip) = t.parse::<IpAddr>() {
        return Hop::Lenient(ip);
    }
    if let Ok(sa) = t.parse::<SocketAddr>() {
        return Hop::Lenient(sa.ip());
    }
    if let Some(inner) = t.strip_prefix('[').and_then(|h| h.split(']').next()) {
        let inner = inner.split('%').next().unwrap_or(inner).trim();
        if let Ok(ip) = inner.parse::<IpAddr>() {
            return Hop::Lenient(ip);
        }
    }
    Hop::Garbage
}

/// The hops of the configured header, left to right: each comma-separated element of every
/// line (for `Forwarded`, see [`forwarded_hops`]).
fn reference_hops(headers: &HeaderMap, header: &str) -> Vec<Hop> {
    let mut hops = Vec::new();
    for value in headers.get_all(header) {
        let text = String::from_utf8_lossy(value.as_bytes());
        if header == FORWARDED {
            hops.extend(forwarded_hops(&text));
        } else {
            hops.extend(text.split(',').map(|element| read_hop(element.trim())));
        }
    }
    hops
}

/// `text` split at `sep` outside quoted-strings, read from the right as RFC 7239 writes
/// them: a `"` closes a quoted-string, and the nearest `"` left of it not escaped by an
/// odd run of `\` opens it. The parts left to right, and whether a quote was left open at
/// the left end (the leftmost part is then not well formed).
fn split_outside_quotes(text: &str, sep: u8) -> (Vec<&str>, bool) {
    let bytes = text.as_bytes();
    let mut parts = Vec::new();
    let (mut end, mut i, mut open) = (bytes.len(), bytes.len(), false);
    while i > 0 {
        i -= 1;
        let b = bytes[i];
        if b == b'"' {
            if open {
                let escapes = bytes[..i].iter().rev().take_while(|&&c| c == b'\\').count();
                if escapes % 2 == 0 {
                    open = false;
                }
            } else {
                open = true;
            }
        } else if b == sep && !open {
            parts.push(&text[i + 1..end]);
            end = i;
        }
    }
    parts.push(&text[..end]);
    parts.reverse();
    (parts, open)
}

/// A quoted-string's content, or the value as it is.
fn unquote(value: &str) -> &str {
    value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value)
}

/// The hops of one `Forwarded` line, left to right (RFC 7239: elements split at commas and
/// pairs at semicolons, outside quoted-strings).
/// - An empty element is no hop.
/// - An element read strictly (`name=value` pairs, no whitespace in it outside its
///   quoted-strings, each value a quoted-string or a run without `= ; , "`) is its one
///   `for=` value read by [`read_hop`], or `Garbage` without one, or with two.
/// - Any other element is `Lenient` when a `for=` of it, read loosely, is an address (the
///   library may read it either way, or end the walk there), else `Garbage`.
/// - A quote left open at the left end makes the leftmost element `Garbage`.
fn forwarded_hops(line: &str) -> Vec<Hop> {
    let (elements, open) = split_outside_quotes(line, b',');
    let mut hops = Vec::new();
    for (i, element) in elements.iter().enumerate() {
        let element = element.trim_matches(|c| c == ' ' || c == '\t');
        if i == 0 && open {
            hops.push(Hop::Garbage);
            continue;
        }
        if element.is_empty() {
            continue;
        }
        let (pairs, _) = split_outside_quotes(element, b';');
        let strict = pairs.iter().all(|pair| match pair.split_once('=') {
            Some((name, value)) => {
                let plain = |s: &str| !s.is_empty() && !s.bytes().any(|b| b" \t=;,\"".contains(&b));
                let quoted = value.len() >= 2 && value.starts_with('"') && value.ends_with('"');
                plain(name) && (quoted || plain(value))
            }
            None => false,
        });
        let fors: Vec<&str> = pairs
            .iter()
            .filter_map(|pair| {
                let (name, value) = pair.split_once('=')?;
                name.trim().eq_ignore_ascii_case("for").then_some(value.trim())
            })
            .collect();
        hops.push(match (strict, fors.as_slice()) {
            (true, [value]) => read_hop(unquote(value)),
            (true, _) => Hop::Garbage,
            (false, [value, ..]) => match read_hop(unquote(value).trim()) {
                Hop::Addr(ip) | Hop::Lenient(ip) => Hop::Lenient(ip),
                Hop::Garbage => Hop::Garbage,
            },
            (false, []) => Hop::Garbage,
        });
    }
    hops
}

/// The client address from a trusted peer's forwarding header: never an untrusted hop's
/// left neighbour, never anything from the other header.
pub fn client_ip(data: &[u8]) {
    let mut lines = data.split(|&b| b == b'\n');
    let Some((&choice, nets_text)) = lines.next().and_then(<[u8]>::split_first) else {
        return;
    };
    let header = header_choice(choice);
    let mut trusted = Vec::new();
    let mut nets = Vec::new();
    for token in String::from_utf8_lossy(nets_text).split_whitespace() {
        let parsed = IpNet::from_str(token);
        let reference = Net::parse(token);
        assert_eq!(
            parsed.is_ok(),
            reference.is_some(),
            "IpNet::from_str({token:?}) = {parsed:?}, expected {reference:?}"
        );
        if let (Ok(net), Some(r)) = (parsed, reference) {
            trusted.push(net);
            nets.push(r);
        }
    }
    let Some(Ok(peer)) = lines
        .next()
        .map(|l| String::from_utf8_lossy(l).trim().parse::<IpAddr>())
    else {
        return;
    };
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some((&which, value)) = line.split_first() else {
            continue;
        };
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(header_choice(which), value);
        }
    }
    let is_trusted = |ip: IpAddr| nets.iter().any(|n| n.contains(ip));
    for ip in [peer]
        .into_iter()
        .chain(reference_hops(&headers, header).into_iter().filter_map(|h| match h {
            Hop::Addr(ip) | Hop::Lenient(ip) => Some(ip),
            Hop::Garbage => None,
        }))
    {
        let net_says = trusted.iter().any(|n| n.contains(ip));
        assert_eq!(net_says, is_trusted(ip), "IpNet::contains disagrees on {ip}: {nets:?}");
    }

    let resolver = ClientIpResolver::new(trusted, HeaderName::from_static(header));
    let got = resolver
        .resolve_from(Some(peer), &headers)
        .unwrap_or_else(|| panic!("no client address for the peer {peer}"));
    assert_eq!(got, canonical(got), "the client address {got} is not canonical");
    let peer_c = canonical(peer);
    if !is_trusted(peer) {
        assert_eq!(got, peer_c, "a header was believed from the untrusted peer {peer}");
        return;
    }

    let hops = reference_hops(&headers, header);
    // Safety: the result is the peer, or a hop every hop right of which is a trusted address.
    if got != peer_c {
        let safe = (0..hops.len()).any(|i| {
            let addr = match hops[i] {
                Hop::Addr(ip) | Hop::Lenient(ip) => ip,
                Hop::Garbage => return false,
            };
            canonical(addr) == got
                && hops[i + 1..].iter().all(|h| match h {
                    Hop::Addr(ip) | Hop::Lenient(ip) => is_trusted(*ip),
                    Hop::Garbage => false,
                })
        });
        assert!(
            safe,
            "{got} is not the peer {peer} nor a hop of `{header}` with only trusted hops to its right: {hops:?}"
        );
    }
    // Exactness, when every hop reads one way: the nearest untrusted hop, right to left;
    // an unreadable hop ends the chain.
    if hops.iter().all(|h| !matches!(h, Hop::Lenient(_))) {
        let mut expected = peer_c;
        for hop in hops.iter().rev() {
            match hop {
                Hop::Addr(ip) => {
                    expected = canonical(*ip);
                    if !is_trusted(*ip) {
                        break;
                    }
                }
                _ => break,
            }
        }
        assert_eq!(got, expected, "peer {peer}, `{header}` hops {hops:?}");
    }
}
