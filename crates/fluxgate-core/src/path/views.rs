//! The views of a request's path that rules match: as routed, trimmed, decoded, flattened
//! at `%2F` and clamped at a wildcard's root.

use super::*;

/// A request's paths, as rules' patterns match them: the normalized path, split into
/// segments only when a pattern needs them (see [`PathPattern::matches_normalized`]), and
/// the segments of the path as routed when it differs.
pub(crate) struct RequestPaths<'a> {
    pub(super) normalized: &'a str,
    segments: OnceCell<SmallVec<[&'a str; 16]>>,
    routed: Option<&'a [&'a str]>,
    /// The views of [`with_decoded_views`], for a path with escapes.
    decoded: Option<DecodedViews<'a>>,
    /// The views of [`with_clamped_views`], for a path with a `..` segment.
    clamped: Vec<Vec<&'a str>>,
    /// Whether the path is longer than [`LONGEST_MATCHED_PATH`]: every pattern matches it.
    too_long: bool,
}

/// The longest path, in bytes, that patterns are matched against. A longer one (as
/// normalized or as routed, without its query) is refused by the engine when its rule set
/// has rules that match paths ([`Error::Refused`](crate::Error::Refused): the layer answers
/// `400`), and limited by the layer whatever `include` and `exclude` say; elsewhere (a
/// fallback handler charging its local engine) it is matched by every pattern. Matching a
/// path against each view costs time in proportion to its length, and a client may send a
/// path of up to 64 KiB (hyper's limit over HTTP/1.1): against a few patterns with
/// wildcards, tens of milliseconds per request, where one of this bound built to make views
/// costs a few hundred microseconds at most (`cargo bench --bench engine -- long_paths`).
/// No route of an ordinary application is that long.
pub const LONGEST_MATCHED_PATH: usize = 4096;

/// Whether a request's path is longer than [`LONGEST_MATCHED_PATH`].
pub fn is_too_long(ctx: &RequestContext) -> bool {
    ctx.longest_path_len() > LONGEST_MATCHED_PATH
}

impl<'a> RequestPaths<'a> {
    /// A normalized path alone (no routed path that differs).
    pub(crate) fn normalized(normalized: &'a str) -> Self {
        Self {
            normalized,
            segments: OnceCell::new(),
            routed: None,
            decoded: None,
            clamped: Vec::new(),
            too_long: false,
        }
    }

    /// The segments of the normalized path, split on first use.
    pub(super) fn normalized_segments(&self) -> &[&'a str] {
        self.segments
            .get_or_init(|| self.normalized.split('/').filter(|s| !s.is_empty()).collect())
    }

    /// The segments of the path as routed, when it differs from the normalized path.
    pub(crate) fn routed(&self) -> Option<&[&'a str]> {
        self.routed
    }

    /// For a path with escapes, its decoded views (see [`with_decoded_views`]).
    pub(crate) fn decoded(&self) -> Option<DecodedViews<'a>> {
        self.decoded
    }

    /// Whether the path is too long to be matched: every pattern matches it.
    pub(crate) fn too_long(&self) -> bool {
        self.too_long
    }

    /// For a path with a `..` segment, its clamped views (see [`with_clamped_views`]).
    pub(crate) fn clamped(&self) -> &[Vec<&'a str>] {
        &self.clamped
    }
}

