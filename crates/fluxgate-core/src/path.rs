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

/// Normalizes a request path before any matching.
///
/// Drops the query and fragment, percent-decodes escapes as a router decodes its path
/// parameters (every escape but those of `/`, `%`, `?`, `#`, ASCII control characters and bytes
/// that are not UTF-8, which are kept with upper-case hex digits; a `%` that starts no
/// escape becomes `%25`), collapses repeated `/`, resolves `.` and `..` segments (never
/// above the root) and drops a trailing `/`. The result always starts with `/`, and
/// normalizing it again changes nothing.
///
/// ```
/// use fluxgate_core::path::normalize_path;
/// assert_eq!(normalize_path("/api//users"), "/api/users");
/// assert_eq!(normalize_path("/api/./users"), "/api/users");
/// assert_eq!(normalize_path("/api/x/../users?page=2"), "/api/users");
/// assert_eq!(normalize_path("/api/%75sers/"), "/api/users");
/// assert_eq!(normalize_path("/%2e%2e/admin"), "/admin");
/// assert_eq!(normalize_path("/wiki/Caf%C3%A9"), "/wiki/Caf\u{e9}");
/// assert_eq!(normalize_path("/wiki/Help%3aContents"), "/wiki/Help:Contents");
/// assert_eq!(normalize_path("/files/a%2fb"), "/files/a%2Fb");
/// ```
pub fn normalize_path(raw: &str) -> String {
    normalized(raw).to_string()
}

/// [`normalize_path`] into a [`Text`]: no allocation for short paths that are normal already.
pub(crate) fn normalized(raw: &str) -> Text {
    normalized_and_routed(raw).0
}

/// The normalized path and, when it differs, the path as routed (the raw path without its
/// query and fragment): one pass, and no comparison for a path that is normal already.
pub(crate) fn normalized_and_routed(raw: &str) -> (Text, Option<Text>) {
    if let Some(normal) = normal_prefix(raw) {
        return (Text::from(normal), None);
    }
    let raw = match raw.bytes().position(|b| b == b'?' || b == b'#') {
        // `?` and `#` are ASCII: `end` is a character boundary.
        Some(end) => raw.get(..end).unwrap_or(raw),
        None => raw,
    };
    if is_normal(raw) {
        return (Text::from(raw), None);
    }
    let normal = normalize_slow(raw);
    let routed = (normal != raw).then(|| Text::from(raw));
    (Text::from(normal), routed)
}

/// The bytes [`normal_prefix`] stops at: `?` and `#` (the end of the path), `%`, `/` and
/// `.`.
static STOPS: [bool; 256] = {
    let mut stops = [false; 256];
    let mut i = 0;
    while i < 5 {
        stops[b"?#%/."[i] as usize] = true;
        i += 1;
    }
    stops
};

/// The path before its query or fragment, when that is normal ([`is_normal`]) as it is:
/// one pass that stops only at the bytes of [`STOPS`]; `None` when it cannot tell at once
/// (an escape, an empty, `.` or `..` segment, a trailing `/`, no leading `/`), which the
/// general path then decides.
fn normal_prefix(raw: &str) -> Option<&str> {
    let b = raw.as_bytes();
    if b.first() != Some(&b'/') {
        return None;
    }
    // The end of the path: its length, or the `?` or `#` that starts the query or fragment.
    let at_end = |i: usize| i == b.len() || b[i] == b'?' || b[i] == b'#';
    let mut i = 1;
    loop {
        while i < b.len() && !STOPS[usize::from(b[i])] {
            i += 1;
        }
        if at_end(i) {
            // Normal unless it ends with `/` (the root aside). The bytes before `i` are
            // ASCII at `i`, so `i` is a character boundary.
            return (i == 1 || b[i - 1] != b'/').then(|| raw.get(..i)).flatten();
        }
        match b[i] {
            b'/' if b[i - 1] == b'/' => return None,
            // A `.` or `..` segment.
            b'.' if b[i - 1] == b'/'
                && (at_end(i + 1) || b[i + 1] == b'/' || (b[i + 1] == b'.' && (at_end(i + 2) || b[i + 2] == b'/'))) =>
            {
                return None
            }
            b'%' => return None,
            _ => i += 1,
        }
    }
}

fn normalize_slow(raw: &str) -> String {
    let decoded = decode_escapes(raw);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    if segments.is_empty() {
        out.push('/');
    }
    for s in segments {
        out.push('/');
        out.push_str(s);
    }
    out
}

