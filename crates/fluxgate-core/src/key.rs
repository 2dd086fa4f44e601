//! Key resolution: which counter a request is counted in, for each rule.
//!
//! A key value is a sequence of `tag=value` components joined by `:`. Values are
//! percent-encoded so that only `A-Z a-z 0-9 . _ -` and `%XX` remain: no `:`, `{`, `}`,
//! `=`, `~`, spaces or newlines can come from a user's header. A value whose encoding is
//! longer than [`MAX_ENCODED_VALUE`] is replaced by `tag~` and the first 128 bits of its
//! SHA-256 in hex. Two different inputs therefore never share an encoding (short ones are
//! injective, long ones differ by their hash), and a key value stays bounded in length.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv6Addr};

use sha2::{Digest, Sha256};

use crate::context::{RequestContext, AMBIGUOUS_IDENTITY};
use crate::rule::{KeyField, OnMissingKey, Rule, Scope};
use crate::text::Text;

/// The longest encoded value kept as is; longer ones are hashed.
pub const MAX_ENCODED_VALUE: usize = 64;

/// How a rule's key resolved for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyResolution {
    /// Count the request under this encoded key value.
    Key(Text),
    /// The rule does not apply (`on_missing_key: skip`).
    Skip,
    /// Reject the request (`on_missing_key: deny`).
    Deny,
}

/// How a rule's key resolved, its value written where the caller keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// The key value was written.
    Key,
    /// The key value was written from a user id or API key that is
    /// [`AMBIGUOUS_IDENTITY`]: an enforced rule refuses the request.
    Ambiguous,
    /// See [`KeyResolution::Skip`].
    Skip,
    /// See [`KeyResolution::Deny`].
    Deny,
}

/// A key value the in-memory limiter can tell apart without its text: the address and
/// global keys the engine resolves. Keys with the same typed value have the same text
/// (see [`KeyResolver`]), and the limiter hashes such a key from this value instead of
/// its text, which the engine then does not write for it
/// ([`RateLimiter::reads_key_text`](crate::limiter::RateLimiter::reads_key_text)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) enum TypedKey {
    /// Known by its text only.
    #[default]
    Text,
    /// `global`.
    Global,
    /// `ip=unknown`: a request without any known address.
    NoIp,
    /// `ip=<dotted decimal>`.
    Ipv4(u32),
    /// `ip=<address cut to the prefix>_<prefix>`: the address's bits after the cut are 0.
    Ipv6 {
        /// The address, cut to the prefix.
        bits: u128,
        /// The prefix length.
        prefix: u8,
    },
}

/// Resolves rule keys for requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyResolver {
    ipv6_prefix: u8,
    /// The first 96 bits of a network-specific NAT64 prefix, when one is configured
    /// ([`with_nat64_prefix`](Self::with_nat64_prefix)).
    nat64: Option<u128>,
}

impl Default for KeyResolver {
    fn default() -> Self {
        Self::new(64)
    }
}

impl KeyResolver {
    /// A resolver that keys IPv6 clients by their first `ipv6_prefix` bits (1 to 128;
    /// the default is 64, one client network).
    ///
    /// # Panics
    ///
    /// When `ipv6_prefix` is 0 or larger than 128.
    pub const fn new(ipv6_prefix: u8) -> Self {
        Self {
            ipv6_prefix: 64,
            nat64: None,
        }
        .with_ipv6_prefix(ipv6_prefix)
    }

    /// This resolver keying IPv6 clients by their first `ipv6_prefix` bits.
    ///
    /// # Panics
    ///
    /// When `ipv6_prefix` is 0 or larger than 128.
    pub const fn with_ipv6_prefix(self, ipv6_prefix: u8) -> Self {
        assert!(
            ipv6_prefix >= 1 && ipv6_prefix <= 128,
            "ipv6_prefix must be between 1 and 128"
        );
        Self { ipv6_prefix, ..self }
    }

