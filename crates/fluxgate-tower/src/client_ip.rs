//! The client address: the peer, or what trusted proxies say it is.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

use http::header::FORWARDED;
use http::{Extensions, HeaderMap, HeaderName};

/// The client address, as a request extension. An earlier layer may insert it to tell
/// the rate limiter who the peer is; it wins over `ConnectInfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientIp(pub IpAddr);

/// A network in CIDR notation (`10.0.0.0/8`, `2001:db8::/32`) or a single address (a /32
/// or a /128): an [`ipnet::IpNet`] read with two rules of its own. An IPv4-mapped IPv6
/// address (`::ffff:10.0.0.1`) is read as the IPv4 address, both when parsing and in
/// [`contains`](Self::contains), so that a proxy seen through a dual-stack socket is still
/// recognised; and spaces around the address or the prefix length are ignored.
///
/// ```
/// use fluxgate_tower::IpNet;
/// let net: IpNet = "10.0.0.0/8".parse().unwrap();
/// assert!(net.contains("10.1.2.3".parse().unwrap()));
/// assert!(net.contains("::ffff:10.1.2.3".parse().unwrap()));
/// assert!(!net.contains("11.0.0.1".parse().unwrap()));
/// let one: IpNet = "2001:db8::1".parse().unwrap();
/// assert!(one.contains("2001:db8::1".parse().unwrap()));
/// assert!(!one.contains("2001:db8::2".parse().unwrap()));
/// assert!("10.0.0.0/33".parse::<IpNet>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNet(ipnet::IpNet);

/// Why a network could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid trusted proxy `{value}`: {reason}")]
#[non_exhaustive]
pub struct IpNetError {
    /// The text given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl IpNet {
    /// Whether `ip` is in this network (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&canonical(ip))
    }

    /// Whether this is every address of its family (`0.0.0.0/0`, `::/0`).
    pub(crate) fn is_everything(&self) -> bool {
        self.0.prefix_len() == 0
    }
}

/// The networks of `nets` that together hold every address of their family, IPv4 or IPv6
/// (`0.0.0.0/1` and `128.0.0.0/1`, as `0.0.0.0/0` alone), by their positions in `nets`;
/// `None` when each family has an address none of them holds.
pub(crate) fn covering_every_address(nets: &[IpNet]) -> Option<Vec<usize>> {
    // Each family's networks as ranges of 128-bit numbers (an IPv4 address in the low 32
    // bits), merged in order of their first address.
    let family = |v4: bool, last: u128| {
        let mut ranges: Vec<(u128, u128, usize)> = nets
            .iter()
            .enumerate()
            .filter_map(|(i, net)| match net.0 {
                ipnet::IpNet::V4(n) if v4 => Some((
                    u128::from(u32::from(n.network())),
                    u128::from(u32::from(n.broadcast())),
                    i,
                )),
                ipnet::IpNet::V6(n) if !v4 => Some((u128::from(n.network()), u128::from(n.broadcast()), i)),
                _ => None,
            })
            .collect();
        ranges.sort_unstable();
        let (mut next, mut used) = (0u128, Vec::new());
        for (first, end, i) in ranges {
            if first > next {
                return None;
            }
            if end >= next {
                used.push(i);
                if end == last {
                    used.sort_unstable();
                    return Some(used);
                }
                next = end + 1;
            }
        }
        None
    };
    family(true, u128::from(u32::MAX)).or_else(|| family(false, u128::MAX))
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

impl FromStr for IpNet {
    type Err = IpNetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Not `ipnet`'s parser: it wants a prefix length, rejects spaces, and would read
        // `::ffff:10.0.0.0/104` as an IPv6 network that no canonical address is in.
        let err = |reason| IpNetError {
            value: s.to_owned(),
            reason,
        };
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr = canonical(
            IpAddr::from_str(addr.trim()).map_err(|_| err("expected an IP address or a CIDR such as 10.0.0.0/8"))?,
        );
        let Some(prefix) = prefix else {
            return Ok(Self(ipnet::IpNet::from(addr)));
        };
        let range = if addr.is_ipv4() {
            "the prefix length must be 0 to 32"
        } else {
            "the prefix length must be 0 to 128"
        };
        let prefix = prefix.trim().parse::<u8>().map_err(|_| err(range))?;
        ipnet::IpNet::new(addr, prefix).map(Self).map_err(|_| err(range))
    }
}

