//! The client address resolver against a reference written from its contract
//! (`docs/security.md`, section 2) and RFC 7239, over seeded random and adversarial
//! forwarding headers.
//!
//! Two properties:
//! - **agreement**: on any input, the resolver's address is the reference's, reading hops
//!   strictly (the documented forms) or leniently (junk after `]`, a zone);
//! - **no choice**: behind trusted proxies that write the real client address (with
//!   whatever else they write, such as an RFC 7239 `host=` copied from the request), what
//!   the client controls (its own header lines and elements, its `Host`) never changes
//!   the resolved address.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use fluxgate_tower::{ClientIpResolver, IpNet};
use http::{HeaderMap, HeaderName, HeaderValue};

// ---------------------------------------------------------------------------------------
// A small seeded generator (splitmix64): no dependency, the same inputs on every run.
// ---------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

// ---------------------------------------------------------------------------------------
// The reference.
// ---------------------------------------------------------------------------------------

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// A trusted network: an address and a prefix length, IPv4-mapped IPv6 read as IPv4.
#[derive(Debug, Clone, Copy)]
struct Net {
    addr: IpAddr,
    prefix: u32,
}

impl Net {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix).unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix).unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// One hop of the header, right to left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hop {
    Addr(IpAddr),
    /// Cannot be read: ends the walk.
    Unreadable,
    /// An empty `Forwarded` element: no hop at all.
    Skip,
}

/// A node in a documented form: `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]`,
/// `[2001:db8::1]:80`. `lenient` also takes junk after `]` and a zone inside brackets.
fn node(text: &str, lenient: bool) -> Option<IpAddr> {
    let port_ok = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok();
    if let Ok(ip) = text.parse::<Ipv4Addr>() {
        return Some(IpAddr::V4(ip));
    }
    if let Ok(ip) = text.parse::<Ipv6Addr>() {
        return Some(IpAddr::V6(ip));
    }
    if let Some((a, p)) = text.rsplit_once(':') {
        if let (Ok(ip), true) = (a.parse::<Ipv4Addr>(), port_ok(p)) {
            return Some(IpAddr::V4(ip));
        }
    }
    if let Some(rest) = text.strip_prefix('[') {
        if let Some((inner, after)) = rest.split_once(']') {
            let ok_after = after.is_empty() || after.strip_prefix(':').is_some_and(port_ok);
            let inner_ok = inner.parse::<Ipv6Addr>().ok();
            if ok_after {
                if let Some(ip) = inner_ok {
                    return Some(IpAddr::V6(ip));
                }
                // A numeric zone: Rust's socket address parser takes it.
                if let Some((a, z)) = inner.split_once('%') {
                    if !after.is_empty() && z.parse::<u32>().is_ok() {
                        if let Ok(ip) = a.parse::<Ipv6Addr>() {
                            return Some(IpAddr::V6(ip));
                        }
                    }
                }
            }
            if lenient {
                if let Ok(ip) = inner.parse::<IpAddr>() {
                    return Some(ip);
                }
            }
        }
    }
    if lenient {
        // An opening bracket, whatever follows the address (or no closing one).
        let inner = text.strip_prefix('[')?.split(']').next()?;
        return inner.parse().ok();
    }
    None
}

fn ows(s: &str) -> &str {
    s.trim_matches(|c| c == ' ' || c == '\t')
}

