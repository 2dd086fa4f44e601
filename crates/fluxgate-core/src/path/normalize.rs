//! The normalized path: escapes decoded as a router decodes parameters, dot segments
//! resolved, repeated and trailing `/` dropped.

use super::*;

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
pub(super) static STOPS: [bool; 256] = {
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
pub(super) fn normal_prefix(raw: &str) -> Option<&str> {
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

pub(super) fn normalize_slow(raw: &str) -> String {
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
pub(super) fn is_normal(path: &str) -> bool {
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
pub(super) fn decode_escapes(raw: &str) -> std::borrow::Cow<'_, str> {
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
pub(super) fn write_decoded(run: &mut Vec<u8>, out: &mut String) {
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
pub(super) fn decodes_as_itself(c: char) -> bool {
    !matches!(c, '/' | '%' | '?' | '#') && !c.is_ascii_control()
}

pub(super) fn push_escape(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0xF)]));
}

pub(super) fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}