/// Finds the client address of a request: the peer, or, when the peer is a trusted
/// proxy, what the forwarding header it maintains says.
///
/// Exactly one forwarding header is read: the configured one, `X-Forwarded-For` by
/// default, or `Forwarded` (RFC 7239) when that is the one configured. A proxy rewrites
/// the header it owns and passes any other one through from the client untouched, so a
/// second header would let a client choose its own address. The header's hops are read
/// right to left: each trusted hop is skipped, and the first untrusted one is the client.
/// A hop that cannot be read ends the chain at the hop after it. Nothing is ever taken
/// from the left of an untrusted hop.
///
/// ```
/// use fluxgate_tower::ClientIpResolver;
/// use http::HeaderMap;
///
/// let resolver = ClientIpResolver::new(["10.0.0.0/8".parse().unwrap()], http::header::HeaderName::from_static("x-forwarded-for"));
/// let mut headers = HeaderMap::new();
/// headers.insert("x-forwarded-for", "203.0.113.9, 10.0.0.7".parse().unwrap());
/// // A client's own `Forwarded` header is not read.
/// headers.insert("forwarded", "for=198.51.100.1".parse().unwrap());
/// let client = resolver.resolve_from(Some("10.0.0.1".parse().unwrap()), &headers);
/// assert_eq!(client, Some("203.0.113.9".parse().unwrap()));
/// // From an untrusted peer, no header is believed.
/// assert_eq!(resolver.resolve_from(Some("192.0.2.1".parse().unwrap()), &headers), Some("192.0.2.1".parse().unwrap()));
/// ```
#[derive(Debug, Clone)]
pub struct ClientIpResolver {
    pub(crate) trusted: Vec<IpNet>,
    pub(crate) header: HeaderName,
}

impl ClientIpResolver {
    /// A resolver believing `header` from peers in `trusted`. `header` is `Forwarded`
    /// (read as RFC 7239 `for=` elements) or any header listing addresses separated by
    /// commas, such as `X-Forwarded-For`.
    pub fn new(trusted: impl IntoIterator<Item = IpNet>, header: HeaderName) -> Self {
        Self {
            trusted: trusted.into_iter().collect(),
            header,
        }
    }

    /// The peer address of a request: a [`ClientIp`] extension, else axum's
    /// `ConnectInfo<SocketAddr>` (feature `axum`), else a `SocketAddr` extension.
    pub fn peer(extensions: &Extensions) -> Option<IpAddr> {
        if let Some(ClientIp(ip)) = extensions.get::<ClientIp>() {
            return Some(*ip);
        }
        #[cfg(feature = "axum")]
        if let Some(info) = extensions.get::<axum::extract::ConnectInfo<SocketAddr>>() {
            return Some(info.0.ip());
        }
        extensions.get::<SocketAddr>().map(SocketAddr::ip)
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(ip))
    }

    /// The client address of a request with these extensions and headers.
    pub fn resolve(&self, extensions: &Extensions, headers: &HeaderMap) -> Option<IpAddr> {
        let peer = Self::peer(extensions);
        if peer.is_none() {
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "a request has no client address: per-IP rules count all such requests as one client; \
                     serve with `into_make_service_with_connect_info::<SocketAddr>()` or insert a `ClientIp` extension"
                );
            }
        }
        self.resolve_from(peer, headers)
    }

    /// The client address of a request from `peer` with these headers: the peer, or —
    /// when the peer is a trusted proxy — the nearest untrusted hop of the configured
    /// forwarding header, read right to left.
    #[inline]
    pub fn resolve_from(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Option<IpAddr> {
        let peer = peer?;
        if self.trusted.is_empty() || !self.is_trusted(peer) {
            return Some(canonical(peer));
        }
        Some(self.forwarded_client(peer, headers))
    }

    /// The client behind `peer`, a trusted proxy: the nearest untrusted hop of the
    /// configured header, or the last trusted one when the walk ends before it.
    fn forwarded_client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        // Right to left, lazily: the walk reads the hops the trusted proxies wrote and the
        // first one they did not, and no further; what a client wrote to the left of that,
        // however long, costs nothing.
        let lines = self.header_lines(headers);
        let mut client = canonical(peer);
        for hop in lines {
            let ip = match hop {
                // An empty `Forwarded` element is no hop at all.
                Hop::Empty => continue,
                Hop::Text(text) => parse_hop(String::from_utf8_lossy(text).trim()),
                // A hop that cannot be read ends the chain: trust no further.
                Hop::Unreadable => None,
            };
            let Some(ip) = ip else { break };
            client = canonical(ip);
            if !self.is_trusted(ip) {
                break;
            }
        }
        client
    }
}