/// Runs `f` with a request's paths: its normalized path and, when it differs, the segments
/// of its path as routed; without allocating for usual paths.
pub(crate) fn with_paths<R>(ctx: &RequestContext, f: impl FnOnce(&RequestPaths<'_>) -> R) -> R {
    let normalized = ctx.path();
    if is_too_long(ctx) {
        // Matched by every pattern (see `LONGEST_MATCHED_PATH`): no view is worked out.
        return f(&RequestPaths {
            too_long: true,
            ..RequestPaths::normalized(normalized)
        });
    }
    match ctx.distinct_routed_path() {
        // A normalized path keeps `%2F` (a path with other escapes differs from its
        // normalized form): the flattened view.
        None if normalized.contains('%') => decoded_views(normalized, |decoded| {
            let clamped = clamped_views(decoded.routed);
            f(&RequestPaths {
                normalized,
                segments: OnceCell::new(),
                routed: None,
                decoded: Some(decoded),
                clamped,
                too_long: false,
            })
        }),
        None => f(&RequestPaths::normalized(normalized)),
        Some(raw) => with_routed_segments(raw, |routed| {
            if !raw.contains('%') {
                let clamped = clamped_views(routed);
                return f(&RequestPaths {
                    normalized,
                    segments: OnceCell::new(),
                    routed: Some(routed),
                    decoded: None,
                    clamped,
                    too_long: false,
                });
            }
            decoded_views(raw, |decoded| {
                let clamped = clamped_views(decoded.routed);
                f(&RequestPaths {
                    normalized,
                    segments: OnceCell::new(),
                    routed: Some(routed),
                    decoded: Some(decoded),
                    clamped,
                    too_long: false,
                })
            })
        }),
    }
}

/// The views of a path that has escapes, with them decoded (see [`with_decoded_views`]).
#[derive(Debug, Clone, Copy)]
pub struct DecodedViews<'a> {
    /// Its segments as routed, each decoded as [`normalize_path`] decodes them (`%2F`
    /// kept): what a route's parameters hold. axum routes `/api/x/../Caf%C3%A9` to an
    /// `/api/{version}/{page}` handler with `version = ".."` and `page = "Caf\u{e9}"`.
    pub routed: &'a [&'a str],
    /// The path with `%2F` decoded as a `/`, then split as routed (each segment decoded,
    /// dot segments kept): what a wildcard parameter holds. `/files/{*rest}` gets
    /// `private/x/../y` from `/files/private%2Fx/../y`.
    pub flattened_routed: &'a [&'a str],
    /// The path with `%2F` decoded as a `/`, then normalized, in segments: what a handler
    /// or a file server that resolves the wildcard's dot segments reads (`private/y`).
    pub flattened: &'a [&'a str],
}