    /// This resolver keying the addresses under the /96 network-specific NAT64 prefix
    /// `prefix` (its last 32 bits are ignored) as the IPv4 addresses in their last 32
    /// bits, as it keys those under the well-known prefix `64:ff9b::/96`.
    ///
    /// A server behind a stateless translator (SIIT, RFC 7755) or a NAT64 with a prefix of
    /// its network (RFC 6052, such as `2001:db8:64::/96`) sees every IPv4 client in that
    /// /96: keyed by their /64, they would all share one counter. Give the translator's own
    /// prefix only: every address under it is taken for an IPv4 client (`::` would key
    /// `::1` as `0.0.0.1`), and one within `2002::/16` or `2001::/32` is read as 6to4 or
    /// Teredo first.
    ///
    /// ```
    /// use fluxgate_core::key::KeyResolver;
    /// let r = KeyResolver::default().with_nat64_prefix("2001:db8:64::".parse().unwrap());
    /// assert_eq!(r.mask("2001:db8:64::192.0.2.1".parse().unwrap()), "192.0.2.1".parse::<std::net::IpAddr>().unwrap());
    /// ```
    pub const fn with_nat64_prefix(self, prefix: Ipv6Addr) -> Self {
        Self {
            nat64: Some(prefix.to_bits() >> 32 << 32),
            ..self
        }
    }

    /// The IPv6 prefix length.
    pub fn ipv6_prefix(&self) -> u8 {
        self.ipv6_prefix
    }

    /// The network-specific NAT64 prefix, when one is configured.
    pub fn nat64_prefix(&self) -> Option<Ipv6Addr> {
        self.nat64.map(Ipv6Addr::from)
    }

    /// Resolves the key of `rule` for `ctx`.
    ///
    /// ```
    /// use fluxgate_core::key::{KeyResolution, KeyResolver};
    /// use fluxgate_core::{BandSpec, RequestContext, Rule, RuleSpec};
    /// use std::time::Duration;
    /// let rule = Rule::from_spec("api", RuleSpec::new("per-ip", vec![BandSpec::new(10, Duration::from_secs(1))])).unwrap();
    /// let ctx = RequestContext::builder().client_ip("10.1.2.3".parse().unwrap()).build();
    /// assert_eq!(KeyResolver::default().resolve(&rule, &ctx), KeyResolution::Key("ip=10.1.2.3".into()));
    /// ```
    pub fn resolve(&self, rule: &Rule, ctx: &RequestContext) -> KeyResolution {
        let mut out = Text::new();
        match self.resolve_into(rule, ctx, &mut out, &mut TypedKey::Text, true) {
            Resolved::Key | Resolved::Ambiguous => KeyResolution::Key(out),
            Resolved::Skip => KeyResolution::Skip,
            Resolved::Deny => KeyResolution::Deny,
        }
    }

    /// [`resolve`](Self::resolve), writing the key value into `out` (empty), where the
    /// request keeps it, and its typed value into `typed` (left as [`TypedKey::Text`] for a
    /// key known only by its text). With `text` false, a key with a typed value is not
    /// written into `out`, which stays empty.
    pub(crate) fn resolve_into(
        &self,
        rule: &Rule,
        ctx: &RequestContext,
        out: &mut Text,
        typed: &mut TypedKey,
        text: bool,
    ) -> Resolved {
        let complete = match rule.scope() {
            Scope::Global => {
                *typed = TypedKey::Global;
                if text {
                    out.push_str("global");
                }
                true
            }
            Scope::Ip => {
                // A request without any known address is counted as one unknown client.
                *typed = self.typed_ip(ctx.client_ip());
                if text {
                    self.push_ip(out, ctx.client_ip());
                }
                true
            }
            Scope::User => push_opt(out, "user", ctx.user_id()),
            Scope::ApiKey => push_opt(out, "key", ctx.api_key()),
            Scope::Attribute(name) => push_attr(out, name, ctx),
            Scope::Composite(fields) => {
                let mut all = true;
                for field in fields {
                    if !out.is_empty() {
                        out.push(':');
                    }
                    all &= match field {
                        KeyField::Ip => {
                            self.push_ip(out, ctx.client_ip());
                            true
                        }
                        KeyField::User => push_opt(out, "user", ctx.user_id()),
                        KeyField::ApiKey => push_opt(out, "key", ctx.api_key()),
                        KeyField::Attribute(name) => push_attr(out, name, ctx),
                    };
                    if !all {
                        break;
                    }
                }
                all
            }
        };
        if complete {
            return if reads_ambiguous_identity(rule, ctx) {
                Resolved::Ambiguous
            } else {
                Resolved::Key
            };
        }
        match rule.on_missing_key() {
            OnMissingKey::FallbackIp => {
                out.clear();
                *typed = self.typed_ip(ctx.client_ip());
                if text {
                    self.push_ip(out, ctx.client_ip());
                }
                Resolved::Key
            }
            OnMissingKey::Skip => Resolved::Skip,
            OnMissingKey::Deny => Resolved::Deny,
        }
    }

