//! Path normalization and Ant-style path patterns.
//!
//! A rule's patterns are matched against views of a request's path: the normalized path
//! ([`normalize_path`]), the path as a router sees it ([`routed_segments`], also tried
//! [`without_trailing_slash`], as patterns ignore their own, and [`trimmed`], as a
//! path-trimming middleware rewrites it), and, for a path with escapes, the same with
//! them decoded ([`with_decoded_views`]). A rule applies when any matches, so
//! normalization can only add rules to a request, never take one away. A pattern's own
//! escapes are decoded as a path's are.

use std::cell::OnceCell;
use std::fmt;
use std::str::FromStr;

use smallvec::SmallVec;

use crate::context::RequestContext;
use crate::text::Text;

mod normalize;
mod pattern;
mod views;

pub use normalize::*;
pub use pattern::*;
pub use views::*;

#[cfg(test)]
mod tests {
    use super::*;

    /// A generator of numbers below a bound, from `seed` (a linear congruential one: the
    /// random cases below are the same on every run).
    fn below(mut seed: u64) -> impl FnMut(usize) -> usize {
        move |n| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) as usize % n
        }
    }

    /// The clamped views as first written (each root's rest split and searched anew, each
    /// view compared with every other kept), against the views made now, over random
    /// segments of dots, empty segments, `%2F` and words: the same views in the same order.
    #[test]
    fn clamped_views_are_those_of_the_plain_construction() {
        fn plain<'a>(segments: &[&'a str]) -> Vec<Vec<&'a str>> {
            let dotted = |s: &&str| matches!(*s, "" | "." | "..");
            if !segments.iter().any(dotted) && !segments.iter().any(|s| s.contains("%2F")) {
                return Vec::new();
            }
            let mut views: Vec<Vec<&'a str>> = Vec::new();
            for base in std::iter::once(segments).chain(trimmed(segments)) {
                for k in 1..base.len().min(CLAMPED_ROOTS + 1) {
                    let (root, rest) = base.split_at(k);
                    let flattened = rest.iter().any(|s| s.contains("%2F"));
                    let rest: Vec<&'a str> = rest.iter().flat_map(|s| s.split("%2F")).collect();
                    if !rest.iter().any(dotted) && !flattened {
                        continue;
                    }
                    if flattened {
                        let split: Vec<&'a str> = root.iter().copied().chain(rest.iter().copied()).collect();
                        if !views.contains(&split) {
                            views.push(split);
                        }
                    }
                    let mut resolved: Vec<&'a str> = root.to_vec();
                    for segment in rest {
                        match segment {
                            "" | "." => {}
                            ".." if resolved.len() > k => {
                                resolved.pop();
                            }
                            ".." => {}
                            segment => resolved.push(segment),
                        }
                    }
                    if !views.contains(&resolved) {
                        views.push(resolved);
                    }
                }
            }
            views
        }
        let words = [
            "",
            ".",
            "..",
            "a",
            "b",
            "a%2Fb",
            "%2F",
            "..%2F..",
            "a%2F",
            "%2F.",
            "x%2Fy%2Fz",
        ];
        let mut next = below(0xc1a3);
        let mut with_views = 0;
        for _ in 0..5_000 {
            let len = next(24);
            let segments: Vec<&str> = (0..len).map(|_| words[next(words.len())]).collect();
            let expected = plain(&segments);
            with_views += usize::from(!expected.is_empty());
            assert_eq!(clamped_views(&segments), expected, "{segments:?}");
        }
        assert!(with_views > 2_000, "{with_views}");
    }

    /// The segment matcher against a plain recursive one (`**` takes zero or more segments,
    /// every other segment one), over every pattern of up to five segments and path of up to
    /// six drawn from a few: the last `**`'s tail tried at the path's end alone changes no
    /// answer.
    #[test]
    fn segments_match_as_by_recursion() {
        fn reference(pat: &[Segment], path: &[&str]) -> bool {
            match pat.split_first() {
                None => path.is_empty(),
                Some((Segment::AnyDepth, rest)) => (0..=path.len()).any(|i| reference(rest, &path[i..])),
                Some((segment, rest)) => path
                    .split_first()
                    .is_some_and(|(s, tail)| segment_matches(segment, s) && reference(rest, tail)),
            }
        }
        let pieces = [
            Segment::AnyDepth,
            Segment::Literal("a".into(), None),
            Segment::Literal("b".into(), None),
            Segment::Glob(vec!['*'], None),
            Segment::Glob(vec!['a', '*'], None),
        ];
        let words = ["a", "b", "ab", ""];
        let mut checked = 0;
        let mut next = below(0x5eed);
        for _ in 0..20_000 {
            let pat: Vec<Segment> = (0..next(6)).map(|_| pieces[next(pieces.len())].clone()).collect();
            let path: Vec<&str> = (0..next(7)).map(|_| words[next(words.len())]).collect();
            assert_eq!(
                matches_segments_by(&pat, &path, segment_matches),
                reference(&pat, &path),
                "{pat:?} against {path:?}"
            );
            checked += 1;
        }
        assert_eq!(checked, 20_000);
    }

    fn p(s: &str) -> PathPattern {
        s.parse().unwrap()
    }

    /// The one-pass check of a normal path gives what the general one gives (the query
    /// cut, then [`is_normal`]) on every string of up to six bytes of an alphabet of the bytes
    /// it stops at, an ordinary byte and a byte of a longer character.
    #[test]
    fn the_one_pass_check_agrees_with_the_general_one() {
        let alphabet = ["/", ".", "%", "?", "#", "a", "é"];
        let mut paths = vec![String::new()];
        let mut start = 0;
        for _ in 0..6 {
            let end = paths.len();
            for i in start..end {
                for c in alphabet {
                    paths.push(format!("{}{c}", paths[i]));
                }
            }
            start = end;
        }
        for raw in &paths {
            let cut = raw.find(['?', '#']).map_or(raw.as_str(), |end| &raw[..end]);
            let expected = is_normal(cut).then_some(cut);
            let fast = normal_prefix(raw);
            assert_eq!(fast, expected, "{raw:?}");
            assert_eq!(&*normalized_and_routed(raw).0, normalize_slow(cut), "{raw:?}");
        }
        assert_eq!(normal_prefix("/api/items"), Some("/api/items"));
        assert_eq!(normal_prefix("/api/v1.2/x?y"), Some("/api/v1.2/x"));
        assert_eq!(normal_prefix("/a/.b/..c"), Some("/a/.b/..c"));
    }

    #[test]
    fn normalization() {
        for raw in [
            "/api//users",
            "/api/./users",
            "/api/x/../users",
            "api/users",
            "/api/users/",
            "//api///users//",
        ] {
            assert_eq!(normalize_path(raw), "/api/users", "{raw}");
        }
        assert_eq!(normalize_path(""), "/");
        assert_eq!(normalize_path("/../.."), "/");
        assert_eq!(normalize_path("/a%2Fb"), "/a%2Fb");
        assert_eq!(normalize_path("/a%2fb"), "/a%2Fb");
        // A `%` that starts no escape is one: decoding cannot make a new escape after it.
        assert_eq!(normalize_path("/a%zz"), "/a%25zz");
        assert_eq!(normalize_path("/a%"), "/a%25");
        assert_eq!(normalize_path("/a%4"), "/a%254");
        assert_eq!(normalize_path("/%%34%31"), "/%2541");
        assert_eq!(normalize_path("/a/%%32%65%%32%65/b"), "/a/%252e%252e/b");
        assert_eq!(normalize_path("/caf\u{e9}/%41"), "/caf\u{e9}/A");
        // Every escape is decoded as a router decodes a parameter, but those that would
        // change the path's structure or cannot be written as themselves.
        assert_eq!(normalize_path("/caf%C3%A9/caf%c3%a9"), "/caf\u{e9}/caf\u{e9}");
        assert_eq!(normalize_path("/a%3Ab%40c%2Bd%20e"), "/a:b@c+d e");
        assert_eq!(normalize_path("/a%2f%25%3f%23b"), "/a%2F%25%3F%23b");
        assert_eq!(normalize_path("/a%00%7f%C2%85"), "/a%00%7F\u{85}");
        assert_eq!(normalize_path("/a\u{85}"), normalize_path("/a%c2%85"));
        assert_eq!(normalize_path("/a%C3/%A9%ff%C3%28"), "/a%C3/%A9%FF%C3(");
        assert_eq!(normalize_path("/%E2%82%AC%E2%82"), "/\u{20ac}%E2%82");
        // Normalizing twice changes nothing.
        for raw in [
            "/%%34%31",
            "/a/%%32%65%%32%65/b",
            "/%%41e",
            "/%2f%2F%",
            "/x/%2e%2E/../%%2e",
            "/a%C3%25A9",
            "/%C3%2F%A9",
            "/%E2%82%C2%80x",
            "/%C3\u{e9}",
            "/%2e%2E%2F..",
        ] {
            let once = normalize_path(raw);
            assert_eq!(normalize_path(&once), once, "{raw}");
        }
        assert_eq!(normalize_path("/x/%2E%2E/api/users#frag"), "/api/users");
        for normal in [
            "/",
            "/a",
            "/a/b",
            "/.well-known/x",
            "/a/..b",
            "/a/b.",
            "/a/.../b",
            "/a/b..c",
        ] {
            assert!(is_normal(normal), "{normal}");
            assert_eq!(normalize_path(normal), normal);
        }
        for not in [
            "", "a", "/a/", "//a", "/a//b", "/./a", "/a/.", "/a/..", "/../a", "/a/%41",
        ] {
            assert!(!is_normal(not), "{not}");
        }
    }

    #[test]
    fn patterns() {
        assert!(p("/api/users").matches("/api/users"));
        assert!(!p("/api/users").matches("/api/users/1"));
        assert!(p("/api/*").matches("/api/users"));
        assert!(!p("/api/*").matches("/api/users/1"));
        assert!(p("/api/**").matches("/api"));
        assert!(p("/api/**").matches("/api/a/b/c"));
        assert!(!p("/api/**").matches("/apix"));
        assert!(p("/**").matches("/"));
        assert!(p("/**").matches("/anything/at/all"));
        assert!(p("/api/v?/users").matches("/api/v1/users"));
        assert!(!p("/api/v?/users").matches("/api/v10/users"));
        assert!(p("/api/*.json").matches("/api/data.json"));
        assert!(p("/a/**/b/**/c").matches("/a/x/b/y/z/c"));
        assert!(p("/a/**/b/**/c").matches("/a/b/c"));
        assert!(!p("/a/**/b/**/c").matches("/a/c/b"));
        assert!(p("/u/*x*y").matches("/u/axbxy"));
        let deep = "/s".repeat(40);
        assert!(p("/**/s").matches(&deep));
        assert!(!p("/**/t").matches(&deep));
    }

    /// A pattern's escapes are decoded as a path's: it matches every spelling of the path
    /// it names in the normalized view, and in the routed view its own spelling too.
    #[test]
    fn escaped_patterns() {
        for pattern in ["/wiki/Caf\u{e9}", "/wiki/Caf%C3%A9", "/wiki/Caf%c3%a9"] {
            assert!(p(pattern).matches(&normalize_path("/wiki/Caf%C3%A9")), "{pattern}");
            assert!(p(pattern).matches("/wiki/Caf\u{e9}"), "{pattern}");
            assert!(p(pattern).matches_routed("/wiki/Caf\u{e9}"), "{pattern}");
        }
        assert!(p("/wiki/Caf%C3%A9").matches_routed("/wiki/Caf%C3%A9"));
        assert!(!p("/wiki/Caf\u{e9}").matches_routed("/wiki/Caf%C3%A9"));
        assert!(p("/a%2fb").matches(&normalize_path("/a%2Fb")));
        assert!(!p("/a/b").matches(&normalize_path("/a%2Fb")));
        assert!(p("/x/*:y").matches(&normalize_path("/x/a%3Ay")));
        assert!(p("/x/%3F").matches(&normalize_path("/x/%3f")));
    }

    #[test]
    fn decoded_views() {
        let views = |raw: &str| {
            with_decoded_views(raw, |v| {
                [v.routed, v.flattened_routed, v.flattened].map(|s| s.join("|"))
            })
        };
        assert_eq!(views("/a/b"), None);
        assert_eq!(views("/a/%41?x=%41"), Some(["a|A", "a|A", "a|A"].map(str::to_owned)));
        assert_eq!(
            views("/f/a%2Fb/"),
            Some(["f|a%2Fb|", "f|a|b|", "f|a|b"].map(str::to_owned))
        );
        assert_eq!(
            views("/f/p%2fx/../y"),
            Some(["f|p%2Fx|..|y", "f|p|x|..|y", "f|p|y"].map(str::to_owned))
        );
        assert_eq!(
            views("/f/%252F"),
            Some(["f|%252F", "f|%252F", "f|%252F"].map(str::to_owned))
        );
    }

    /// `?` is one character to the handler, an escape included, but in the raw view of an
    /// exclusion (as written).
    #[test]
    fn a_one_character_glob_takes_an_escape() {
        for raw in ["/wiki/x", "/wiki/%3F", "/wiki/%25", "/wiki/%23", "/wiki/%41"] {
            assert!(p("/wiki/?").matches(&normalize_path(raw)), "{raw}");
            assert!(p("/wiki/?").matches_routed(raw), "{raw}");
        }
        assert!(p("/wiki/a?b*").matches(&normalize_path("/wiki/a%3Fbcd")));
        assert!(p("/wiki/*%3F?").matches(&normalize_path("/wiki/x%3F%23")));
        assert!(!p("/wiki/?").matches(&normalize_path("/wiki/%3F%3F")));
        // A control character past ASCII is one character, raw or escaped.
        for raw in ["/wiki/%C2%85", "/wiki/%c2%9f", "/wiki/\u{85}"] {
            assert!(p("/wiki/?").matches(&normalize_path(raw)), "{raw}");
            assert!(p("/wiki/%C2%85").matches(&normalize_path("/wiki/\u{85}")), "{raw}");
        }
        assert!(!p("/wiki/?").matches_routed_as_written("/wiki/%3F"));
        assert!(p("/wiki/???").matches_routed_as_written("/wiki/%3F"));
    }

    /// A pattern that writes `%2F` also matches with it read as a `/`, but not as written.
    #[test]
    fn an_escaped_slash_in_a_pattern_is_also_a_slash() {
        let p = p("/files/a%2fb");
        for raw in ["/files/a%2Fb", "/files/a/b"] {
            assert!(p.matches(&normalize_path(raw)), "{raw}");
            assert!(p.matches_routed(raw), "{raw}");
        }
        assert!(p.matches_routed_as_written("/files/a%2fb"));
        assert!(!p.matches_routed_as_written("/files/a/b"));
        assert!("/files/a%2F..%2Fb".parse::<PathPattern>().is_ok());
    }

    #[test]
    fn malformed_patterns() {
        for bad in ["/a%2A", "/a/%2e%2E/b", "/%2e"] {
            assert!(bad.parse::<PathPattern>().is_err(), "{bad:?}");
        }
        for bad in ["", "api", "/api/a**", "/api/../x", "/a b"] {
            assert!(bad.parse::<PathPattern>().is_err(), "{bad:?}");
        }
    }
}