/// Whether a path is already normalized: starts with `/`, no escapes, no empty, `.` or
/// `..` segments, no trailing `/` (except the root).
fn is_normal(path: &str) -> bool {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    if b.len() == 1 {
        return true;
    }
    if b[b.len() - 1] == b'/' {
        return false;
    }
    // Reject `%`, `//`, and `/.` starting a `.` or `..` segment.
    let mut prev = b'/';
    for (i, &c) in b.iter().enumerate().skip(1) {
        match c {
            b'%' => return false,
            b'/' if prev == b'/' => return false,
            b'.' if prev == b'/' => {
                let rest = &b[i + 1..];
                if rest.is_empty() || rest[0] == b'/' || (rest[0] == b'.' && (rest.len() == 1 || rest[1] == b'/')) {
                    return false;
                }
            }
            _ => {}
        }
        prev = c;
    }
    true
}

/// Decodes `%XX` escapes, as a router's path parameters are decoded (axum's `Path`
/// decodes every escape): `/wiki/Caf%C3%A9`, `/wiki/Caf\u{e9}` and `/wiki/Caf%c3%a9` are one
/// page to a `/wiki/{page}` handler, and one path here. An escape stays one, with upper-case
/// hex digits, where decoding it would change the path's structure or could not be written
/// as itself: `/` (`%2F`, so that it cannot create new segments), `%` (`%25`, so that no
/// decoded characters can form a new escape), `?` and `#` (which would end the path),
/// ASCII control characters (which a request cannot hold raw), and bytes that do not form
/// UTF-8. Other control characters (U+0080 to U+009F) are decoded: a request may hold them
/// raw, and a handler reads one character. A `%` that starts no escape is
/// written `%25`. The result is its own decoding: decoding it again changes nothing.
///
/// Not the `percent-encoding` crate: its decoder decodes every escape and yields bytes
/// without saying which came from an escape (so `%2F` could not stay apart from `/`), and
/// leaves a stray `%` as it is.
fn decode_escapes(raw: &str) -> std::borrow::Cow<'_, str> {
    if !raw.contains('%') {
        return std::borrow::Cow::Borrowed(raw);
    }
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    // The bytes of consecutive escapes, decoded together: a character of several bytes is
    // written as several escapes.
    let mut run = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            if let Some((h, l)) = bytes
                .get(i + 1)
                .zip(bytes.get(i + 2))
                .and_then(|(&h, &l)| hex(h).zip(hex(l)))
            {
                run.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        write_decoded(&mut run, &mut out);
        if bytes[i] == b'%' {
            out.push_str("%25");
            i += 1;
            continue;
        }
        // Copy one whole UTF-8 character.
        let ch_len = raw[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&raw[i..i + ch_len]);
        i += ch_len;
    }
    write_decoded(&mut run, &mut out);
    std::borrow::Cow::Owned(out)
}

/// Writes the bytes of a run of escapes (then empties it): each character as itself when
/// [`decodes_as_itself`], every other byte as an escape.
fn write_decoded(run: &mut Vec<u8>, out: &mut String) {
    let mut rest = run.as_slice();
    while !rest.is_empty() {
        let (valid, bad) = match std::str::from_utf8(rest) {
            Ok(valid) => (valid, 0),
            Err(e) => (
                std::str::from_utf8(&rest[..e.valid_up_to()]).unwrap_or_default(),
                e.error_len().unwrap_or(rest.len() - e.valid_up_to()),
            ),
        };
        for c in valid.chars() {
            if decodes_as_itself(c) {
                out.push(c);
            } else {
                c.encode_utf8(&mut [0; 4]).bytes().for_each(|b| push_escape(out, b));
            }
        }
        let bad_bytes = &rest[valid.len()..valid.len() + bad];
        bad_bytes.iter().for_each(|&b| push_escape(out, b));
        rest = &rest[valid.len() + bad..];
    }
    run.clear();
}

/// Whether a character decoded from an escape is written as itself (see [`decode_escapes`]).
fn decodes_as_itself(c: char) -> bool {
    !matches!(c, '/' | '%' | '?' | '#') && !c.is_ascii_control()
}