    /// The typed value of `rule`'s key for `ctx`, when the key has one and is always found:
    /// the address and global scopes.
    #[inline]
    pub(crate) fn typed(&self, rule: &Rule, ctx: &RequestContext) -> Option<TypedKey> {
        self.typed_by_address(rule, ctx.client_ip())
    }

    /// [`typed`](Self::typed) for a request of this client address, when the rule's key
    /// is the address's or the global one (no other field of the request takes part).
    #[inline]
    pub(crate) fn typed_by_address(&self, rule: &Rule, client_ip: Option<IpAddr>) -> Option<TypedKey> {
        match rule.scope() {
            Scope::Global => Some(TypedKey::Global),
            Scope::Ip => Some(self.typed_ip(client_ip)),
            _ => None,
        }
    }

    /// The typed value of the key `push_ip` writes.
    fn typed_ip(&self, ip: Option<IpAddr>) -> TypedKey {
        match ip.map(|ip| self.mask(ip)) {
            Some(IpAddr::V4(v4)) => TypedKey::Ipv4(u32::from(v4)),
            Some(IpAddr::V6(v6)) => TypedKey::Ipv6 {
                bits: u128::from(v6),
                prefix: self.ipv6_prefix,
            },
            None => TypedKey::NoIp,
        }
    }

    fn push_ip(&self, out: &mut Text, ip: Option<IpAddr>) {
        let v6 = match ip.map(|ip| self.mask(ip)) {
            Some(IpAddr::V4(v4)) => return push_ipv4(out, v4.octets()),
            Some(IpAddr::V6(v6)) => Some(v6),
            None => None,
        };
        out.push_str("ip=");
        match v6 {
            // `Display` of an address only yields hex digits, `.` and `:`; `:` is escaped.
            Some(v6) => {
                let text = v6.to_string();
                encode_into(out, &text);
                if self.ipv6_prefix < 128 {
                    let _ = write!(out, "_{}", self.ipv6_prefix);
                }
            }
            None => out.push_str("unknown"),
        }
    }

    /// The address as keyed: an IPv4 client seen as IPv6 (IPv4-mapped, `::ffff:a.b.c.d`;
    /// IPv4-translated, `::ffff:0:a.b.c.d`; translated under the NAT64 well-known prefix,
    /// `64:ff9b::a.b.c.d`; a 6to4 address, `2002:WWXX:YYZZ::`; a Teredo address,
    /// `2001:0:…`) as IPv4, other IPv6 cut to the prefix.
    ///
    /// A server behind a stateless translator (SIIT, RFC 7755) sees every IPv4 client under
    /// `64:ff9b::/96`, one /64: cut to the prefix, all of them would share one counter. A
    /// 6to4 address (`2002::/16`) is keyed as the IPv4 host whose /48 it is in: cut to a /64,
    /// that one host would have 65,536 counters. A Teredo address (`2001::/32`, RFC 4380)
    /// holds its relay server's IPv4 address in its first /64, shared by every client of the
    /// server, and its client's public IPv4 address (inverted) in its last 32 bits: it is
    /// keyed as that client.
    ///
    /// A link-local address (`fe80::/10`) is cut to the prefix like any other: every link
    /// has the same `fe80::/64` and an `IpAddr` holds no zone, so the clients of every link
    /// share one counter. Keyed whole, a client on the server's link could take a new
    /// address for each request, and a new counter with it.
    ///
    /// ```
    /// use fluxgate_core::key::KeyResolver;
    /// let r = KeyResolver::default();
    /// assert_eq!(r.mask("64:ff9b::192.0.2.1".parse().unwrap()), "192.0.2.1".parse::<std::net::IpAddr>().unwrap());
    /// assert_eq!(r.mask("::ffff:192.0.2.1".parse().unwrap()), "192.0.2.1".parse::<std::net::IpAddr>().unwrap());
    /// assert_eq!(r.mask("2002:c000:201:ffff::1".parse().unwrap()), "192.0.2.1".parse::<std::net::IpAddr>().unwrap());
    /// ```
    pub fn mask(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => IpAddr::V4(v4),
            IpAddr::V6(v6) => {
                if let Some(v4) = embedded_ipv4(v6, self.nat64) {
                    return IpAddr::V4(v4);
                }
                let bits = u128::from(v6);
                let masked = if self.ipv6_prefix >= 128 {
                    bits
                } else {
                    bits & !(u128::MAX >> self.ipv6_prefix)
                };
                IpAddr::V6(Ipv6Addr::from(masked))
            }
        }
    }
}

