//! The in-memory limiter keys the engine's address and global keys by their typed value,
//! without their text: it must count every request under the same bucket as the key's text
//! would, beside rules keyed by user ids and API keys of every kind.

use std::net::IpAddr;
use std::sync::Arc;

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest, RateLimiter};
use fluxgate_core::{BoxError, Engine, MaybeReady, MemoryLimiter, RequestContext, RuleSets, Text};

use crate::support::backend::Around;

/// A limiter that hands the in-memory limiter each request rebuilt from its buckets' key
/// texts alone, so that it keys them by their text rather than their typed value. Local,
/// as the in-memory limiter is: the engine takes no lease through it.
#[derive(Debug, Default)]
pub(crate) struct ByText(pub(crate) MemoryLimiter);

impl RateLimiter for ByText {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let set = request.rule_set().clone();
        let mut by_text = AcquireRequest::new(set.clone());
        for bucket in request.buckets() {
            let rule = set
                .rules()
                .iter()
                .position(|r| std::ptr::eq(r, bucket.rule))
                .expect("the rule of one of its buckets");
            assert!(!bucket.key.is_empty(), "a limiter that reads key texts gets them");
            by_text.push_permits(rule, Text::from(bucket.key.as_str()), bucket.permits);
        }
        self.0.acquire(&by_text)
    }

    fn is_local(&self) -> bool {
        true
    }
}

const RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 3, window: 1h }]
      - id: per-user-else-ip
        scope: user
        on_missing_key: fallback_ip
        bands: [{ capacity: 5, window: 1h }, { capacity: 4, window: 2h }]
      - id: global
        scope: global
        bands: [{ capacity: 400, window: 1h }]
      - id: per-api-key
        scope: api_key
        on_missing_key: skip
        bands: [{ capacity: 6, window: 1h }]
"#;