/// RFC 7239 elements of one header line, each as its `(name, value)` pairs and whether it
/// held an empty pair (a `;` with nothing before it), with quoted-strings read as such
/// (commas and semicolons inside them are text, `\` escapes). `None` for an element that
/// is not well formed (and the rest of the line after an unterminated quoted-string, which
/// runs to its end).
#[allow(clippy::type_complexity)]
fn rfc7239_elements(line: &[u8]) -> Vec<Option<(Vec<(String, String)>, bool)>> {
    let mut elements = Vec::new();
    let mut pairs: Vec<(String, String)> = Vec::new();
    let mut empty_pair = false;
    let mut ok = true;
    let mut cur = Vec::<u8>::new();
    let mut quoted_value: Option<Vec<u8>> = None;
    let mut i = 0;
    let finish_pair =
        |cur: &mut Vec<u8>, quoted: &mut Option<Vec<u8>>, pairs: &mut Vec<(String, String)>, ok: &mut bool| {
            // Bytes that are not UTF-8 (in `host=`) leave the rest of the element readable.
            let text = String::from_utf8_lossy(cur).into_owned();
            let text = ows(&text);
            if let Some(q) = quoted.take() {
                // `name="value"`: `cur` holds `name=`.
                match text.strip_suffix('=') {
                    Some(name) if !name.is_empty() && !name.contains(|c: char| c.is_whitespace()) => {
                        pairs.push((name.to_ascii_lowercase(), String::from_utf8_lossy(&q).into_owned()));
                    }
                    _ => *ok = false,
                }
            } else if !text.is_empty() {
                match text.split_once('=') {
                    Some((name, value))
                        if !name.is_empty() && !value.is_empty() && !value.contains(['"', ' ', '\t', '=']) =>
                    {
                        pairs.push((name.to_ascii_lowercase(), value.to_owned()));
                    }
                    _ => *ok = false,
                }
            }
            cur.clear();
        };
    while i < line.len() {
        let b = line[i];
        match b {
            b'"' if quoted_value.is_none() && ows(&String::from_utf8_lossy(&cur)).ends_with('=') => {
                // A quoted-string value.
                let mut q = Vec::new();
                i += 1;
                let mut closed = false;
                while i < line.len() {
                    match line[i] {
                        b'\\' if i + 1 < line.len() => {
                            q.push(line[i + 1]);
                            i += 2;
                        }
                        b'"' => {
                            closed = true;
                            i += 1;
                            break;
                        }
                        c => {
                            q.push(c);
                            i += 1;
                        }
                    }
                }
                if !closed {
                    ok = false;
                }
                quoted_value = Some(q);
                // Only OWS may follow before `;` or `,`.
                while i < line.len() && (line[i] == b' ' || line[i] == b'\t') {
                    i += 1;
                }
                if i < line.len() && line[i] != b';' && line[i] != b',' {
                    ok = false;
                }
                continue;
            }
            b';' => {
                empty_pair |= quoted_value.is_none() && ows(&String::from_utf8_lossy(&cur)).is_empty();
                finish_pair(&mut cur, &mut quoted_value, &mut pairs, &mut ok);
            }
            b',' => {
                finish_pair(&mut cur, &mut quoted_value, &mut pairs, &mut ok);
                elements.push(ok.then(|| (std::mem::take(&mut pairs), empty_pair)));
                pairs.clear();
                (ok, empty_pair) = (true, false);
            }
            c => cur.push(c),
        }
        i += 1;
    }
    finish_pair(&mut cur, &mut quoted_value, &mut pairs, &mut ok);
    elements.push(ok.then_some((pairs, empty_pair)));
    elements
}

/// The hops of the configured header, left to right.
fn hops(lines: &[Vec<u8>], rfc7239: bool, lenient: bool) -> Vec<Hop> {
    let mut out = Vec::new();
    for line in lines {
        if rfc7239 {
            for element in rfc7239_elements(line) {
                out.push(match element {
                    None => Hop::Unreadable,
                    // Nothing between its commas: no hop. Empty pairs alone (`;`): an
                    // element without `for=`.
                    Some((pairs, empty_pair)) if pairs.is_empty() => {
                        if empty_pair {
                            Hop::Unreadable
                        } else {
                            Hop::Skip
                        }
                    }
                    Some((pairs, _)) => {
                        // Parameter names are unique in an element: a repeated `for` is
                        // not well formed.
                        let fors: Vec<_> = pairs.iter().filter(|(k, _)| k == "for").collect();
                        match fors.as_slice() {
                            [(_, v)] => node(v, lenient).map_or(Hop::Unreadable, Hop::Addr),
                            _ => Hop::Unreadable,
                        }
                    }
                });
            }
        } else {
            for element in line.split(|&b| b == b',') {
                // Leniently, bytes that are not UTF-8 read as replacement characters.
                let text = if lenient {
                    Some(String::from_utf8_lossy(element).into_owned())
                } else {
                    std::str::from_utf8(element).ok().map(str::to_owned)
                };
                out.push(
                    text.and_then(|e| node(ows(&e), lenient))
                        .map_or(Hop::Unreadable, Hop::Addr),
                );
            }
        }
    }
    out
}

fn reference(trusted: &[Net], rfc7239: bool, peer: IpAddr, lines: &[Vec<u8>], lenient: bool) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|n| n.contains(ip));
    let mut client = canonical(peer);
    if !is_trusted(peer) {
        return client;
    }
    for hop in hops(lines, rfc7239, lenient).into_iter().rev() {
        match hop {
            Hop::Skip => continue,
            Hop::Unreadable => break,
            Hop::Addr(ip) => {
                client = canonical(ip);
                if !is_trusted(ip) {
                    break;
                }
            }
        }
    }
    client
}

