//! Ant-style path patterns and how they match a view's segments.

use super::*;

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
pub(super) enum Shape {
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
pub(super) enum Segment {
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
pub(super) fn matches_segments_by(pat: &[Segment], path: &[&str], segment_matches: fn(&Segment, &str) -> bool) -> bool {
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

pub(super) fn segment_matches(pattern: &Segment, segment: &str) -> bool {
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
pub(super) fn glob_matches_decoded(glob: &[char], text: &str) -> bool {
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
pub(super) fn segment_matches_as_written(pattern: &Segment, segment: &str) -> bool {
    match pattern {
        Segment::AnyDepth => true,
        Segment::Literal(lit, _) => lit == segment,
        Segment::Glob(glob, _) => glob_matches(glob, segment),
    }
}

pub(super) fn glob_matches(glob: &[char], text: &str) -> bool {
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