/// User ids and API keys: ones the key's text encodes (`%`, a space, a non-ASCII
/// character), ones that read like another key's text, a header value that is not UTF-8
/// (`\0` then its bytes; `\0` alone, an ambiguous header, is refused by the rules that
/// read it), and ones past the length whose text is a digest.
fn identities() -> Vec<String> {
    let mut ids: Vec<String> = [
        "user-0",
        "user-1",
        "a b",
        "a%20b",
        "ip=192.0.2.1",
        "user=x",
        "\0\u{e9}",
        "é",
        "ключ",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    ids.push("x".repeat(64));
    ids.push("x".repeat(65));
    ids.push(format!("{}y", "x".repeat(200)));
    ids
}

/// The clients: IPv4 addresses that differ in one octet, IPv6 addresses of one /64 and of
/// neighbouring ones, an IPv4-mapped IPv6 address, one under the NAT64 well-known prefix and
/// two in the 6to4 network of an IPv4 client (each the IPv4 client itself), and none.
fn clients() -> Vec<Option<IpAddr>> {
    let mut clients: Vec<Option<IpAddr>> = Vec::new();
    for i in 0..24u8 {
        clients.push(Some(IpAddr::from([10, 0, i % 4, i])));
        clients.push(Some(
            format!("2001:db8:0:{}::{}", i % 3, i).parse().expect("an address"),
        ));
    }
    clients.push(Some("::ffff:10.0.1.5".parse().expect("an address")));
    clients.push(Some("64:ff9b::10.0.1.5".parse().expect("an address")));
    // Two hosts of the 6to4 network of 10.0.1.5, `2002:a00:105::/48`.
    clients.push(Some("2002:a00:105:1::1".parse().expect("an address")));
    clients.push(Some("2002:a00:105:2::1".parse().expect("an address")));
    clients.push(None);
    clients
}

#[test]
fn typed_keys_count_every_request_under_its_texts_bucket() {
    let rules = || RuleSets::from_yaml_str(RULES).unwrap();
    let typed = Engine::in_memory(rules());
    let by_text = Engine::builder(rules()).limiter(ByText::default()).build().unwrap();
    let clients = clients();
    let (mut admitted, mut refused) = (0, 0);
    // Each client in turn, with and without a user, until every bucket is empty.
    for round in 0..8 {
        for (i, ip) in clients.iter().enumerate() {
            let mut ctx = RequestContext::builder();
            if let Some(ip) = ip {
                ctx = ctx.client_ip(*ip);
            }
            let ids = identities();
            if (i + round) % 3 == 0 {
                ctx = ctx.user_id(ids[i % ids.len()].clone());
            }
            if (i + round) % 2 == 0 {
                ctx = ctx.api_key(ids[(i + 3) % ids.len()].clone());
            }
            let ctx = ctx.build();
            let a = typed.check(&ctx).into_ready().unwrap().unwrap();
            let b = by_text.check(&ctx).into_ready().unwrap().unwrap();
            let figures = |d: &fluxgate_core::Decision| {
                (
                    d.allowed(),
                    d.bands.iter().map(|b| (b.remaining, b.allowed)).collect::<Vec<_>>(),
                )
            };
            assert_eq!(figures(&a), figures(&b), "round {round}, client {ip:?}");
            if a.allowed() {
                admitted += 1;
            } else {
                refused += 1;
            }
        }
    }
    // Both kinds of decision were compared.
    assert!(admitted > 50 && refused > 50, "{admitted} admitted, {refused} refused");
}

#[test]
fn typed_keys_of_two_engines_sharing_a_limiter_are_apart_by_their_ipv6_prefix() {
    let limiter = Arc::new(MemoryLimiter::default());
    let rules = || RuleSets::from_yaml_str(RULES).unwrap();
    let engine = |bits| {
        Engine::builder(rules())
            .shared_limiter(limiter.clone())
            .ipv6_prefix(bits)
            .build()
            .unwrap()
    };
    let (by_48, by_64) = (engine(48), engine(64));
    // An address whose bits past the 48th are zero: cut to either prefix it reads alike,
    // but the keys' texts differ (`_48`, `_64`), and so do the buckets.
    let ctx = RequestContext::builder()
        .client_ip("2001:db8:1::".parse().unwrap())
        .build();
    let per_ip = |e: &Engine| e.check(&ctx).into_ready().unwrap().unwrap().bands[0].remaining;
    assert_eq!(per_ip(&by_48), 2);
    assert_eq!(per_ip(&by_64), 2);
    assert_eq!(per_ip(&by_48), 1);
}

/// A limiter that decides in memory but is not local, as one in front of a remote store
/// is: the engine takes local leases through it, and keys are written as text for it.
fn not_local() -> Around<MemoryLimiter> {
    Around::new(MemoryLimiter::default(), |memory, request| memory.acquire(request))
}

/// A per-IP rule with a lease, and a rule of `/slow` that waits for the refill: a request
/// to `/slow` may wait, and is decided by the limiter without the leases.
const LEASED_AND_WAITING: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: leased
        algorithm: fixed_window
        bands: [{ capacity: 10, window: 1h }]
        lease: { max: 5, ttl: 1h }
      - id: slow
        match: { paths: ["/slow"] }
        bands: [{ capacity: 1000, window: 1h }]
        on_limit: { wait: { max_wait: 1s, max_waiters: 10 } }
"#;

fn at(path: &str) -> RequestContext {
    RequestContext::builder()
        .client_ip("192.0.2.7".parse().expect("an address"))
        .path(path)
        .build()
}

/// The calls taking a lease count in the bucket of the engine's requests of the same key,
/// typed as they are: a client whose requests go by the lease and by the limiter alone
/// is admitted the capacity once, not once by each way.
#[tokio::test]
async fn a_lease_call_counts_in_the_bucket_of_the_typed_key() {
    let engine = Engine::builder(RuleSets::from_yaml_str(LEASED_AND_WAITING).unwrap())
        .limiter(not_local())
        .build()
        .unwrap();
    let mut admitted = 0;
    for i in 0..40 {
        let path = if i % 2 == 0 { "/fast" } else { "/slow" };
        if engine.check(&at(path)).await.unwrap().allowed() {
            admitted += 1;
        }
    }
    assert!(admitted <= 10, "{admitted} admitted by a bucket of 10");
}

/// What a lease gives back goes to the bucket it was taken from, the one the engine's
/// requests of the same key count in.
#[tokio::test]
async fn a_lease_gives_back_to_the_bucket_of_the_typed_key() {
    let engine = Engine::builder(RuleSets::from_yaml_str(LEASED_AND_WAITING).unwrap())
        .limiter(not_local())
        .build()
        .unwrap();
    assert!(engine.check(&at("/fast")).await.unwrap().allowed());
    assert!(engine.release_leases().await.unwrap() > 0);
    // Decided by the limiter: the bucket counts the one request admitted by the lease.
    let decision = engine.check(&at("/slow")).await.unwrap();
    let leased = decision.bands.iter().find(|b| &*b.rule == "leased").unwrap();
    assert_eq!(leased.remaining, 8);
}

/// Look-alikes stay apart in the typed engine: every user id of [`identities`] (`a b` and
/// `a%20b`, one spelled as an address key's text, one as a user key's) has a bucket of its
/// own, and the user id `ip=<address>` is not the bucket of that address's requests without
/// a user, which the rule keys by the address (`fallback_ip`).
#[test]
fn look_alike_user_ids_and_addresses_count_apart() {
    let engine = Engine::in_memory(RuleSets::from_yaml_str(RULES).unwrap());
    let by_user = |d: &fluxgate_core::Decision| {
        d.bands
            .iter()
            .find(|b| &*b.rule == "per-user-else-ip" && b.limit == 5)
            .expect("the user rule's first band")
            .remaining
    };
    let from = |n: u8, user: Option<&str>| {
        let mut ctx = RequestContext::builder().client_ip(IpAddr::from([10, 9, 1, n]));
        if let Some(user) = user {
            ctx = ctx.user_id(user);
        }
        engine.check(&ctx.build()).into_ready().unwrap().unwrap()
    };
    // Two requests of 10.9.1.1 without a user: its address's bucket holds 3.
    for remaining in [4, 3] {
        assert_eq!(by_user(&from(1, None)), remaining);
    }
    let mut ids = identities();
    ids.push("ip=10.9.1.1".to_owned());
    for (n, id) in (2..).zip(&ids) {
        let first = from(n, Some(id));
        assert!(first.allowed(), "user {id:?}");
        assert_eq!(by_user(&first), 4, "user {id:?}: a bucket of its own, first request");
    }
    // And none of them spent the address's bucket.
    assert_eq!(by_user(&from(1, None)), 2);
}