impl ClientIpResolver {
    /// The hops of the configured header, right to left: the last line first.
    fn header_lines<'a>(&self, headers: &'a HeaderMap) -> impl Iterator<Item = Hop<'a>> + 'a {
        let rfc7239 = self.header == FORWARDED;
        headers
            .get_all(&self.header)
            .iter()
            .rev()
            .flat_map(move |value| -> Box<dyn Iterator<Item = Hop<'a>> + 'a> {
                if rfc7239 {
                    Box::new(ForwardedElements {
                        line: value.as_bytes(),
                        done: false,
                    })
                } else {
                    Box::new(value.as_bytes().rsplit(|&b| b == b',').map(Hop::Text))
                }
            })
    }
}

/// One hop of a forwarding header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hop<'a> {
    /// The text of an address (an `X-Forwarded-For` element, or the `for=` value of a
    /// `Forwarded` element, unquoted).
    Text(&'a [u8]),
    /// An empty `Forwarded` element (nothing but whitespace between its commas): no hop.
    Empty,
    /// A `Forwarded` element without `for=` (`;` alone among them), or not well formed:
    /// nothing left of it can be told apart from what the client wrote.
    Unreadable,
}

/// The elements of one `Forwarded` line (RFC 7239), right to left, as their `for=` values.
///
/// Read from the right, so that what a client wrote on the left costs nothing and cannot
/// change how the elements its proxies appended are read: a quoted-string (`host="…"`,
/// which a proxy may copy from the request) is read as one value, commas and semicolons
/// in it included, and a `"` in it is one escaped by `\`. Once an element is not well
/// formed, nothing more is read.
struct ForwardedElements<'a> {
    line: &'a [u8],
    done: bool,
}

fn is_ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

impl<'a> ForwardedElements<'a> {
    /// Drops optional whitespace at the end of what is left.
    fn trim_end(&mut self) {
        while let [rest @ .., last] = self.line {
            if !is_ows(*last) {
                break;
            }
            self.line = rest;
        }
    }