/// Runs `f` with the views of a path that has escapes ([`DecodedViews`]); `None` for a
/// path without.
///
/// ```
/// use fluxgate_core::path::with_decoded_views;
/// let views = with_decoded_views("/api/x/../Caf%C3%A9/a%2Fb/..", |v| {
///     (v.routed.join("|"), v.flattened_routed.join("|"), v.flattened.join("|"))
/// });
/// assert_eq!(
///     views,
///     Some((
///         "api|x|..|Caf\u{e9}|a%2Fb|..".to_owned(),
///         "api|x|..|Caf\u{e9}|a|b|..".to_owned(),
///         "api|Caf\u{e9}|a".to_owned()
///     ))
/// );
/// assert!(with_decoded_views("/api/../login", |_| ()).is_none());
/// ```
pub fn with_decoded_views<R>(raw_path: &str, f: impl FnOnce(DecodedViews<'_>) -> R) -> Option<R> {
    let path = raw_path.find(['?', '#']).map_or(raw_path, |end| &raw_path[..end]);
    path.contains('%').then(|| decoded_views(path, f))
}

pub(super) fn decoded_views<R>(raw_path: &str, f: impl FnOnce(DecodedViews<'_>) -> R) -> R {
    let path = raw_path.find(['?', '#']).map_or(raw_path, |end| &raw_path[..end]);
    let decode = |path: &str| -> Vec<String> {
        routed_segments(path)
            .into_iter()
            .map(|segment| decode_escapes(segment).into_owned())
            .collect()
    };
    // A `%` that starts `%2F` is never part of an escape before it (whose digits are hex),
    // so replacing the text decodes exactly the escapes of `/`.
    let slashes = path.replace("%2F", "/").replace("%2f", "/");
    let (routed, flattened_routed) = (decode(path), decode(&slashes));
    let flattened = normalize_slow(&slashes);
    let routed: Vec<&str> = routed.iter().map(String::as_str).collect();
    let flattened_routed: Vec<&str> = flattened_routed.iter().map(String::as_str).collect();
    let flattened: Vec<&str> = flattened.split('/').filter(|s| !s.is_empty()).collect();
    f(DecodedViews {
        routed: &routed,
        flattened_routed: &flattened_routed,
        flattened: &flattened,
    })
}

/// The most positions [`with_clamped_views`] takes for a wildcard's root: the depth of a
/// route's wildcard parameter, counted in segments.
pub(super) const CLAMPED_ROOTS: usize = 16;

/// Runs `f` with the *clamped* views of a path that has a dot or empty segment, or a `%2F`
/// (none for another): for each position `k` (up to 16) where a wildcard parameter may
/// begin, the segments before `k` as they are, then those after read as the wildcard holds
/// them (`%2F` a `/`), as they are and cleaned (empty and `.` segments dropped, `..`
/// resolved, never above `k`), when that changes them. A handler that cleans its wildcard against its own
/// root reads that: `/files/{*rest}` gets `../private/x` from `/files/../private/x` and
/// serves `private/x`, and `/files/private/**` counts it. The segments are those of the
/// path as routed, escapes decoded but `%2F`, and the same trimmed of the empty segments at
/// either end, as a trimming middleware routes them.
///
/// ```
/// use fluxgate_core::path::with_clamped_views;
/// let views = |path| with_clamped_views(path, |views| views.iter().map(|v| v.join("|")).collect::<Vec<_>>());
/// // A wildcard after `/files`, after `/files/a`, after `/files/a/..`.
/// assert_eq!(views("/files/a/../../private/x"), ["files|private|x", "files|a|private|x", "files|a|..|private|x"]);
/// assert!(views("/files/a%2F..%2F..%2Fprivate/x").contains(&"files|private|x".to_owned()));
/// // A `%2F` in the parameter and in the wildcard's part, no dots: the part split at it.
/// assert!(views("/api/a%2Fb/files/private%2Fx").contains(&"api|a%2Fb|files|private|x".to_owned()));
/// // A parameter before the wildcard keeps its own `.` and `%2F`.
/// assert!(views("/api/./files/./private/x").contains(&"api|.|files|private|x".to_owned()));
/// assert!(views("/api/a%2Fb/files/../private/x").contains(&"api|a%2Fb|files|private|x".to_owned()));
/// assert!(views("/files/a/b").is_empty());
/// ```
pub fn with_clamped_views<R>(raw_path: &str, f: impl FnOnce(&[Vec<&str>]) -> R) -> R {
    let path = raw_path.find(['?', '#']).map_or(raw_path, |end| &raw_path[..end]);
    if path.contains('%') {
        return decoded_views(path, |views| f(&clamped_views(views.routed)));
    }
    with_routed_segments(path, |segments| f(&clamped_views(segments)))
}

/// See [`with_clamped_views`]: no view (and no allocation) without a dot or empty segment.
/// `segments` are the routed segments, decoded with `%2F` kept (a parameter before the
/// wildcard holds it whole); the wildcard's part is read with `%2F` as `/`. Also cut from
/// the trimmed segments, as a trimming middleware routes them.
pub(super) fn clamped_views<'a>(segments: &[&'a str]) -> Vec<Vec<&'a str>> {
    let dotted = |s: &str| matches!(s, "" | "." | "..");
    if !segments.iter().any(|s| dotted(s) || find_escaped_slash(s).is_some()) {
        return Vec::new();
    }
    let mut views = Views::default();
    // Work per request in proportion to the path's length times the number of roots: each
    // segment is split at `%2F` once, and what the rest after a root holds is read from
    // the end once, not for each root.
    let (mut pieces, mut starts, mut resolved) = (Vec::new(), Vec::new(), Vec::new());
    let bases = std::iter::once(segments).chain(trimmed(segments));
    for base in bases {
        pieces.clear();
        starts.clear();
        for segment in base {
            starts.push(pieces.len());
            split_escaped_slash(segment, &mut pieces);
        }
        // Whether the segments from `i` on hold a `%2F`, and the pieces from `j` on a dot or
        // empty segment.
        let mut slash_from = vec![false; base.len() + 1];
        for i in (0..base.len()).rev() {
            slash_from[i] = slash_from[i + 1] || find_escaped_slash(base[i]).is_some();
        }
        let mut dotted_from = vec![false; pieces.len() + 1];
        for j in (0..pieces.len()).rev() {
            dotted_from[j] = dotted_from[j + 1] || dotted(pieces[j]);
        }
        for k in 1..base.len().min(CLAMPED_ROOTS + 1) {
            let root = &base[..k];
            let rest = &pieces[starts[k]..];
            let flattened = slash_from[k];
            if !dotted_from[starts[k]] && !flattened {
                continue;
            }
            // The wildcard's part read with `%2F` as `/`, not cleaned, the root as it is: the
            // same view as the root one segment shorter gives unless that segment holds a
            // `%2F` (it is one piece either way), so made only then.
            if flattened && (k == 1 || find_escaped_slash(base[k - 1]).is_some()) {
                let split: Vec<&'a str> = root.iter().chain(rest).copied().collect();
                views.push(split);
            }
            resolved.clear();
            resolved.extend_from_slice(root);
            for &segment in rest {
                match segment {
                    "" | "." => {}
                    ".." if resolved.len() > k => {
                        resolved.pop();
                    }
                    ".." => {}
                    segment => resolved.push(segment),
                }
            }
            views.push_copy(&resolved);
        }
    }
    views.all
}

