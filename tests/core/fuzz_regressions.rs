//! The fuzz targets' properties on every test run, without nightly or libFuzzer: the seed
//! corpora and every input a fuzzer found (`fuzz/seeds/<target>/`, `fuzz/regressions/<target>/`)
//! are replayed, and each property of `fuzz/checks.rs` is run on a few thousand
//! pseudo-random inputs from a fixed seed.

#[path = "../../fuzz/checks.rs"]
mod checks;

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Once;

use crate::support::rng::Rng;

/// A property check: panics when a property fails.
type Check = fn(&[u8]);

/// The four targets, by name.
const TARGETS: [(&str, Check); 4] = [
    ("rule_file", checks::rule_file),
    ("paths", checks::paths),
    ("keys", checks::keys),
    ("client_ip", checks::client_ip),
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files of `fuzz/<kind>/<target>/`, sorted.
fn files(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

thread_local! {
    /// Whether this thread's panics are caught and reported by `run_all`.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `check` on each input; the failures, described.
fn run_all(check: Check, inputs: impl IntoIterator<Item = (String, Vec<u8>)>) -> Vec<String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                default(info);
            }
        }));
    });
    let mut failures = Vec::new();
    for (name, data) in inputs {
        QUIET.with(|q| q.set(true));
        let result = catch_unwind(AssertUnwindSafe(|| check(&data)));
        QUIET.with(|q| q.set(false));
        if let Err(panic) = result {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            failures.push(format!(
                "{name}: {message}\n  input: {:?}",
                String::from_utf8_lossy(&data)
            ));
        }
    }
    failures
}