    /// The element that ends the line, and the line left of it; `None` when it is not well
    /// formed.
    fn element(&mut self) -> Option<Hop<'a>> {
        let mut for_value = None;
        // Pairs, empty ones included: only an element of none at all is empty.
        let mut pairs = 0;
        loop {
            self.trim_end();
            match self.line {
                [] => break,
                [rest @ .., b','] => {
                    self.line = rest;
                    return Some(Self::hop(for_value, pairs));
                }
                [rest @ .., b';'] => {
                    // An empty pair.
                    self.line = rest;
                    pairs += 1;
                    continue;
                }
                _ => {}
            }
            let value = self.value()?;
            // `name=`
            let [rest @ .., b'='] = self.line else {
                return None;
            };
            let start = rest.iter().rposition(|&b| b == b';' || b == b',').map_or(0, |i| i + 1);
            let name = &rest[start..];
            let name = trim(name);
            if name.is_empty() || name.iter().any(|&b| b == b'"' || b == b'=') {
                return None;
            }
            self.line = &rest[..start];
            pairs += 1;
            if name.eq_ignore_ascii_case(b"for") {
                if for_value.is_some() {
                    // Parameter names are unique within an element.
                    return None;
                }
                for_value = Some(value);
            }
            self.trim_end();
            match self.line {
                [] => break,
                [rest @ .., b';'] => self.line = rest,
                [_, ..] if self.line.ends_with(b",") => {}
                _ => return None,
            }
        }
        self.done = true;
        Some(Self::hop(for_value, pairs))
    }

    fn hop(for_value: Option<&'a [u8]>, pairs: usize) -> Hop<'a> {
        match (for_value, pairs) {
            (Some(v), _) => Hop::Text(v),
            (None, 0) => Hop::Empty,
            (None, _) => Hop::Unreadable,
        }
    }

    /// The value that ends the line: a quoted-string (its content, escapes left as they
    /// are: no address holds one) or a token.
    fn value(&mut self) -> Option<&'a [u8]> {
        let line = self.line;
        if let [rest @ .., b'"'] = line {
            // The opening quote: the nearest `"` not escaped by an odd run of `\`.
            let mut end = rest.len();
            loop {
                let open = rest[..end].iter().rposition(|&b| b == b'"')?;
                let escapes = rest[..open].iter().rev().take_while(|&&b| b == b'\\').count();
                if escapes % 2 == 0 {
                    self.line = &rest[..open];
                    return Some(&rest[open + 1..]);
                }
                end = open;
            }
        }
        let start = line
            .iter()
            .rposition(|&b| matches!(b, b'=' | b';' | b',' | b'"'))
            .map_or(0, |i| i + 1);
        let value = &line[start..];
        if value.is_empty() || value.iter().any(|&b| is_ows(b)) {
            return None;
        }
        self.line = &line[..start];
        Some(value)
    }
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = s {
        if !is_ows(*first) {
            break;
        }
        s = rest;
    }
    while let [rest @ .., last] = s {
        if !is_ows(*last) {
            break;
        }
        s = rest;
    }
    s
}

impl<'a> Iterator for ForwardedElements<'a> {
    type Item = Hop<'a>;

    fn next(&mut self) -> Option<Hop<'a>> {
        if self.done {
            return None;
        }
        match self.element() {
            Some(hop) => Some(hop),
            None => {
                self.done = true;
                Some(Hop::Unreadable)
            }
        }
    }
}

