//! Rules, `include` and `exclude` naming one value of a parameter route, against a real
//! axum `Router`: `/wiki/{page}`, `/u/{id}`, `/files/{*rest}`, a static `/static/Café/x` and
//! a fallback. Values are built from pieces (`:`, `@`, `é`, U+0085, `%`, `?`, `#`, `/`, `.`,
//! `..`, …), rules and targets spelled at random (raw, escaped in either case, partly).
//! An independent oracle decodes what the handler was given and the rule as written: a
//! handler given a value its rule names (for a wildcard or the fallback, the decoded
//! segments as they are, or with dot segments resolved at the wildcard's root) must have
//! been counted; an exclusion leaves alone only the handler its text routes to.
//! `FLUXGATE_PARAMS_SEED=<n> FLUXGATE_PARAMS_CASES=<n>` searches further. This test found
//! a wildcard's `..` walking out of its rule (`/files/../private/x`, which a handler that
//! cleans `rest` against its own root serves as `private/x`), a rule's `%2F` that did not
//! count the same value written with `/`, and an exclusion's trailing `/` ignored.

use crate::support::rng::Rng;
use axum::{body::Body, extract::Path, routing::get, Router};
use fluxgate::{
    core::{Decision, RateLimitMetricsRecorder},
    tower::RateLimitLayer,
};
use http::{Request, Uri};
use std::sync::{Arc, Mutex};
use tower::ServiceExt;
/// The handler that ran last, and what it was given.
type Ran = Arc<Mutex<Option<(&'static str, String)>>>;

/// Records what a handler was given.
fn ran_with(ran: &Ran, handler: &'static str, value: String) {
    *ran.lock().expect("ran") = Some((handler, value));
}

/// The rules that counted each decision.
#[derive(Debug, Default)]
struct Counted(Mutex<Vec<String>>);
impl RateLimitMetricsRecorder for Counted {
    fn record_decision(&self, d: &Decision) {
        self.0
            .lock()
            .expect("counted")
            .extend(d.bands.iter().map(|b| b.rule.to_string()));
    }
}
fn app(ran: &Ran, layer: Option<RateLimitLayer>) -> Router {
    let rec = |name: &'static str| {
        let ran = ran.clone();
        move |Path(v): Path<String>| {
            ran_with(&ran, name, v);
            std::future::ready(())
        }
    };
    let (r1, r2) = (ran.clone(), ran.clone());
    let router = Router::new()
        .route("/wiki/{page}", get(rec("wiki")))
        .route("/u/{id}", get(rec("u")))
        .route("/files/{*rest}", get(rec("files")))
        .route(
            "/static/Café/x",
            get(move || {
                ran_with(&r1, "static", String::new());
                std::future::ready(())
            }),
        )
        .fallback(move |uri: Uri| {
            ran_with(&r2, "fallback", uri.path().to_owned());
            std::future::ready(())
        });
    layer.map_or(router.clone(), |l| router.layer(l))
}
/// The app in a limiter of `rules` (id, pattern; none: every path), `include` and `exclude`.
fn limited(ran: &Ran, rules: &[(String, String)], include: &[&str], exclude: &[&str]) -> (Router, Arc<Counted>) {
    let mut yaml = String::from("rule_sets:\n  - id: default\n    rules:\n");
    for (id, p) in rules {
        let paths = if p.is_empty() {
            String::new()
        } else {
            format!("match: {{ paths: [\"{p}\"] }}, ")
        };
        yaml +=
            &format!("      - {{ id: {id}, scope: global, {paths}bands: [{{ capacity: 1000000000, window: 1h }}] }}\n");
    }
    let counted = Arc::new(Counted::default());
    let engine = super::builder(&yaml).recorder(counted.clone()).build().expect("engine");
    let b = RateLimitLayer::builder(engine)
        .include(include.iter().copied())
        .exclude(exclude.iter().copied());
    (app(ran, Some(b.build().expect("layer"))), counted)
}
/// Sends `target`: the handler that ran and what it was given, and the rules that counted.
async fn send(
    app: &Router,
    ran: &Ran,
    counted: &Counted,
    target: &str,
) -> Option<((&'static str, String), Vec<String>)> {
    let req = Request::builder()
        .uri(target.parse::<Uri>().ok()?)
        .body(Body::empty())
        .ok()?;
    *ran.lock().expect("ran") = None;
    counted.0.lock().expect("counted").clear();
    let _ = app.clone().oneshot(req).await;
    let handled = ran.lock().expect("ran").take()?;
    Some((handled, std::mem::take(&mut *counted.0.lock().expect("counted"))))
}

// The oracle: percent-decoding and Ant matching of its own.
fn hexv(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Every `%XX` decoded (a stray `%` kept), as axum decodes a parameter; `None` if not UTF-8.
fn decode(s: &str) -> Option<String> {
    let (b, mut out, mut i) = (s.as_bytes(), Vec::new(), 0);
    while i < b.len() {
        match (
            b[i],
            b.get(i + 1).and_then(|&h| hexv(h)),
            b.get(i + 2).and_then(|&l| hexv(l)),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push(h << 4 | l);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}
#[derive(Clone, Copy, PartialEq)]
enum Tok {
    Ch(char),
    One,
    Star,
}
enum Seg {
    Any,
    Toks(Vec<Tok>),
}
/// A pattern as written, decoded: `*`/`?` wildcards, escapes literal characters. `flat`
/// splits segments at a decoded `/` too (a wildcard parameter reads `%2F` as `/`).
fn parse(p: &str, flat: bool) -> Vec<Seg> {
    let mut segs = vec![];
    for w in p.split('/').filter(|w| !w.is_empty()) {
        if w == "**" {
            segs.push(Seg::Any);
            continue;
        }
        let mut toks = vec![Vec::new()];
        for part in w.split_inclusive(['*', '?']) {
            let wild = part.chars().last().filter(|c| matches!(c, '*' | '?'));
            let lit = &part[..part.len() - wild.map_or(0, |_| 1)];
            for c in decode(lit).expect("UTF-8 patterns").chars() {
                match toks.last_mut() {
                    Some(_) if flat && c == '/' => toks.push(Vec::new()),
                    Some(last) => last.push(Tok::Ch(c)),
                    None => unreachable!("one list at least"),
                }
            }
            if let (Some(c), Some(last)) = (wild, toks.last_mut()) {
                last.push(if c == '*' { Tok::Star } else { Tok::One });
            }
        }
        segs.extend(toks.into_iter().filter(|t| !t.is_empty()).map(Seg::Toks));
    }
    segs
}
fn glob(t: &[Tok], s: &[char]) -> bool {
    match t.split_first() {
        None => s.is_empty(),
        Some((Tok::Star, r)) => (0..=s.len()).any(|i| glob(r, &s[i..])),
        Some((&one_or_char, r)) => {
            s.first()
                .is_some_and(|c| one_or_char == Tok::One || one_or_char == Tok::Ch(*c))
                && glob(r, &s[1..])
        }
    }
}
/// Ant matching of decoded segments: `**` any number, `*` and `?` within a segment.
fn ant(p: &[Seg], v: &[String]) -> bool {
    match p.split_first() {
        None => v.is_empty(),
        Some((Seg::Any, r)) => (0..=v.len()).any(|i| ant(r, &v[i..])),
        Some((Seg::Toks(t), r)) => !v.is_empty() && glob(t, &v[0].chars().collect::<Vec<_>>()) && ant(r, &v[1..]),
    }
}
/// Dot segments resolved, never above the root of `v`.
fn resolved(v: &[String]) -> Vec<String> {
    let mut out: Vec<String> = vec![];
    v.iter().for_each(|s| match s.as_str() {
        "" | "." => {}
        ".." => drop(out.pop()),
        _ => out.push(s.clone()),
    });
    out
}
/// Whether the pattern names what the handler was given.
fn names(pattern: &str, (handler, value): &(&'static str, String)) -> bool {
    let split = |s: &str| -> Vec<String> { s.split('/').map(str::to_owned).collect() };
    // A wildcard parameter reads a rule's `%2F` as a `/`.
    let flat = parse(pattern, true);
    let plain = parse(pattern, false);
    let with = |v: Vec<String>, p: &[Seg]| ant(p, &v) || ant(p, &resolved(&v));
    match *handler {
        "wiki" | "u" => ant(&plain, &[handler.to_string(), value.clone()]),
        "static" => ant(&plain, &split("static/Café/x")),
        // As given, or with dot segments resolved at the wildcard's root, as a handler that
        // cleans `rest` against its own root reads it.
        "files" => [split(value), resolved(&split(value))]
            .iter()
            .any(|v| ant(&flat, &[vec!["files".to_owned()], v.clone()].concat())),
        _ => {
            let raw = value.strip_prefix('/').unwrap_or(value);
            let segs: Option<Vec<String>> = raw.split('/').map(decode).collect();
            segs.is_some_and(|s| with(s, &plain)) || decode(raw).is_some_and(|d| with(split(&d), &flat))
        }
    }
}

const PIECES: &[&str] = &[
    "a", "B", "Help", "Caf", "private", ":", "@", "+", ";", "=", "~", ".", "..", " ", "é", "\u{85}", "%", "?", "#",
    "/", "2F", "41",
];
fn esc(rng: &mut Rng, c: char) -> String {
    c.to_string()
        .bytes()
        .map(|x| {
            if rng.percent(50) {
                format!("%{x:02X}")
            } else {
                format!("%{x:02x}")
            }
        })
        .collect()
}
/// A spelling of `value`; `slash_raw`: a `/` may stay one (a wildcard, a rule's segments).
fn spell(rng: &mut Rng, value: &str, rule: bool, slash_raw: bool) -> String {
    let mut parts: Vec<String> = value
        .chars()
        .map(|c| match c {
            '/' if slash_raw && rng.percent(75) => "/".into(),
            '/' | '?' | '#' | ' ' => esc(rng, c),
            '\u{85}' if rule => esc(rng, c),
            c if rng.percent(if c == '%' { 70 } else { 40 }) => esc(rng, c),
            c => c.to_string(),
        })
        .collect();
    // A raw `%` must not start an escape.
    for i in 0..parts.len() {
        let hex = parts[i + 1..]
            .concat()
            .bytes()
            .take(2)
            .filter(u8::is_ascii_hexdigit)
            .count()
            == 2;
        if parts[i] == "%" && hex {
            parts[i] = "%25".into()
        }
    }
    parts.concat()
}
fn value(rng: &mut Rng, slashes: bool) -> String {
    let mut v = String::new();
    while v.is_empty() || (v.len() < 12 && rng.percent(60)) {
        v += Some(rng.pick(PIECES)).filter(|p| *p != "/" || slashes).unwrap_or("");
    }
    v
}
/// A rule for `prefix` + `value`: each segment spelled, perhaps a `?` or `*` in it, perhaps `/**`.
fn rule(rng: &mut Rng, prefix: &str, value: &str, wildcard: bool) -> Option<String> {
    // Under a wildcard, a rule's `/` is a segment's end, or now and then spelled `%2F`.
    let joined = value
        .split('/')
        .filter(|s| !matches!(*s, "" | "." | ".."))
        .collect::<Vec<_>>()
        .join("/");
    let segs: Vec<&str> = match wildcard {
        true if rng.percent(80) || joined.is_empty() => value.split('/').filter(|s| !s.is_empty()).collect(),
        _ if wildcard => vec![&joined],
        _ => vec![value],
    };
    let mut out = prefix.to_owned();
    for s in segs {
        let chars: Vec<char> = s.chars().collect();
        let (i, j, k) = (rng.below(chars.len() + 1), rng.below(chars.len() + 1), rng.below(6));
        let mut sp = |a: &[char]| spell(rng, &a.iter().collect::<String>(), true, false);
        let mut w = match k {
            0 if i < chars.len() => sp(&chars[..i]) + "?" + &sp(&chars[i + 1..]),
            1 => sp(&chars[..i.min(j)]) + "*" + &sp(&chars[i.max(j)..]),
            _ => sp(&chars),
        };
        if matches!(decode(&w).as_deref(), Some("." | "..")) {
            w = "*".into()
        }
        out += &format!("/{w}");
    }
    if rng.percent(15) {
        out += "/**"
    }
    out.parse::<fluxgate::core::PathPattern>().ok().map(|_| out)
}
/// Targets for `prefix` + `value`: spellings, detours through `..`, a query, the absolute form.
fn targets(rng: &mut Rng, prefix: &str, value: &str, wildcard: bool) -> Vec<String> {
    (0..6)
        .map(|_| {
            let mut v = spell(rng, value, false, wildcard);
            if wildcard && rng.percent(40) {
                let dd = rng.pick(&["..", "%2e%2e", ".%2E", "."]);
                let sl = if rng.percent(50) { "/" } else { "%2F" };
                v = match rng.below(4) {
                    0 => format!("{dd}{sl}{v}"),
                    1 => format!("x{sl}{dd}{sl}{v}"),
                    2 => format!("{sl}{v}"),
                    _ => format!("{v}{sl}"),
                };
            }
            let t = format!("{prefix}/{v}");
            match rng.below(10) {
                0 => format!("{t}?q=1"),
                1 => format!("http://h{t}"),
                _ => t,
            }
        })
        .collect()
}
const KINDS: &[(&str, bool)] = &[
    ("/wiki", false),
    ("/u", false),
    ("/files", true),
    ("/nowhere", true),
    ("/static", true),
];
fn case(rng: &mut Rng) -> (String, Vec<String>) {
    let (prefix, wild) = rng.pick(KINDS);
    let v = if prefix == "/static" {
        "Café/x".to_owned()
    } else {
        value(rng, wild)
    };
    let rule = std::iter::repeat(())
        .find_map(|()| rule(rng, prefix, &v, wild))
        .expect("a rule");
    (rule, targets(rng, prefix, &v, wild))
}

#[tokio::test]
async fn a_rule_naming_a_parameter_value_counts_every_spelling() {
    let var = |n: &str| std::env::var(n).ok().and_then(|v| v.parse::<u64>().ok());
    let (seed, cases) = (
        var("FLUXGATE_PARAMS_SEED").unwrap_or(0x9A4A_5EED),
        var("FLUXGATE_PARAMS_CASES").unwrap_or(3000),
    );
    let (mut rng, ran): (_, Ran) = (Rng(seed | 1), Arc::default());
    let probe = app(&ran, None);
    let (mut found, mut sent, mut named, mut per) = (
        Vec::<String>::new(),
        0,
        0,
        std::collections::BTreeMap::<String, usize>::new(),
    );
    for _ in 0..cases / 20 {
        let batch: Vec<(String, Vec<String>)> = (0..20).map(|_| case(&mut rng)).collect();
        let rules: Vec<(String, String)> = batch
            .iter()
            .enumerate()
            .map(|(i, (r, _))| (format!("r{i}"), r.clone()))
            .collect();
        let (routed, counted) = limited(&ran, &rules, &[], &[]);
        for (r, ts) in &batch {
            let all = [("all".to_owned(), String::new())];
            let (inc, c_inc) = limited(&ran, &all, &[r.as_str()], &[]);
            // An exclusion: the value as written, no wildcard; the handler it routes to.
            let ex = ts[0]
                .strip_prefix("http://h")
                .unwrap_or(&ts[0])
                .split('?')
                .next()
                .unwrap_or_default()
                .to_owned();
            let named_by_ex = send(&probe, &ran, &Counted::default(), &ex).await.map(|(hv, _)| hv.0);
            let exl = ex
                .parse::<fluxgate::core::PathPattern>()
                .is_ok()
                .then(|| limited(&ran, &all, &[], &[ex.as_str()]));
            for t in ts {
                let Some((hv, c)) = send(&routed, &ran, &counted, t).await else {
                    continue;
                };
                sent += 1;
                for (id, p) in rules.iter().filter(|(_, p)| names(p, &hv)) {
                    named += 1;
                    *per.entry(format!("rule/{}", hv.0)).or_default() += 1;
                    if !c.contains(id) {
                        found.push(format!("rule {p:?}: {t:?} ran {hv:?} uncounted"))
                    }
                }
                if let Some((hv, c)) = send(&inc, &ran, &c_inc, t).await {
                    *per.entry(format!("include/{}", hv.0)).or_default() += usize::from(names(r, &hv));
                    if names(r, &hv) && c.is_empty() {
                        found.push(format!("include {r:?}: {t:?} ran {hv:?} unlimited"))
                    }
                }
                let Some((exl, c_ex)) = &exl else { continue };
                let left_alone = send(exl, &ran, c_ex, t)
                    .await
                    .filter(|(hv, c)| c.is_empty() && named_by_ex != Some(hv.0));
                if let Some((hv, _)) = left_alone {
                    found.push(format!(
                        "exclude {ex:?} (routes to {named_by_ex:?}): {t:?} ran {hv:?} unlimited"
                    ))
                }
            }
        }
    }
    eprintln!("seed {seed}: sent {sent}, named {named}: {per:?}");
    found.sort();
    found.dedup();
    let show = var("FLUXGATE_PARAMS_SHOW").unwrap_or(40) as usize;
    assert!(
        found.is_empty(),
        "seed {seed}: {} escapes:\n{}",
        found.len(),
        found[..found.len().min(show)].join("\n")
    );
    assert!(sent > cases * 4 && named > cases * 2, "sent {sent}, named {named}");
}