// ---------------------------------------------------------------------------------------
// Inputs.
// ---------------------------------------------------------------------------------------

fn trusted_sets(rng: &mut Rng) -> Vec<String> {
    let pool = [
        "10.0.0.0/8",
        "10.0.0.1",
        "192.168.0.0/16",
        "172.16.0.0/12",
        "::1",
        "fd00::/8",
        "2001:db8:ffff::/48",
        "::ffff:10.0.0.1",
        "127.0.0.1/32",
        "100.64.0.0/10",
        "fe80::/10",
        "2001:db8:ffff::1",
    ];
    let n = 1 + rng.below(3);
    (0..n).map(|_| (rng.pick(&pool)).to_owned()).collect()
}

fn net_of(s: &str) -> Net {
    let (a, p) = s.split_once('/').map_or((s, None), |(a, p)| (a, Some(p)));
    let addr = canonical(a.parse().unwrap());
    let max = if addr.is_ipv4() { 32 } else { 128 };
    Net {
        addr,
        prefix: p.map_or(max, |p| p.parse().unwrap()),
    }
}

fn trusted_addr(rng: &mut Rng) -> String {
    rng.pick(&[
        "10.0.0.1",
        "10.1.2.3",
        "10.255.255.255",
        "192.168.1.1",
        "172.16.5.4",
        "::1",
        "fd00::7",
        "2001:db8:ffff::1",
        "::ffff:10.0.0.1",
        "127.0.0.1",
        "100.64.0.1",
        "fe80::1",
    ])
    .to_string()
}

fn untrusted_addr(rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => format!("198.51.100.{}", rng.below(256)),
        1 => format!("203.0.{}.{}", rng.below(256), rng.below(256)),
        2 => format!("2001:db8:{:x}::{:x}", rng.below(0xffff), rng.below(0xffff)),
        3 => format!("::ffff:198.51.100.{}", rng.below(256)),
        4 => format!("2001:DB8:{:X}::{:X}", rng.below(0xffff), rng.below(0xffff)),
        _ => format!("192.0.2.{}", rng.below(256)),
    }
}

/// An address as a proxy may write it in the header: bare, with a port, bracketed.
fn written(rng: &mut Rng, addr: &str, rfc7239: bool) -> String {
    let v6 = addr.contains(':');
    let port = rng.below(65536);
    let form = match (v6, rng.below(3)) {
        (false, 0) | (true, 0) => addr.to_owned(),
        (false, _) => format!("{addr}:{port}"),
        (true, 1) => format!("[{addr}]"),
        (true, _) => format!("[{addr}]:{port}"),
    };
    if rfc7239 && (form.contains(':') || rng.chance(3)) {
        format!("\"{form}\"")
    } else {
        form
    }
}

/// Something a client may write.
fn junk(rng: &mut Rng) -> String {
    let atoms = [
        "1.2.3.4",
        "1.2.3.4:80",
        "[::1]:80",
        "[::1]",
        "::1",
        "10.0.0.1",
        "010.1.1.1",
        "fe80::1%eth0",
        "[fe80::1%eth0]:80",
        "[fe80::1%25]:80",
        "::ffff:1.2.3.4",
        "2001:DB8::1",
        "unknown",
        "_hidden",
        "\"",
        "\"[2001:db8::1]:4711\"",
        "for=",
        "for=6.6.6.6",
        "for=\"6.6.6.7\"",
        "FOR=6.6.6.8",
        "for=_hidden",
        "for=unknown",
        "proto=https",
        "by=10.0.0.1",
        "host=\"a,for=6.6.6.9\"",
        "host=\"a;for=6.6.6.10\"",
        "\\\"",
        ";",
        ",",
        ", ",
        " ",
        "\t",
        "",
        "=",
        "[",
        "]",
        "6.6.6.11",
        "10.0.0.5",
    ];
    let n = rng.below(6);
    let mut s = String::new();
    for _ in 0..n {
        s.push_str(rng.pick(&atoms));
        if rng.chance(3) {
            s.push_str(rng.pick(&[",", ", ", " ,\t", ";", "="]));
        }
    }
    s
}

fn header_value(bytes: &[u8]) -> Option<HeaderValue> {
    HeaderValue::from_bytes(bytes).ok()
}