/// `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:80`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(sa) = hop.parse::<SocketAddr>() {
        return Some(sa.ip());
    }
    let inner = hop.strip_prefix('[')?.split(']').next()?;
    inner.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolver(trusted: &[&str]) -> ClientIpResolver {
        with_header(trusted, "x-forwarded-for")
    }

    fn with_header(trusted: &[&str], header: &'static str) -> ClientIpResolver {
        ClientIpResolver::new(
            trusted.iter().map(|s| s.parse().unwrap()),
            HeaderName::from_static(header),
        )
    }

    fn ext(peer: &str) -> Extensions {
        let mut e = Extensions::new();
        e.insert(ClientIp(peer.parse().unwrap()));
        e
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    /// The walk reads from the right and stops at the first hop the trusted proxies did not
    /// write: whatever a client put to its left, however long, and across instances of the
    /// header, is never reached.
    #[test]
    fn the_walk_stops_at_the_first_untrusted_hop_from_the_right() {
        let r = resolver(&["10.0.0.0/8"]);
        let peer = Some("10.0.0.1".parse().unwrap());
        let junk = format!("{}[::1]:x,{}", ",".repeat(200_000), "not-an-address,".repeat(10_000));
        let client = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append("x-forwarded-for", v.parse().unwrap());
            }
            r.resolve_from(peer, &h).map(|ip| ip.to_string())
        };
        let long = format!("{junk}198.51.100.7, 10.0.0.9");
        assert_eq!(client(&[&long]).as_deref(), Some("198.51.100.7"));
        // The last instance is the nearest proxy's: read first.
        assert_eq!(
            client(&[&junk, "198.51.100.8", "10.0.0.3"]).as_deref(),
            Some("198.51.100.8")
        );
        // An unreadable hop written by a trusted proxy ends the walk there.
        assert_eq!(
            client(&["198.51.100.9, garbage, 10.0.0.4"]).as_deref(),
            Some("10.0.0.4")
        );
    }

    #[test]
    fn forwarded_headers_only_from_trusted_peers() {
        let r = resolver(&["10.0.0.0/8"]);
        let h = headers(&[("x-forwarded-for", "198.51.100.7, 10.0.0.2")]);
        assert_eq!(r.resolve(&ext("203.0.113.1"), &h), Some("203.0.113.1".parse().unwrap()));
        assert_eq!(r.resolve(&ext("10.0.0.1"), &h), Some("198.51.100.7".parse().unwrap()));
        // A forged leftmost entry is skipped: the nearest untrusted hop wins.
        let h = headers(&[("x-forwarded-for", "1.1.1.1, 198.51.100.7")]);
        assert_eq!(r.resolve(&ext("10.0.0.1"), &h), Some("198.51.100.7".parse().unwrap()));
        let h = headers(&[(
            "forwarded",
            "for=192.0.2.60;proto=http, for=\"[2001:db8:cafe::17]:4711\"",
        )]);
        assert_eq!(
            with_header(&["10.0.0.0/8"], "forwarded").resolve(&ext("10.0.0.1"), &h),
            Some("2001:db8:cafe::17".parse().unwrap())
        );
        let h = headers(&[("x-forwarded-for", "garbage, 10.0.0.3")]);
        assert_eq!(r.resolve(&ext("10.0.0.1"), &h), Some("10.0.0.3".parse().unwrap()));
        assert_eq!(
            resolver(&[]).resolve(&ext("10.0.0.1"), &headers(&[("x-forwarded-for", "1.2.3.4")])),
            Some("10.0.0.1".parse().unwrap())
        );
    }

    /// A `Forwarded` element without `for=` (written by a trusted proxy that names no
    /// address) ends the walk: the client's own element to its left is not believed.
    #[test]
    fn a_forwarded_element_without_for_ends_the_walk() {
        let r = with_header(&["10.0.0.0/8"], "forwarded");
        let h = headers(&[
            ("forwarded", "for=198.51.100.77"),
            ("forwarded", "proto=https;by=10.0.0.1"),
        ]);
        assert_eq!(r.resolve(&ext("10.0.0.1"), &h), Some("10.0.0.1".parse().unwrap()));
        // An empty element is no hop: the walk goes on past it.
        let h = headers(&[("forwarded", "for=198.51.100.77, , for=10.0.0.2")]);
        assert_eq!(r.resolve(&ext("10.0.0.1"), &h), Some("198.51.100.77".parse().unwrap()));
        // An element of empty pairs alone (`;`) is an element without `for=`, not an
        // empty one: it ends the walk, whether a line of its own or after a comma.
        for forwarded in [
            &[("forwarded", "for=198.51.100.77"), ("forwarded", ";")][..],
            &[("forwarded", "for=198.51.100.77, ;;")],
        ] {
            let h = headers(forwarded);
            assert_eq!(
                r.resolve(&ext("10.0.0.1"), &h),
                Some("10.0.0.1".parse().unwrap()),
                "{forwarded:?}"
            );
        }
        // A trailing empty pair after a `for=` is still that element's `for=`.
        let h = headers(&[("forwarded", "for=198.51.100.77;")]);
        assert_eq!(r.resolve(&ext("10.0.0.1"), &h), Some("198.51.100.77".parse().unwrap()));
    }

    /// A quoted-string in a `Forwarded` element is one value: a `host=` a proxy copies from
    /// the request (HAProxy's `option forwarded`) cannot add a `for=` of the client's choice
    /// with a comma or a semicolon in it.
    #[test]
    fn a_quoted_forwarded_value_names_no_hop() {
        let r = with_header(&["10.0.0.0/8"], "forwarded");
        for forwarded in [
            r#"for=198.51.100.7;host="a,for=6.6.6.6""#,
            r#"for=198.51.100.7;host="a;for=6.6.6.6""#,
            r#"proto=http;host="a,for=6.6.6.6";by="10.0.0.1";for=198.51.100.7"#,
            r#"proto=http;host="a;for=6.6.6.6";for="198.51.100.7:4711""#,
            r#"for=6.6.6.6, proto=http;host="a\",for=6.6.6.6";for=198.51.100.7"#,
        ] {
            let h = headers(&[("forwarded", forwarded)]);
            assert_eq!(
                r.resolve(&ext("10.0.0.1"), &h),
                Some("198.51.100.7".parse().unwrap()),
                "Forwarded: {forwarded}"
            );
        }
        // A client's unterminated quote on the left does not hide its proxy's element.
        let h = headers(&[("forwarded", r#"for="6.6.6.6, for=198.51.100.7"#)]);
        assert_eq!(r.resolve(&ext("10.0.0.1"), &h), Some("198.51.100.7".parse().unwrap()));
    }

    #[test]
    fn only_the_configured_forwarding_header_is_read() {
        // Behind a proxy that maintains X-Forwarded-For, a client's own `Forwarded`
        // header passes through untouched: it must not choose the address.
        let xff = resolver(&["10.0.0.0/8"]);
        let h = headers(&[("forwarded", "for=192.0.2.99"), ("x-forwarded-for", "198.51.100.7")]);
        assert_eq!(xff.resolve(&ext("10.0.0.1"), &h), Some("198.51.100.7".parse().unwrap()));
        let h = headers(&[("forwarded", "for=192.0.2.99")]);
        assert_eq!(xff.resolve(&ext("10.0.0.1"), &h), Some("10.0.0.1".parse().unwrap()));
        // And the other way round: `Forwarded` configured, X-Forwarded-For ignored.
        let fwd = with_header(&["10.0.0.0/8"], "forwarded");
        let h = headers(&[("forwarded", "for=198.51.100.7"), ("x-forwarded-for", "192.0.2.99")]);
        assert_eq!(fwd.resolve(&ext("10.0.0.1"), &h), Some("198.51.100.7".parse().unwrap()));
        let h = headers(&[("x-forwarded-for", "192.0.2.99")]);
        assert_eq!(fwd.resolve(&ext("10.0.0.1"), &h), Some("10.0.0.1".parse().unwrap()));
    }

    #[test]
    fn nets() {
        assert!("::/0"
            .parse::<IpNet>()
            .unwrap()
            .contains("2001:db8::1".parse().unwrap()));
        assert!("0.0.0.0/0"
            .parse::<IpNet>()
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert!("10.0.0.1"
            .parse::<IpNet>()
            .unwrap()
            .contains("::ffff:10.0.0.1".parse().unwrap()));
        assert!("2001:db8::/32"
            .parse::<IpNet>()
            .unwrap()
            .contains("2001:db8:ffff::1".parse().unwrap()));
        let net = |s: &str| s.parse::<IpNet>().unwrap().to_string();
        assert_eq!(net("10.0.0.1"), "10.0.0.1/32");
        assert_eq!(net("::ffff:10.0.0.1"), "10.0.0.1/32");
        assert_eq!(net("2001:db8::1"), "2001:db8::1/128");
        assert_eq!(net(" 10.0.0.0 / 8 "), "10.0.0.0/8");
        assert!(!"10.0.0.1"
            .parse::<IpNet>()
            .unwrap()
            .contains("10.0.0.2".parse().unwrap()));
        assert!(!"10.0.0.0/8"
            .parse::<IpNet>()
            .unwrap()
            .contains("::a00:1".parse().unwrap()));
        assert!("nope".parse::<IpNet>().is_err());
        assert!("10.0.0.0/x".parse::<IpNet>().is_err());
        assert_eq!(
            "10.0.0.0/33".parse::<IpNet>().unwrap_err().to_string(),
            "invalid trusted proxy `10.0.0.0/33`: the prefix length must be 0 to 32"
        );
        assert_eq!(
            "::1/129".parse::<IpNet>().unwrap_err().to_string(),
            "invalid trusted proxy `::1/129`: the prefix length must be 0 to 128"
        );
    }
}