#[test]
fn seeds_and_found_inputs_replay() {
    let mut failures = Vec::new();
    for (target, check) in TARGETS {
        let seeds = files("seeds", target);
        assert!(!seeds.is_empty(), "no seeds for {target}");
        let inputs = seeds.into_iter().chain(files("regressions", target)).map(|path| {
            let data = std::fs::read(&path).expect("readable input");
            (path.display().to_string(), data)
        });
        failures.extend(run_all(check, inputs));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Pseudo-random inputs.
// ---------------------------------------------------------------------------------------

const ROUNDS: usize = 4000;

fn random_inputs(target: &str, seed: u64, make: impl Fn(&mut Rng) -> Vec<u8>) -> Vec<(String, Vec<u8>)> {
    let mut rng = Rng(seed);
    (0..ROUNDS)
        .map(|i| (format!("{target} random input {i} (seed {seed:#x})"), make(&mut rng)))
        .collect()
}

fn assert_random(target: &str, check: Check, seed: u64, make: impl Fn(&mut Rng) -> Vec<u8>) {
    let failures = run_all(check, random_inputs(target, seed, make));
    assert!(
        failures.is_empty(),
        "{} of {ROUNDS} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Fragments that make rule files interesting: wrong values, limits, YAML structure.
const RULE_FRAGMENTS: &[&str] = &[
    "capacity: 0",
    "capacity: 1099511627777",
    "capacity: 18446744073709551615",
    "capacity: -1",
    "window: 0ms",
    "window: 3661d",
    "window: 1x",
    "permits: 0",
    "permits: 1099511627777",
    "id: ''",
    "id: \"\"",
    "id: \"a b\"",
    "scope: composite",
    "scope: attribute",
    "fields: [ip, ip]",
    "fields: [user, tenant]",
    "attribute: tenant",
    "preset: fixed_window",
    "preset: leaky_bucket",
    "algorithm: sliding_window_log",
    "label: burst",
    "methods: [get, HEAD, \"\"]",
    "paths: [\"/a/**\", \"/**/b/*\"]",
    "paths: [\"/a**\"]",
    "mode: shadow",
    "enabled: false",
    "on_missing_key: deny",
    "\n---\n",
    "\n...\n",
    "&a ",
    "*a",
    "!!str ",
    "!tag ",
    "<<: *a",
    "? ",
    "{",
    "}",
    "[",
    "]",
    "\"",
    "'",
    ",",
    ":",
    "\n",
    "\t",
    "\u{feff}",
    "null",
    "~",
    "1e400",
    "\"capacity\": 0",
    "\"id\": \"\"",
    "capacity = 0",
    "id = \"\"",
    "[[rule_sets]]\n",
    "1979-05-27T07:32:00Z",
];

#[test]
fn rule_file_holds_on_random_inputs() {
    let seeds: Vec<Vec<u8>> = files("seeds", "rule_file")
        .iter()
        .map(|p| std::fs::read(p).expect("readable seed"))
        .collect();
    assert_random("rule_file", checks::rule_file, 0x5EED_0001, |rng| {
        let mut data = seeds[rng.below(seeds.len())].clone();
        for _ in 0..1 + rng.below(4) {
            let at = 1 + rng.below(data.len().max(2) - 1).min(data.len().saturating_sub(1));
            match rng.below(4) {
                0 => {
                    let fragment = rng.pick(RULE_FRAGMENTS).as_bytes();
                    data.splice(at..at, fragment.iter().copied());
                }
                1 => {
                    let end = (at + 1 + rng.below(16)).min(data.len());
                    data.drain(at.min(end)..end);
                }
                2 => {
                    if let Some(b) = data.get_mut(at) {
                        *b = rng.byte();
                    }
                }
                _ => {
                    // Replace a line's value after a `:` or `=` with a fragment.
                    let fragment = rng.pick(RULE_FRAGMENTS).as_bytes();
                    let end = data[at..]
                        .iter()
                        .position(|&b| b == b'\n')
                        .map_or(data.len(), |i| at + i);
                    data.splice(at..end, fragment.iter().copied());
                }
            }
        }
        if rng.chance(8) {
            data[0] = rng.byte();
        }
        data
    });
}

#[test]
fn paths_hold_on_random_inputs() {
    const PATTERN_SEGMENTS: &[&str] = &[
        "**", "*", "?", "a", "b", "a*", "*b", "?b", "a?c", "*.json", "%2e", "%41", "~", "", ".", "..", "***", "a**",
        "é", "%C3%A9", "%c3%a9*", ":", "%3A", "a%2Fb", "a%2fb", "%2A", "%C3", "%25", "%20", "%C2%85",
    ];
    const PATH_SEGMENTS: &[&str] = &[
        "a", "b", "ab", "abc", "a.json", "", ".", "..", "%2e", "%2E%2e", "%41", "%2f", "%%34%31", "%", "%4", "~",
        "%7e", "é", "*", "?", "%C3%A9", "%c3%a9", "%C3", "%A9", ":", "%3a", "a%2Fb", "%2A", "%00", "%C2%85", "%25",
        "%20", "%3F", "%23", "%FF", "\u{85}", "%c2%9f",
    ];
    assert_random("paths", checks::paths, 0x5EED_0002, |rng| {
        let mut data = Vec::new();
        for _ in 0..rng.below(5) {
            data.push(b'/');
            data.extend_from_slice(rng.pick(PATTERN_SEGMENTS).as_bytes());
        }
        if rng.chance(10) {
            data.pop();
        }
        data.push(b'\n');
        for _ in 0..rng.below(6) {
            data.push(b'/');
            data.extend_from_slice(rng.pick(PATH_SEGMENTS).as_bytes());
        }
        match rng.below(8) {
            0 => data.extend_from_slice(b"?q=/../x"),
            1 => data.push(b'/'),
            2 => data.extend_from_slice(b"#f"),
            _ => {}
        }
        data
    });
}

#[test]
fn keys_hold_on_random_inputs() {
    const PIECES: &[&str] = &[
        "a",
        "b",
        ":",
        "=",
        "~",
        "%",
        "%3A",
        "{",
        "}",
        " ",
        "\n",
        "\r",
        "\t",
        "\0",
        "é",
        "user=",
        "a.tenant=",
        "ip=",
        "_",
        "-",
        ".",
        "\u{feff}",
        "\u{a0}",
    ];
    assert_random("keys", checks::keys, 0x5EED_0003, |rng| {
        let mut data = vec![rng.byte(), rng.byte()];
        if data[0] % 5 == 4 {
            // Addresses: kind bytes and raw bytes, the second often near the first.
            for _ in 0..40 {
                data.push(rng.byte());
            }
            if rng.chance(2) {
                data[21] = 3;
            }
            return data;
        }
        let mut values: Vec<Vec<u8>> = Vec::new();
        for _ in 0..4 {
            let mut v = Vec::new();
            let long = rng.chance(6);
            for _ in 0..if long { 20 + rng.below(60) } else { rng.below(6) } {
                v.extend_from_slice(rng.pick(PIECES).as_bytes());
            }
            values.push(v);
        }
        // Near misses: a value equal to another, or one byte apart.
        if rng.chance(3) {
            values[2] = values[0].clone();
            if rng.chance(2) {
                values[2].push(b'a');
            }
        }
        if rng.chance(3) {
            values[1] = values[0].clone();
        }
        for (i, v) in values.into_iter().enumerate() {
            if i > 0 {
                data.push(0xFF);
            }
            data.extend(v);
        }
        data
    });
}

#[test]
fn client_ip_holds_on_random_inputs() {
    const NETS: &[&str] = &[
        "10.0.0.0/8",
        "10.0.0.1",
        "10.0.0.0/33",
        "::ffff:10.0.0.0/8",
        "::ffff:10.0.0.0/104",
        "2001:db8::/32",
        "2001:db8::1/128",
        "192.0.2.0/24",
        "0.0.0.0/0",
        "::/0",
        "garbage",
        "10.0.0.0/",
    ];
    const ADDRS: &[&str] = &[
        "10.0.0.1",
        "10.0.0.2",
        "::ffff:10.0.0.3",
        "203.0.113.5",
        "198.51.100.7",
        "2001:db8::7",
        "2001:db9::1",
        "192.0.2.9",
        "::1",
    ];
    assert_random("client_ip", checks::client_ip, 0x5EED_0004, |rng| {
        let mut text = String::new();
        text.push(rng.pick(&['x', 'f', 'y', 'g']));
        for _ in 0..rng.below(4) {
            text.push(' ');
            text.push_str(rng.pick(NETS));
        }
        text.push('\n');
        text.push_str(rng.pick(ADDRS));
        for _ in 0..rng.below(5) {
            text.push('\n');
            let forwarded = rng.chance(2);
            text.push(if forwarded { 'f' } else { 'x' });
            let mut hops = Vec::new();
            for _ in 0..rng.below(5) {
                let addr = rng.pick(ADDRS);
                let v6 = addr.contains(':');
                let hop = match rng.below(9) {
                    0 if v6 => format!("[{addr}]:443"),
                    0 => format!("{addr}:8080"),
                    1 if v6 => format!("[{addr}]"),
                    2 => "unknown".to_owned(),
                    3 => format!("{addr}x"),
                    4 => format!("\"{addr}\""),
                    5 if v6 => format!("[{addr}]junk"),
                    _ => addr.to_owned(),
                };
                hops.push(if forwarded {
                    match rng.below(4) {
                        0 => format!("proto=https;for={hop}"),
                        1 => "by=10.0.0.1".to_owned(),
                        2 => format!("For = \"{hop}\""),
                        _ => format!("for={hop}"),
                    }
                } else {
                    hop
                });
            }
            text.push_str(&hops.join(if rng.chance(2) { ", " } else { "," }));
        }
        text.into_bytes()
    });
}