fn push_escape(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0xF)]));
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// A request's paths, as rules' patterns match them: the normalized path, split into
/// segments only when a pattern needs them (see [`PathPattern::matches_normalized`]), and
/// the segments of the path as routed when it differs.
pub(crate) struct RequestPaths<'a> {
    normalized: &'a str,
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
    ctx.path().len().max(ctx.routed_path().len()) > LONGEST_MATCHED_PATH
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
    fn normalized_segments(&self) -> &[&'a str] {
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

fn decoded_views<R>(raw_path: &str, f: impl FnOnce(DecodedViews<'_>) -> R) -> R {
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
const CLAMPED_ROOTS: usize = 16;

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
fn clamped_views<'a>(segments: &[&'a str]) -> Vec<Vec<&'a str>> {
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
struct Views<'a> {
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
fn find_escaped_slash(s: &str) -> Option<usize> {
    s.as_bytes().windows(3).position(|w| w == b"%2F")
}

/// Appends the parts of `s` between its `%2F`s to `out`, as `s.split("%2F")` gives them.
fn split_escaped_slash<'a>(s: &'a str, out: &mut Vec<&'a str>) {
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

fn with_split<'a, R>(parts: impl Iterator<Item = &'a str> + Clone, f: impl FnOnce(&[&'a str]) -> R) -> R {
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

/// An Ant-style path pattern: `?` matches one character, `*` any characters within one
/// segment, `**` any number of whole segments (including none).
///
/// ```
/// use fluxgate_core::PathPattern;
/// let p: PathPattern = "/api/**/orders/*".parse().unwrap();
/// assert!(p.matches("/api/v1/eu/orders/42"));
/// assert!(p.matches("/api/orders/42"));
/// assert!(!p.matches("/api/orders"));
/// let all: PathPattern = "/metrics/**".parse().unwrap();
/// assert!(all.matches("/metrics"));
/// assert!(all.matches("/metrics/a/b"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct PathPattern {
    source: String,
    segments: Vec<Segment>,
    /// The segments as written, nothing decoded and none dropped (an empty one, a trailing
    /// `/`): what a route written as the pattern serves (see
    /// [`matches_routed_as_written`](Self::matches_routed_as_written)).
    written: Vec<Segment>,
    /// For a pattern that writes `%2F`, the pattern with it read as a `/`: a wildcard
    /// parameter holds `a/b` for `/files/a%2Fb` and `/files/a/b` alike, so a rule on
    /// `/files/a%2Fb` counts both. Matched wherever the pattern's decoded spelling is, never
    /// as written.
    flat: Option<Box<PathPattern>>,
    /// How a normalized path is matched: as text, when the pattern has that shape.
    shape: Shape,
}

/// What matching a normalized path takes, worked out from the pattern's segments. A
/// normalized path is `/` or `/` followed by non-empty segments joined by `/`: its segments
/// begin with literal segments exactly when its text equals them joined (each after a `/`)
/// or continues them with a `/`.
#[derive(Clone, PartialEq, Eq, Debug)]
enum Shape {
    /// Literal segments only: the path is exactly this (`/` for none).
    Exact(String),
    /// Literal segments, then `**`: the path is this, or this then `/` and more (`""`
    /// for none: every path).
    Under(String),
    /// Another shape (globs, `**` elsewhere): the path's segments are matched.
    Segments,
}

impl Shape {
    fn of(segments: &[Segment]) -> Self {
        let (literals, any_depth) = match segments.split_last() {
            Some((Segment::AnyDepth, literals)) => (literals, true),
            _ => (segments, false),
        };
        let mut text = String::new();
        for segment in literals {
            match segment {
                Segment::Literal(literal, _) => {
                    text.push('/');
                    text.push_str(literal);
                }
                _ => return Self::Segments,
            }
        }
        match any_depth {
            true => Self::Under(text),
            false if text.is_empty() => Self::Exact("/".to_owned()),
            false => Self::Exact(text),
        }
    }
}

#[derive(Clone, PartialEq, Eq, Debug)]
enum Segment {
    /// `**`
    AnyDepth,
    /// A segment without wildcards: decoded, and as written when that differs.
    Literal(String, Option<String>),
    /// A segment with `*` or `?`: decoded, and as written when that differs.
    Glob(Vec<char>, Option<Vec<char>>),
}

/// Why a path pattern was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid path pattern `{pattern}`: {reason}")]
#[non_exhaustive]
pub struct PatternError {
    /// The pattern as given.
    pub pattern: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl FromStr for PathPattern {
    type Err = PatternError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| PatternError {
            pattern: s.to_owned(),
            reason,
        };
        if s.is_empty() {
            return Err(err("a pattern must not be empty"));
        }
        if !s.starts_with('/') {
            return Err(err("a pattern must start with `/`"));
        }
        if s.contains('#') {
            return Err(err("a pattern must not contain `#`"));
        }
        if s.chars().any(char::is_control) || s.contains(' ') {
            return Err(err("a pattern must not contain spaces or control characters"));
        }
        // Escapes mean what they mean in a path: the pattern is matched decoded, as paths
        // are (`/wiki/Caf%C3%A9` is `/wiki/Caf\u{e9}`, `/a%2fb` is `/a%2Fb`).
        let decoded = decode_escapes(s);
        if decoded.matches('*').count() != s.matches('*').count() {
            return Err(err("a pattern must not escape `*` (`%2A`): a `*` is a wildcard"));
        }
        let mut segments = Vec::new();
        // Decoding makes no `/`: the segments as written are the decoded ones, in order.
        let written = s.split('/').filter(|seg| !seg.is_empty());
        for (seg, written) in decoded.split('/').filter(|seg| !seg.is_empty()).zip(written) {
            // The segment as written, when it differs, matches a segment of the path as
            // routed spelled that way: what a route written with the same escapes serves.
            let written = (written != seg).then_some(written);
            if seg == "**" {
                // Consecutive `**` mean the same as one.
                if segments.last() != Some(&Segment::AnyDepth) {
                    segments.push(Segment::AnyDepth);
                }
            } else if seg.contains("**") {
                return Err(err("`**` must be a whole segment, as in `/api/**`"));
            } else if seg == "." || seg == ".." {
                return Err(err("a pattern must not contain `.` or `..` segments"));
            } else if seg.contains(['*', '?']) {
                segments.push(Segment::Glob(
                    seg.chars().collect(),
                    written.map(|w| w.chars().collect()),
                ));
            } else {
                segments.push(Segment::Literal(seg.to_owned(), written.map(str::to_owned)));
            }
        }
        // As written: split at every `/` after the first, empty segments kept.
        let written = match &s[1..] {
            "" => Vec::new(),
            rest => rest
                .split('/')
                .map(|seg| match seg {
                    "**" => Segment::AnyDepth,
                    seg if seg.contains(['*', '?']) => Segment::Glob(seg.chars().collect(), None),
                    seg => Segment::Literal(seg.to_owned(), None),
                })
                .collect(),
        };
        // The twin is the pattern as written with its `%2F` written `/` (a `%` that starts
        // `%2F` is never part of an escape before it). One that cannot be read
        // (`/a%2F..%2Fb` is `/a/../b`) is left out: the pattern matches as it decodes.
        let flat = match decoded.contains("%2F") {
            true => s.replace("%2F", "/").replace("%2f", "/").parse().ok().map(Box::new),
            false => None,
        };
        Ok(Self {
            source: s.to_owned(),
            shape: Shape::of(&segments),
            segments,
            written,
            flat,
        })
    }
}

impl PathPattern {
    /// Whether the pattern matches every path, normalized or as routed: `/**` (and
    /// `/**/**`, the same pattern).
    ///
    /// ```
    /// use fluxgate_core::PathPattern;
    /// assert!("/**".parse::<PathPattern>().unwrap().matches_every_path());
    /// assert!(!"/*".parse::<PathPattern>().unwrap().matches_every_path());
    /// assert!(!"/".parse::<PathPattern>().unwrap().matches_every_path());
    /// ```
    pub fn matches_every_path(&self) -> bool {
        self.segments == [Segment::AnyDepth]
    }

    /// Whether `patterns` together match every normalized path: one of them matches every
    /// path ([`matches_every_path`](Self::matches_every_path)), or they match every number
    /// of segments between them (`/` and `/*/**`, `/`, `/*` and `/**/*/*`). Only a pattern
    /// of wildcards matches every path of a number of segments: a literal, or a glob that
    /// a segment of one character of its own escapes, leaves paths out.
    ///
    /// ```
    /// use fluxgate_core::PathPattern;
    /// let all = |ps: &[&str]| PathPattern::together_match_every_path(&ps.iter().map(|p| p.parse().unwrap()).collect::<Vec<PathPattern>>());
    /// assert!(all(&["/**"]));
    /// assert!(all(&["/", "/*/**"]));
    /// assert!(all(&["/", "/?*", "/**/*/*"]));
    /// assert!(!all(&["/*/**"]));
    /// assert!(!all(&["/", "/?/**"]));
    /// ```
    pub fn together_match_every_path(patterns: &[PathPattern]) -> bool {
        // For each pattern of wildcards alone: the number of segments it takes, and
        // whether it takes any number more (`**`).
        let shapes: Vec<(usize, bool)> = patterns
            .iter()
            .filter_map(|pattern| {
                let mut segments = 0;
                let mut more = false;
                for segment in &pattern.segments {
                    match segment {
                        Segment::AnyDepth => more = true,
                        // Every segment of a normalized path (not empty): `*`s, and at most
                        // one `?`.
                        Segment::Glob(glob, _)
                            if glob.contains(&'*')
                                && glob.iter().all(|c| matches!(c, '*' | '?'))
                                && glob.iter().filter(|&&c| c == '?').count() <= 1 =>
                        {
                            segments += 1;
                        }
                        _ => return None,
                    }
                }
                Some((segments, more))
            })
            .collect();
        let Some(from) = shapes.iter().filter(|(_, more)| *more).map(|(n, _)| *n).min() else {
            return false;
        };
        (0..from).all(|n| shapes.contains(&(n, false)))
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether a normalized path matches.
    pub fn matches(&self, normalized_path: &str) -> bool {
        self.matches_normalized(&RequestPaths::normalized(normalized_path))
    }

    /// Whether a request's normalized path matches: compared as text when the pattern is
    /// literal segments, optionally followed by `**` (no split), else segment by segment.
    pub(crate) fn matches_normalized(&self, paths: &RequestPaths<'_>) -> bool {
        let path = paths.normalized;
        let matches = match &self.shape {
            Shape::Exact(text) => path == text,
            Shape::Under(text) => {
                path.starts_with(text.as_str()) && (path.len() == text.len() || path.as_bytes()[text.len()] == b'/')
            }
            Shape::Segments => matches_segments_by(&self.segments, paths.normalized_segments(), segment_matches),
        };
        matches || self.flat.as_ref().is_some_and(|flat| flat.matches_normalized(paths))
    }

    /// Whether a path matches as a router sees it: the raw path, split at every `/`,
    /// empty segments and `.` or `..` segments kept, nothing decoded (see
    /// [`routed_segments`]).
    ///
    /// ```
    /// use fluxgate_core::PathPattern;
    /// let p: PathPattern = "/api/*/login".parse().unwrap();
    /// // axum routes all three to `/api/{version}/login`.
    /// assert!(p.matches_routed("/api/../login"));
    /// assert!(p.matches_routed("/api//login"));
    /// assert!(p.matches_routed("/api/%2e%2e/login"));
    /// assert!(!p.matches("/login"));
    /// ```
    pub fn matches_routed(&self, raw_path: &str) -> bool {
        with_routed_segments(raw_path, |segments| self.matches_segments(segments))
    }

    /// Whether a path matches as a router sees it ([`matches_routed`](Self::matches_routed)),
    /// or would without its trailing `/` ([`without_trailing_slash`]): the routed view of a
    /// rule, and of the layer's `include`. The pattern ignores its own trailing `/`, so it
    /// ignores the request's too.
    ///
    /// ```
    /// use fluxgate_core::PathPattern;
    /// let p: PathPattern = "/items/*/".parse().unwrap();
    /// // axum routes both to `/items/{id}/`, with `id` empty and `..`.
    /// assert!(p.matches_routed_or_without_trailing_slash("/items//"));
    /// assert!(p.matches_routed_or_without_trailing_slash("/items/../"));
    /// assert!(!p.matches_routed("/items//"));
    /// assert!(!p.matches_routed_or_without_trailing_slash("/items/x/y/"));
    /// ```
    pub fn matches_routed_or_without_trailing_slash(&self, raw_path: &str) -> bool {
        with_routed_segments(raw_path, |segments| {
            self.matches_segments(segments)
                || without_trailing_slash(segments).is_some_and(|s| self.matches_segments(s))
        })
    }

    /// Whether a path matches as a router sees it behind a middleware that trims the runs
    /// of `/` at its start and end ([`trimmed`]); `false` when it has none.
    ///
    /// ```
    /// use fluxgate_core::PathPattern;
    /// let p: PathPattern = "/api/*/login".parse().unwrap();
    /// // Behind tower-http's `NormalizePathLayer`, axum routes it as `/api/../login`.
    /// assert!(p.matches_routed_trimmed("//api/../login/"));
    /// assert!(!p.matches_routed("//api/../login/"));
    /// assert!(!p.matches_routed_trimmed("/api/../login"));
    /// ```
    pub fn matches_routed_trimmed(&self, raw_path: &str) -> bool {
        with_routed_segments(raw_path, |segments| {
            trimmed(segments).is_some_and(|s| self.matches_segments(s))
        })
    }

    /// [`matches_segments`](Self::matches_segments) without the pattern's `%2F` read as a
    /// `/`: what an exclusion matches where no view as written stands beside it.
    pub fn matches_segments_as_spelled(&self, path: &[&str]) -> bool {
        matches_segments_by(&self.segments, path, segment_matches)
    }

    /// Whether a path already split into segments matches: the non-empty segments of a
    /// normalized path, or the segments of a path as routed ([`routed_segments`]), where
    /// `*` also matches an empty segment.
    pub fn matches_segments(&self, path: &[&str]) -> bool {
        matches_segments_by(&self.segments, path, segment_matches)
            || self.flat.as_ref().is_some_and(|flat| flat.matches_segments(path))
    }

    /// Whether a path matches as a router sees it ([`matches_routed`](Self::matches_routed)),
    /// the pattern read only as written, nothing decoded and none of its segments dropped:
    /// what a route written as the pattern serves. A pattern's decoded spelling, or without
    /// its trailing `/`, is another path to the router (a static route
    /// `/wiki/Help%3AContents` does not run for `/wiki/Help:Contents`, nor `/docs/` for
    /// `/docs`), so a layer's `exclude` leaves a request alone in this view only as written.
    ///
    /// ```
    /// use fluxgate_core::PathPattern;
    /// let p: PathPattern = "/wiki/Help%3AContents".parse().unwrap();
    /// assert!(p.matches_routed("/wiki/Help:Contents"));
    /// assert!(!p.matches_routed_as_written("/wiki/Help:Contents"));
    /// assert!(p.matches_routed_as_written("/wiki/Help%3AContents"));
    /// let docs: PathPattern = "/docs/".parse().unwrap();
    /// assert!(docs.matches_routed("/docs") && !docs.matches_routed_as_written("/docs"));
    /// assert!(docs.matches_routed_as_written("/docs/"));
    /// ```
    pub fn matches_routed_as_written(&self, raw_path: &str) -> bool {
        with_routed_segments(raw_path, |segments| {
            matches_segments_by(&self.written, segments, segment_matches_as_written)
        })
    }

    /// [`matches_routed_trimmed`](Self::matches_routed_trimmed), the pattern read only as
    /// written ([`matches_routed_as_written`](Self::matches_routed_as_written)) and without
    /// its empty segments at either end, as the trimming middleware leaves the path.
    pub fn matches_routed_trimmed_as_written(&self, raw_path: &str) -> bool {
        with_routed_segments(raw_path, |segments| {
            // The pattern as the same middleware would leave it: without its empty segments at
            // either end.
            let empty = |segment: &Segment| matches!(segment, Segment::Literal(text, None) if text.is_empty());
            let start = self.written.iter().take_while(|s| empty(s)).count();
            let end = self.written.len() - self.written[start..].iter().rev().take_while(|s| empty(s)).count();
            trimmed(segments)
                .is_some_and(|s| matches_segments_by(&self.written[start..end], s, segment_matches_as_written))
        })
    }
}

/// Whether segments match a pattern's segments, each by `segment_matches`.
fn matches_segments_by(pat: &[Segment], path: &[&str], segment_matches: fn(&Segment, &str) -> bool) -> bool {
    // Iterative wildcard matching over segments, `**` as the star.
    let (mut p, mut s) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    let last_star = pat.iter().rposition(|segment| *segment == Segment::AnyDepth);
    while s < path.len() {
        if p < pat.len() && pat[p] == Segment::AnyDepth {
            if Some(p) == last_star {
                // What follows the last `**` takes one segment each, so it can only match the
                // path's last ones: tried there alone, rather than from every segment on (a
                // long path against `/**/*.css`). No earlier `**` is tried again past a later
                // one, here as in the loop.
                let (tail, rest) = (&pat[p + 1..], &path[s..]);
                return rest.len() >= tail.len()
                    && tail
                        .iter()
                        .zip(&rest[rest.len() - tail.len()..])
                        .all(|(pattern, segment)| segment_matches(pattern, segment));
            }
            backtrack = Some((p, s));
            p += 1;
        } else if p < pat.len() && segment_matches(&pat[p], path[s]) {
            p += 1;
            s += 1;
        } else if let Some((bp, bs)) = backtrack {
            p = bp + 1;
            s = bs + 1;
            backtrack = Some((bp, bs + 1));
        } else {
            return false;
        }
    }
    pat[p..].iter().all(|seg| *seg == Segment::AnyDepth)
}

fn segment_matches(pattern: &Segment, segment: &str) -> bool {
    match pattern {
        Segment::AnyDepth => true,
        Segment::Literal(lit, written) => lit == segment || written.as_deref() == Some(segment),
        Segment::Glob(glob, written) => {
            glob_matches_decoded(glob, segment) || written.as_deref().is_some_and(|w| glob_matches_decoded(w, segment))
        }
    }
}

/// Whether a glob matches a segment as its handler reads it, decoded: as [`glob_matches`],
/// and where the segment holds an escape (`%3F`, `%25`, `%23` stay escapes in the decoded
/// views; the raw view keeps them all), `?` may also take the whole escape, one
/// character to the handler. `/wiki/?` counts `/wiki/%3F` as it counts `/wiki/x`.
fn glob_matches_decoded(glob: &[char], text: &str) -> bool {
    if !text.contains('%') || !glob.contains(&'?') {
        return glob_matches(glob, text);
    }
    // Over the text's character boundaries: `reach[j]`, the glob so far matches `text[..j]`.
    let bytes = text.as_bytes();
    let escape_at = |j: usize| {
        bytes.get(j) == Some(&b'%')
            && bytes.get(j + 1).is_some_and(u8::is_ascii_hexdigit)
            && bytes.get(j + 2).is_some_and(u8::is_ascii_hexdigit)
    };
    // Two rows, reused: a segment of a hostile path may be long.
    let mut reach = vec![false; text.len() + 1];
    let mut next = vec![false; text.len() + 1];
    reach[0] = true;
    for &g in glob {
        next.fill(false);
        let mut any = false;
        for j in 0..=text.len() {
            if g == '*' {
                any |= reach[j];
                next[j] |= any;
                continue;
            }
            let Some(c) = reach[j]
                .then(|| text.get(j..).and_then(|rest| rest.chars().next()))
                .flatten()
            else {
                continue;
            };
            if g == '?' || g == c {
                next[j + c.len_utf8()] = true;
            }
            if g == '?' && escape_at(j) {
                next[j + 3] = true;
            }
        }
        if !next.contains(&true) {
            return false;
        }
        std::mem::swap(&mut reach, &mut next);
    }
    reach[text.len()]
}

/// A segment of a pattern as written (`PathPattern::written`, which holds no second
/// spelling) against a segment as routed: the text alone, no escape read as a character.
fn segment_matches_as_written(pattern: &Segment, segment: &str) -> bool {
    match pattern {
        Segment::AnyDepth => true,
        Segment::Literal(lit, _) => lit == segment,
        Segment::Glob(glob, _) => glob_matches(glob, segment),
    }
}

fn glob_matches(glob: &[char], text: &str) -> bool {
    // `t` is a byte offset into `text`, always at a character boundary: no allocation.
    let next = |t: usize| text[t..].chars().next();
    let (mut p, mut t) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while let Some(c) = next(t) {
        if p < glob.len() && glob[p] == '*' {
            backtrack = Some((p, t));
            p += 1;
        } else if p < glob.len() && (glob[p] == '?' || glob[p] == c) {
            p += 1;
            t += c.len_utf8();
        } else if let Some((bp, bt)) = backtrack {
            // The star takes one more character.
            let bt = bt + next(bt).map_or(1, char::len_utf8);
            p = bp + 1;
            t = bt;
            backtrack = Some((bp, bt));
        } else {
            return false;
        }
    }
    glob[p..].iter().all(|c| *c == '*')
}

impl fmt::Debug for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PathPattern").field(&self.source).finish()
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut seed = 0xc1a3_u64;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) as usize % n
        };
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
        let mut seed = 0x5eed_u64;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) as usize % n
        };
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