/// The NAT64 well-known prefix, `64:ff9b::/96` (RFC 6052): its addresses are IPv4
/// addresses translated into IPv6, the IPv4 address in the last 32 bits.
const NAT64_WELL_KNOWN: u128 = 0x0064_ff9b_0000_0000_0000_0000_0000_0000;

/// The 6to4 prefix, `2002::/16` (RFC 3056): `2002:WWXX:YYZZ::/48` is the network of the
/// IPv4 host `WW.XX.YY.ZZ`.
const SIX_TO_FOUR: u128 = 0x2002 << 112;

/// The Teredo prefix, `2001::/32` (RFC 4380): `2001:0:SSSS:SSSS:FFFF:PPPP:CCCC:CCCC`, the
/// server's IPv4 address `S`, flags, the client's port and public IPv4 address `C`, both
/// inverted.
const TEREDO: u128 = 0x2001_0000 << 96;

/// The IPv4-translated addresses, `::ffff:0:0/96` (RFC 2765): the IPv4 address in the
/// last 32 bits.
const IPV4_TRANSLATED: u128 = 0xffff_0000 << 32;

/// The IPv4 client an IPv6 address stands for: an IPv4-mapped or IPv4-translated address,
/// one under the NAT64 well-known prefix or the network-specific one `nat64` (its first 96
/// bits), the host whose 6to4 network it is in, or a Teredo client.
fn embedded_ipv4(v6: Ipv6Addr, nat64: Option<u128>) -> Option<std::net::Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let bits = u128::from(v6);
    if bits >> 112 == SIX_TO_FOUR >> 112 {
        // Bits 16 to 47: the host's address (`as u32` keeps the low 32 bits).
        return Some(std::net::Ipv4Addr::from((bits >> 80) as u32));
    }
    if bits >> 96 == TEREDO >> 96 {
        // The last 32 bits, inverted: the client's public address.
        return Some(std::net::Ipv4Addr::from(!(bits as u32)));
    }
    // `bits as u32` keeps the low 32 bits: the embedded address.
    let prefix = bits >> 32 << 32;
    (prefix == NAT64_WELL_KNOWN || prefix == IPV4_TRANSLATED || Some(prefix) == nat64)
        .then(|| std::net::Ipv4Addr::from(bits as u32))
}

/// The decimal digits of every octet, and their count in the last byte.
const OCTETS: [[u8; 4]; 256] = {
    let mut table = [[0u8; 4]; 256];
    let mut o = 0;
    while o < 256 {
        let n = o as u8;
        table[o] = if n >= 100 {
            [b'0' + n / 100, b'0' + (n / 10) % 10, b'0' + n % 10, 3]
        } else if n >= 10 {
            [b'0' + n / 10, b'0' + n % 10, 0, 2]
        } else {
            [b'0' + n, 0, 0, 1]
        };
        o += 1;
    }
    table
};