fn resolve(trusted: &[String], rfc7239: bool, peer: IpAddr, lines: &[Vec<u8>]) -> IpAddr {
    let resolver = ClientIpResolver::new(
        trusted.iter().map(|s| s.parse::<IpNet>().unwrap()),
        HeaderName::from_static(if rfc7239 { "forwarded" } else { "x-forwarded-for" }),
    );
    let mut headers = HeaderMap::new();
    for line in lines {
        headers.append(
            if rfc7239 { "forwarded" } else { "x-forwarded-for" },
            header_value(line).unwrap(),
        );
        // The other header, which is never read.
        headers.append(
            if rfc7239 { "x-forwarded-for" } else { "forwarded" },
            HeaderValue::from_static("for=6.6.6.66, 6.6.6.66"),
        );
    }
    resolver.resolve_from(Some(peer), &headers).unwrap()
}

/// Agreement on random lines: every line a mix of client junk and addresses, some with
/// bytes that are not UTF-8.
#[test]
fn the_resolver_agrees_with_the_reference_on_random_headers() {
    let mut rng = Rng(0x5eed_0001);
    let mut checked = 0;
    for _ in 0..40_000 {
        let trusted = trusted_sets(&mut rng);
        let nets: Vec<Net> = trusted.iter().map(|s| net_of(s)).collect();
        let rfc7239 = rng.chance(2);
        let peer: IpAddr = if rng.chance(5) {
            untrusted_addr(&mut rng)
        } else {
            trusted_addr(&mut rng)
        }
        .parse()
        .unwrap();
        let mut lines = Vec::new();
        for _ in 0..1 + rng.below(3) {
            let mut line = String::new();
            for k in 0..rng.below(5) {
                if k > 0 {
                    line.push_str(rng.pick(&[",", ", ", " , ", ",\t", ",,"]));
                }
                let addr = if rng.chance(2) {
                    trusted_addr(&mut rng)
                } else {
                    untrusted_addr(&mut rng)
                };
                let part = match rng.below(4) {
                    0 => junk(&mut rng),
                    _ if rfc7239 => {
                        let mut el = format!("for={}", written(&mut rng, &addr, true));
                        if rng.chance(3) {
                            el = format!("proto=https;{el}");
                        }
                        if rng.chance(3) {
                            el.push_str(";by=\"[::1]:80\"");
                        }
                        el
                    }
                    _ => written(&mut rng, &addr, false),
                };
                line.push_str(&part);
            }
            let mut bytes = line.into_bytes();
            if rng.chance(20) {
                let at = rng.below(bytes.len() + 1);
                bytes.insert(at, 0xff);
            }
            if header_value(&bytes).is_some() {
                lines.push(bytes);
            }
        }
        let got = resolve(&trusted, rfc7239, peer, &lines);
        let strict = reference(&nets, rfc7239, peer, &lines, false);
        let lenient = reference(&nets, rfc7239, peer, &lines, true);
        assert!(
            got == strict || got == lenient,
            "trusted {trusted:?}, {}, peer {peer}, lines {:?}: resolved {got}, the reference {strict} (lenient {lenient})",
            if rfc7239 { "Forwarded" } else { "X-Forwarded-For" },
            lines.iter().map(|l| String::from_utf8_lossy(l)).collect::<Vec<_>>()
        );
        checked += 1;
    }
    assert!(checked > 30_000);
}

