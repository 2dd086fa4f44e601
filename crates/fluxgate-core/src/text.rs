//! [`Text`]: a string kept inline when short, so that the usual paths and keys of a
//! request cost no allocation; [`Shown`]: a text that may come from a request, as an error
//! or a log line shows it.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

const INLINE: usize = 46;

/// The most characters of a name or value an error or a log line shows: an error about a
/// 10 MB id is not 10 MB long.
const SHOWN: usize = 64;

/// Displays a text as an error or a log line shows it: its first 64 characters, then `…`
/// when there are more, each control character escaped (`\n`, `\u{1b}`), and so is each
/// character a terminal would not show as itself (a bidirectional override, `\u{202e}`; a
/// zero-width space, `\u{200b}`).
///
/// The text may come from a request or from whoever may write rules or rule change messages
/// (a rule set id a customizer read from a header, a message's `source`): written whole it
/// made a log field as long as the header, and a line break or a terminal escape written as
/// it is forged a log line of its own. Written as it is formatted: nothing is allocated.
///
/// ```
/// use fluxgate_core::Shown;
/// assert_eq!(Shown("api\n2025 ERROR forged").to_string(), "api\\n2025 ERROR forged");
/// assert_eq!(Shown("user\u{202e}nimda").to_string(), "user\\u{202e}nimda");
/// assert_eq!(Shown("a\u{200b}b").to_string(), "a\\u{200b}b");
/// assert_eq!(Shown("café \"x\"").to_string(), "café \"x\"");
/// let long = "x".repeat(100);
/// assert_eq!(Shown(&long).to_string().chars().count(), 65);
/// assert_eq!(format!("{:?}", Shown(&long)).chars().count(), 67);
/// ```
#[derive(Clone, Copy)]
pub struct Shown<'a>(pub &'a str);

/// As [`Display`](fmt::Display) shows it, in quotes: never the whole text.
impl fmt::Debug for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use std::fmt::Write as _;
        for (i, c) in self.0.chars().enumerate() {
            if i == SHOWN {
                return f.write_char('…');
            }
            // Control characters, and the characters Rust does not print as they are:
            // format characters (bidirectional overrides such as U+202E, which reorder
            // what a terminal shows after them, zero-width characters), unassigned ones,
            // combining marks; not quotes or backslashes, which `escape_debug` escapes too.
            let escaped = c.is_control() || (!matches!(c, '"' | '\'' | '\\') && c.escape_debug().len() > 1);
            if escaped {
                write!(f, "{}", c.escape_debug())?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// A string stored inline up to 46 bytes, on the heap beyond.
///
/// ```
/// use fluxgate_core::Text;
/// use std::fmt::Write;
/// let mut t = Text::new();
/// t.push_str("ip=");
/// write!(t, "{}", 10).unwrap();
/// assert_eq!(t, "ip=10");
/// let long = Text::from("x".repeat(100).as_str());
/// assert_eq!(long.len(), 100);
/// ```
#[derive(Clone)]
pub struct Text(Repr);

#[derive(Clone)]
enum Repr {
    Inline { len: u8, buf: [u8; INLINE] },
    Heap(String),
}

impl Text {
    /// An empty text.
    pub const fn new() -> Self {
        Self(Repr::Inline {
            len: 0,
            buf: [0; INLINE],
        })
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Only whole `str`s are ever copied in, so this never fails.
            Repr::Inline { len, buf } => std::str::from_utf8(&buf[..usize::from(*len)]).unwrap_or_default(),
            Repr::Heap(s) => s,
        }
    }

    /// Appends a string.
    pub fn push_str(&mut self, s: &str) {
        match &mut self.0 {
            Repr::Inline { len, buf } => {
                let at = usize::from(*len);
                let end = at + s.len();
                if end <= INLINE {
                    buf[at..end].copy_from_slice(s.as_bytes());
                    // `end <= INLINE < 256`.
                    *len = end as u8;
                } else {
                    let mut heap = String::with_capacity(end.max(2 * INLINE));
                    heap.push_str(std::str::from_utf8(&buf[..at]).unwrap_or_default());
                    heap.push_str(s);
                    self.0 = Repr::Heap(heap);
                }
            }
            Repr::Heap(h) => h.push_str(s),
        }
    }

    /// Appends ASCII bytes (anything else is replaced by `?`, so the text stays UTF-8).
    pub(crate) fn push_ascii(&mut self, bytes: &[u8]) {
        if let (true, Repr::Inline { len, buf }) = (bytes.is_ascii(), &mut self.0) {
            let at = usize::from(*len);
            let end = at + bytes.len();
            if end <= INLINE {
                buf[at..end].copy_from_slice(bytes);
                // `end <= INLINE < 256`.
                *len = end as u8;
                return;
            }
        }
        for &b in bytes {
            self.push(if b.is_ascii() { char::from(b) } else { '?' });
        }
    }

    /// Appends a character.
    pub fn push(&mut self, c: char) {
        if let (true, Repr::Inline { len, buf }) = (c.is_ascii(), &mut self.0) {
            let at = usize::from(*len);
            if at < INLINE {
                // An ASCII character is one byte.
                buf[at] = c as u8;
                *len += 1;
                return;
            }
        }
        self.push_str(c.encode_utf8(&mut [0; 4]));
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    /// Whether the text is empty.
    pub fn is_empty(&self) -> bool {
        self.as_bytes().is_empty()
    }

    /// The text's bytes (no UTF-8 check).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, buf } => &buf[..usize::from(*len)],
            Repr::Heap(s) => s.as_bytes(),
        }
    }

    /// Empties the text.
    pub fn clear(&mut self) {
        match &mut self.0 {
            Repr::Inline { len, .. } => *len = 0,
            Repr::Heap(h) => h.clear(),
        }
    }
}

impl Default for Text {
    fn default() -> Self {
        Self::new()
    }
}

impl Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Text {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for Text {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        let mut t = Self::new();
        t.push_str(s);
        t
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        if s.len() <= INLINE {
            Self::from(s.as_str())
        } else {
            Self(Repr::Heap(s))
        }
    }
}

impl fmt::Write for Text {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.push_str(s);
        Ok(())
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq for Text {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Text {}

impl PartialEq<str> for Text {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl Hash for Text {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The same as `str`'s, without the UTF-8 check of `as_str`.
        state.write(self.as_bytes());
        state.write_u8(0xff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_from_inline_to_heap() {
        let mut t = Text::new();
        for i in 0..40 {
            t.push_str("ab");
            t.push('é');
            assert_eq!(t.len(), (i + 1) * 4);
        }
        assert_eq!(t.as_str(), "abé".repeat(40));
        t.clear();
        assert_eq!(t, "");
        let exact = "y".repeat(INLINE);
        assert_eq!(Text::from(exact.as_str()), exact.as_str());
        assert_eq!(Text::from(format!("{exact}z")).as_str(), format!("{exact}z"));
    }
}