/// `ip=` and the dotted decimal address, appended in one piece.
fn push_ipv4(out: &mut Text, octets: [u8; 4]) {
    let mut buf = [0u8; 21];
    buf[..3].copy_from_slice(b"ip=");
    let n = write_ipv4(&mut buf[3..], octets);
    out.push_ascii(&buf[..3 + n]);
}

/// Writes the dotted decimal address (at most 15 bytes, in a buffer of at least 18) and
/// returns its length, without the formatting machinery.
fn write_ipv4(buf: &mut [u8], octets: [u8; 4]) -> usize {
    let mut n = 0;
    for o in octets {
        let digits = OCTETS[usize::from(o)];
        buf[n..n + 3].copy_from_slice(&digits[..3]);
        n += usize::from(digits[3]);
        buf[n] = b'.';
        n += 1;
    }
    n - 1
}

/// Whether `rule`'s key reads a user id or API key of `ctx` that is
/// [`AMBIGUOUS_IDENTITY`].
fn reads_ambiguous_identity(rule: &Rule, ctx: &RequestContext) -> bool {
    let user = || ctx.user_id() == Some(AMBIGUOUS_IDENTITY);
    let api_key = || ctx.api_key() == Some(AMBIGUOUS_IDENTITY);
    match rule.scope() {
        Scope::User => user(),
        Scope::ApiKey => api_key(),
        Scope::Composite(fields) => fields.iter().any(|field| match field {
            KeyField::User => user(),
            KeyField::ApiKey => api_key(),
            KeyField::Ip | KeyField::Attribute(_) => false,
        }),
        Scope::Global | Scope::Ip | Scope::Attribute(_) => false,
    }
}

fn push_opt(out: &mut Text, tag: &str, value: Option<&str>) -> bool {
    match value {
        Some(v) => {
            push_component(out, tag, v);
            true
        }
        None => false,
    }
}

fn push_attr(out: &mut Text, name: &str, ctx: &RequestContext) -> bool {
    match ctx.attribute(name) {
        Some(v) => {
            // Attribute names are validated ids (`A-Z a-z 0-9 _ - .`).
            out.push_str("a.");
            push_component(out, name, v);
            true
        }
        None => false,
    }
}

/// Appends `tag=encoded` or, for long values, `tag~hash`.
fn push_component(out: &mut Text, tag: &str, value: &str) {
    out.push_str(tag);
    if encoded_len(value) <= MAX_ENCODED_VALUE {
        out.push('=');
        encode_into(out, value);
    } else {
        out.push('~');
        push_digest(out, value, 16);
    }
}

/// Appends the first `bytes` bytes (at most 32) of the SHA-256 of `value`, in hexadecimal.
pub(crate) fn push_digest(out: &mut impl std::fmt::Write, value: &str, bytes: usize) {
    let digest = Sha256::digest(value.as_bytes());
    for b in &digest[..bytes.min(digest.len())] {
        let _ = write!(out, "{b:02x}");
    }
}

fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

fn encoded_len(value: &str) -> usize {
    value.bytes().map(|b| if is_plain(b) { 1 } else { 3 }).sum()
}