/// No choice: a client behind one to three trusted proxies, each of which appends the
/// address of its peer (to the last line or on a line of its own), with a port or not, and
/// for `Forwarded` with `proto=`, `by=` and the request's `Host` as a quoted `host=`
/// (HAProxy's `option forwarded`). Whatever the client writes, the address is its own.
#[test]
fn what_a_client_writes_never_chooses_its_address() {
    let mut rng = Rng(0x5eed_0002);
    for _ in 0..20_000 {
        let trusted = trusted_sets(&mut rng);
        let nets: Vec<Net> = trusted.iter().map(|s| net_of(s)).collect();
        let rfc7239 = rng.chance(2);
        let in_trusted = |s: &str| nets.iter().any(|n| n.contains(s.parse().unwrap()));
        let real = loop {
            let a = untrusted_addr(&mut rng);
            if !in_trusted(&a) {
                break a;
            }
        };
        let proxies: Vec<String> = (0..1 + rng.below(3))
            .map(|_| loop {
                let a = trusted_addr(&mut rng);
                if in_trusted(&a) {
                    break a;
                }
            })
            .collect();
        let with_host = rfc7239 && rng.chance(2);
        let host_first = rng.chance(2);
        let new_line = rng.chance(2);
        let expected = canonical(real.parse().unwrap());
        let mut seen = Vec::new();
        for _ in 0..4 {
            // The client's own lines, and its Host.
            let mut lines: Vec<String> = (0..rng.below(3)).map(|_| junk(&mut rng)).collect();
            let host: String = (0..rng.below(12))
                .map(|_| {
                    rng.pick(&[
                        'a', '.', ',', ';', '=', 'f', 'o', 'r', '6', '"', '\\', ' ', ':', '[', ']',
                    ])
                })
                .collect();
            let host = format!(
                "{host}{}",
                rng.pick(&["", ",for=6.6.6.6", ";for=6.6.6.6", ", for=\"[2001:db8::6]\""])
            );
            let mut from = real.clone();
            for proxy in &proxies {
                let hop = if rfc7239 {
                    let node = written(&mut rng, &from, true);
                    let quoted_host = host.replace('\\', "\\\\").replace('"', "\\\"");
                    match (with_host, host_first) {
                        (true, true) => format!("proto=http;host=\"{quoted_host}\";by=\"{proxy}\";for={node}"),
                        (true, false) => format!("for={node};host=\"{quoted_host}\";proto=https"),
                        _ => format!("for={node}"),
                    }
                } else {
                    written(&mut rng, &from, false)
                };
                match lines.last_mut() {
                    Some(last) if !new_line => {
                        last.push_str(", ");
                        last.push_str(&hop);
                    }
                    _ => lines.push(hop),
                }
                from.clone_from(proxy);
            }
            let peer: IpAddr = proxies.last().unwrap().parse().unwrap();
            let lines: Vec<Vec<u8>> = lines.into_iter().map(String::into_bytes).collect();
            let got = resolve(&trusted, rfc7239, peer, &lines);
            assert_eq!(
                got,
                expected,
                "trusted {trusted:?}, {}, peer {peer}, lines {:?}: the client {real} resolved as {got}",
                if rfc7239 { "Forwarded" } else { "X-Forwarded-For" },
                lines.iter().map(|l| String::from_utf8_lossy(l)).collect::<Vec<_>>()
            );
            seen.push(got);
        }
        assert!(seen.windows(2).all(|w| w[0] == w[1]));
    }
}

/// Long chains cost nothing and are read right to left.
#[test]
fn a_long_chain_is_read_from_the_right() {
    let trusted = vec!["10.0.0.0/8".to_owned()];
    let mut line = "6.6.6.6, ".repeat(50_000);
    line.push_str("198.51.100.1, 10.0.0.2");
    let got = resolve(&trusted, false, "10.0.0.1".parse().unwrap(), &[line.into_bytes()]);
    assert_eq!(got, "198.51.100.1".parse::<IpAddr>().unwrap());
}

/// Through a layered axum app: behind a proxy that copies the request's `Host` into a quoted
/// `host=` of `Forwarded`, a client sending a new `Host` with each request keeps one counter.
#[tokio::test]
async fn a_host_copied_into_forwarded_chooses_no_counter() {
    use axum::extract::ConnectInfo;
    use axum::routing::get;
    use std::net::SocketAddr;
    use tower::ServiceExt;

    let rules = fluxgate_core::RuleSets::from_yaml_str(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 1, window: 1h }]\n",
    )
    .unwrap();
    let layer = fluxgate_tower::RateLimitLayer::builder(fluxgate_core::Engine::in_memory(rules))
        .trusted_proxies(["10.0.0.0/8"])
        .forwarded_for_header("forwarded")
        .build()
        .unwrap();
    let app = axum::Router::new().route("/", get(|| async { "ok" })).layer(layer);
    for i in 0..3 {
        let forwarded = format!("proto=http;host=\"app,for=6.6.6.{i}\";by=\"10.0.0.1\";for=\"198.51.100.7:4711\"");
        let mut req = http::Request::builder()
            .uri("/")
            .header("forwarded", forwarded.as_str())
            .body(axum::body::Body::empty())
            .unwrap();
        req.extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([10, 0, 0, 1], 40000))));
        let status = app.clone().oneshot(req).await.unwrap().status();
        let expected = if i == 0 { 200 } else { 429 };
        assert_eq!(status.as_u16(), expected, "Forwarded: {forwarded}");
    }
}