/// Views kept once each, in the order first given: each is compared whole only with those
/// of the same digest, so that keeping many long views costs a digest of each, not a
/// comparison of each with every other.
#[derive(Default)]
pub(super) struct Views<'a> {
    all: Vec<Vec<&'a str>>,
    hashes: Vec<u64>,
}

impl<'a> Views<'a> {
    fn find(&self, view: &[&'a str]) -> (u64, bool) {
        // A digest of each segment's length and first and last bytes (at most eight each):
        // the same for equal views, cheap for thousands of short segments. Views of the same
        // digest are compared whole.
        let word = |bytes: &[u8]| bytes.iter().fold(0u64, |w, &b| w << 8 | u64::from(b));
        let hash = view.iter().fold(view.len() as u64, |h, segment| {
            let bytes = segment.as_bytes();
            let (first, last) = (&bytes[..bytes.len().min(8)], &bytes[bytes.len().saturating_sub(8)..]);
            let mixed = (h ^ bytes.len() as u64).rotate_left(17) ^ word(first) ^ word(last).rotate_left(32);
            mixed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        });
        let found = self
            .hashes
            .iter()
            .zip(&self.all)
            .any(|(h, kept)| *h == hash && kept[..] == *view);
        (hash, found)
    }

    fn push(&mut self, view: Vec<&'a str>) {
        let (hash, found) = self.find(&view);
        if !found {
            self.all.push(view);
            self.hashes.push(hash);
        }
    }

    fn push_copy(&mut self, view: &[&'a str]) {
        let (hash, found) = self.find(view);
        if !found {
            self.all.push(view.to_vec());
            self.hashes.push(hash);
        }
    }
}

/// Where `%2F` first stands in `s`.
pub(super) fn find_escaped_slash(s: &str) -> Option<usize> {
    s.as_bytes().windows(3).position(|w| w == b"%2F")
}

/// Appends the parts of `s` between its `%2F`s to `out`, as `s.split("%2F")` gives them.
pub(super) fn split_escaped_slash<'a>(s: &'a str, out: &mut Vec<&'a str>) {
    let mut rest = s;
    while let Some(at) = find_escaped_slash(rest) {
        out.push(&rest[..at]);
        rest = &rest[at + 3..];
    }
    out.push(rest);
}

/// Runs `f` with the segments of a path as a router sees it (see [`routed_segments`]).
pub(crate) fn with_routed_segments<'a, R>(raw_path: &'a str, f: impl FnOnce(&[&'a str]) -> R) -> R {
    let path = raw_path.find(['?', '#']).map_or(raw_path, |end| &raw_path[..end]);
    let path = path.strip_prefix('/').unwrap_or(path);
    if path.is_empty() {
        return f(&[]);
    }
    with_split(path.split('/'), f)
}

pub(super) fn with_split<'a, R>(parts: impl Iterator<Item = &'a str> + Clone, f: impl FnOnce(&[&'a str]) -> R) -> R {
    let mut buf = [""; 16];
    let mut n = 0;
    for s in parts.clone() {
        if n == buf.len() {
            let all: Vec<&str> = parts.collect();
            return f(&all);
        }
        buf[n] = s;
        n += 1;
    }
    f(&buf[..n])
}

/// The segments of a path as routed without the empty last segment that a trailing `/`
/// leaves, when the path ends in one. Patterns ignore their own trailing `/` (`/items/*/` is
/// `/items/*`), so rules also match the routed path without it: a route that ends in `/`
/// after a parameter (axum's `/items/{id}/`) runs for `/items//`, `/items/./` and
/// `/items/../` (`id` empty, `.` and `..`), whose normalized paths (`/items`, `/`) its
/// pattern does not match, and whose routed segments end in an empty one that the pattern
/// no longer has.
///
/// ```
/// use fluxgate_core::path::{routed_segments, without_trailing_slash};
/// assert_eq!(without_trailing_slash(&routed_segments("/items//")), Some(&["items", ""][..]));
/// assert_eq!(without_trailing_slash(&routed_segments("/items/x")), None);
/// ```
pub fn without_trailing_slash<'s, 'a>(segments: &'s [&'a str]) -> Option<&'s [&'a str]> {
    match segments.split_last() {
        Some((&"", rest)) => Some(rest),
        _ => None,
    }
}

/// The segments of a path as routed without the empty segments that runs of `/` at its
/// start and end leave, when it has any: the path a router sees behind a middleware that
/// trims them (tower-http's `NormalizePathLayer` turns `//api/../login/` into
/// `/api/../login`). Rules also match the routed path so, in case such a middleware stands
/// between the layer and the router: the layer then sees the path before it is trimmed.
///
/// ```
/// use fluxgate_core::path::{routed_segments, trimmed};
/// assert_eq!(trimmed(&routed_segments("//api/../login//")), Some(&["api", "..", "login"][..]));
/// assert_eq!(trimmed(&routed_segments("/api/../login")), None);
/// ```
pub fn trimmed<'s, 'a>(segments: &'s [&'a str]) -> Option<&'s [&'a str]> {
    let start = segments.iter().position(|s| !s.is_empty()).unwrap_or(segments.len());
    let end = segments
        .iter()
        .rposition(|s| !s.is_empty())
        .map_or(start, |last| last + 1);
    (start > 0 || end < segments.len()).then(|| &segments[start..end])
}

/// The segments of a path as a router sees it, which is what decides the handler that
/// runs: the query and fragment dropped, the leading `/` dropped, then (unless nothing is
/// left) split at every `/`, with empty, `.` and `..` segments kept and nothing percent-decoded. axum (through
/// `matchit`) routes `/api/../login`, `/api//login` and `/api/%2e%2e/login` to a
/// `/api/{version}/login` handler, with `version` set to `..`, the empty string and `..`.
///
/// ```
/// use fluxgate_core::path::routed_segments;
/// assert_eq!(routed_segments("/api/../login"), ["api", "..", "login"]);
/// assert_eq!(routed_segments("/api//login/"), ["api", "", "login", ""]);
/// assert!(routed_segments("/").is_empty());
/// ```
pub fn routed_segments(raw_path: &str) -> Vec<&str> {
    with_routed_segments(raw_path, <[&str]>::to_vec)
}