/// Percent-encodes every byte outside `A-Z a-z 0-9 . _ -`.
///
/// ```
/// let mut s = String::new();
/// fluxgate_core::key::encode_into(&mut s, "a:{b}\n");
/// assert_eq!(s, "a%3A%7Bb%7D%0A");
/// ```
pub fn encode_into(out: &mut impl std::fmt::Write, value: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let bytes = value.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if !is_plain(b) {
            // A run of plain bytes is ASCII, so it starts and ends on character boundaries.
            if start < i {
                let _ = out.write_str(&value[start..i]);
            }
            let _ = out.write_char('%');
            let _ = out.write_char(char::from(HEX[usize::from(b >> 4)]));
            let _ = out.write_char(char::from(HEX[usize::from(b & 15)]));
            start = i + 1;
        }
    }
    if start < bytes.len() {
        let _ = out.write_str(&value[start..]);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::rule::{BandSpec, RuleSpec, ScopeKind};

    fn rule(scope: ScopeKind, attribute: Option<&str>, fields: &[&str], missing: OnMissingKey) -> Rule {
        let mut spec = RuleSpec::new("r", vec![BandSpec::new(1, Duration::from_secs(1))]);
        spec.scope = scope;
        spec.attribute = attribute.map(str::to_owned);
        spec.fields = fields.iter().map(|s| (*s).to_owned()).collect();
        spec.on_missing_key = missing;
        Rule::from_spec("s", spec).unwrap()
    }

    fn key(r: &Rule, ctx: &RequestContext) -> String {
        match KeyResolver::default().resolve(r, ctx) {
            KeyResolution::Key(k) => k.to_string(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn hostile_values_do_not_collide_and_stay_bounded() {
        let r = rule(ScopeKind::User, None, &[], OnMissingKey::Deny);
        let big = "x".repeat(10 * 1024);
        let values = [
            "a",
            "a:b",
            "a%3Ab",
            "a=b",
            "{a}",
            "a}",
            "{",
            "}",
            "a\nb",
            "a\r\nb",
            "",
            " ",
            "a~b",
            &big,
            &format!("{big}y"),
            "user=a",
            "ip=1.2.3.4",
            "%",
            "%25",
        ];
        let mut seen = std::collections::HashSet::new();
        for v in values {
            let ctx = RequestContext::builder().user_id(v).build();
            let k = key(&r, &ctx);
            assert!(k.len() <= 4 + 1 + MAX_ENCODED_VALUE, "{k}");
            assert!(!k.contains(['{', '}', '\n', '\r', ' ', ':']), "{k}");
            assert!(seen.insert(k.clone()), "collision on {v:?}: {k}");
        }
    }

    #[test]
    fn composite_fields_cannot_shift() {
        let r = rule(ScopeKind::Composite, None, &["user", "tenant"], OnMissingKey::Deny);
        let a = RequestContext::builder()
            .user_id("a:a.tenant=b")
            .attribute("tenant", "c")
            .build();
        let b = RequestContext::builder()
            .user_id("a")
            .attribute("tenant", "b:a.tenant=c")
            .build();
        assert_ne!(key(&r, &a), key(&r, &b));
        assert_eq!(key(&r, &a).matches(':').count(), 1);
    }

    #[test]
    fn missing_key_policies() {
        let ctx = RequestContext::builder().client_ip("10.0.0.1".parse().unwrap()).build();
        let fallback = rule(ScopeKind::ApiKey, None, &[], OnMissingKey::FallbackIp);
        assert_eq!(key(&fallback, &ctx), "ip=10.0.0.1");
        let skip = rule(ScopeKind::Attribute, Some("tenant"), &[], OnMissingKey::Skip);
        assert_eq!(KeyResolver::default().resolve(&skip, &ctx), KeyResolution::Skip);
        let deny = rule(ScopeKind::Composite, None, &["ip", "user"], OnMissingKey::Deny);
        assert_eq!(KeyResolver::default().resolve(&deny, &ctx), KeyResolution::Deny);
        let global = rule(ScopeKind::Global, None, &[], OnMissingKey::Deny);
        assert_eq!(key(&global, &ctx), "global");
    }

    #[test]
    fn ipv6_prefix() {
        let r = rule(ScopeKind::Ip, None, &[], OnMissingKey::Deny);
        let at = |ip: &str| RequestContext::builder().client_ip(ip.parse().unwrap()).build();
        let a = key(&r, &at("2001:db8:1:2::1"));
        let b = key(&r, &at("2001:db8:1:2:ffff::9"));
        let c = key(&r, &at("2001:db8:1:3::1"));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, "ip=2001%3Adb8%3A1%3A2%3A%3A_64");
        assert_eq!(key(&r, &at("::ffff:10.0.0.1")), "ip=10.0.0.1");
        // IPv4 clients translated by NAT64 / SIIT (RFC 6052 well-known prefix) are the
        // IPv4 clients, not one /64 shared by all of them.
        assert_eq!(key(&r, &at("64:ff9b::192.0.2.1")), "ip=192.0.2.1");
        assert_ne!(
            key(&r, &at("64:ff9b::192.0.2.1")),
            key(&r, &at("64:ff9b::198.51.100.9"))
        );
        // Neighbours of the prefix are IPv6 networks as any other.
        assert_eq!(key(&r, &at("64:ff9b:0:0:1::1")), "ip=64%3Aff9b%3A%3A_64");
        assert_eq!(key(&r, &at("64:ff9b:1::192.0.2.1")), "ip=64%3Aff9b%3A1%3A%3A_64");
        // Every host of a 6to4 network (2002:WWXX:YYZZ::/48) is its IPv4 host: cut to a
        // /64, one IPv4 host would have 65,536 counters.
        for ip in ["2002:c000:201::1", "2002:c000:201:1::1", "2002:c000:201:ffff:1:2:3:4"] {
            assert_eq!(key(&r, &at(ip)), "ip=192.0.2.1", "{ip}");
        }
        assert_eq!(key(&r, &at("2002:c633:6409::1")), "ip=198.51.100.9");
        // Neighbours of the prefix are IPv6 networks as any other.
        assert_eq!(key(&r, &at("2003:c000:201::1")), "ip=2003%3Ac000%3A201%3A%3A_64");
        // IPv4-translated addresses (RFC 2765) are their IPv4 clients.
        assert_eq!(key(&r, &at("::ffff:0:192.0.2.1")), "ip=192.0.2.1");
        assert_eq!(key(&r, &at("::fffe:0:192.0.2.1")), "ip=%3A%3A_64");
        // A Teredo client is its public IPv4 address (the last 32 bits, inverted), not the
        // relay server's /64 that every client of that server shares.
        assert_eq!(key(&r, &at("2001:0:4136:e378:8000:63bf:3fff:fdd2")), "ip=192.0.2.45");
        assert_eq!(key(&r, &at("2001:0:4136:e378:8000:ec77:cecc:9bf8")), "ip=49.51.100.7");
        assert_eq!(
            key(&r, &at("2001:1:4136:e378::1")),
            "ip=2001%3A1%3A4136%3Ae378%3A%3A_64"
        );
        // Link-local clients are cut to the prefix like any other: a client on the server's
        // link that takes a new address for each request gets no new counter.
        assert_eq!(key(&r, &at("fe80::a1")), "ip=fe80%3A%3A_64");
        assert_eq!(key(&r, &at("fe80::a1")), key(&r, &at("fe80::b2")));
        assert_eq!(
            KeyResolver::new(48).resolve(&r, &at("fe80::1:a1")),
            KeyResolution::Key("ip=fe80%3A%3A_48".into())
        );
        // A network-specific NAT64 prefix, when configured, as the well-known one; its
        // neighbours are IPv6 networks as any other.
        let nsp = KeyResolver::default().with_nat64_prefix("2001:db8:64::ffff:1".parse().unwrap());
        let by_nsp = |ip: &str| match nsp.resolve(&r, &at(ip)) {
            KeyResolution::Key(k) => k.to_string(),
            other => panic!("{other:?}"),
        };
        assert_eq!(by_nsp("2001:db8:64::192.0.2.1"), "ip=192.0.2.1");
        assert_eq!(by_nsp("2001:db8:64::c633:6407"), "ip=198.51.100.7");
        assert_eq!(by_nsp("64:ff9b::192.0.2.1"), "ip=192.0.2.1");
        assert_eq!(by_nsp("2001:db8:64:0:1::1"), "ip=2001%3Adb8%3A64%3A%3A_64");
        assert_eq!(key(&r, &at("2001:db8:64::192.0.2.1")), "ip=2001%3Adb8%3A64%3A%3A_64");
        assert_eq!(nsp.nat64_prefix(), Some("2001:db8:64::".parse().unwrap()));
        assert_eq!(nsp.with_ipv6_prefix(48).nat64_prefix(), nsp.nat64_prefix());
        for ip in ["0.0.0.0", "255.255.255.255", "10.100.9.199", "1.20.30.4"] {
            assert_eq!(key(&r, &at(ip)), format!("ip={ip}"));
        }
        let exact = KeyResolver::new(128);
        assert_ne!(
            exact.resolve(&r, &at("2001:db8::1")),
            exact.resolve(&r, &at("2001:db8::2"))
        );
    }
}
